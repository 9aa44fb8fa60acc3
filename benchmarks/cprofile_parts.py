"""Own time of a cProfile run sorted into the parts of Tessera's executor path, shared by the benchmarks that
profile it (`bench_executor.py`, `profile_serve.py`)."""

from __future__ import annotations

import pstats
from collections import defaultdict
from dataclasses import dataclass, field

# The parts, in the order the benchmarks print them.
TORCH_OPS = "torch_ops"
KERNEL_PYTHON = "kernel_python"
TORCH_PYTHON = "torch_python"
EXECUTOR = "executor"
OTHER = "other"


@dataclass
class ProfileParts:
    """Own seconds per part, the seconds inside scaled_dot_product_attention and the executor's kernel calls."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    attention_s: float = 0.0
    kernel_calls: int = 0


def profile_parts(stats: pstats.Stats) -> ProfileParts:
    """Sort every function's own time in ``stats`` into torch's C++ ops, tessera's kernel bodies, torch's Python,
    the executor's Python and the rest."""
    parts = ProfileParts()
    for (path, _line, name), (_cc, calls, own, _cum, _callers) in stats.stats.items():
        if path == "~" and "torch" in name:
            parts.seconds[TORCH_OPS] += own
            parts.attention_s += own if "scaled_dot_product_attention" in name else 0.0
        elif "tessera/kernels" in path:
            parts.seconds[KERNEL_PYTHON] += own
        elif "/torch/" in path:
            parts.seconds[TORCH_PYTHON] += own
        elif "tessera/runtime/executor" in path:
            parts.seconds[EXECUTOR] += own
            if name == "run_kernel":
                parts.kernel_calls = max(parts.kernel_calls, calls)
        else:
            parts.seconds[OTHER] += own
    return parts
