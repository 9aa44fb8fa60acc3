"""What a step of Tessera's own engine costs on this host's CPU beyond its kernels' profiled times: the
executor's host time per kernel, weights streamed from memory rather than from warm caches, and the serving
engine's own work per step. Measured by probes (`tessera.runtime.overhead_probe`), cached per host and per
version of the code they time, carried by the host's :class:`~tessera.cost.profile.Profile` into the cost
model (per kernel) and the step timer (per step).

Why each is there (measured, `benchmarks/README.md`, "What the simulator leaves out of a served step"):
`tessera profile` calls each kernel alone, repeatedly, on its bound arguments, so its times hold neither the
executor's work around a call (views, outputs, frees) nor the cost of reading a weight that the rest of the
step has evicted: in a decode step of smollm2-135m the GEMMs run at DRAM speed (6 GB/s here) against the
profile's 9-22 GB/s from the last-level cache.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tessera.cost.figure_cache import read_figures, write_figures
from tessera.errors import TesseraError

OVERHEAD_KIND = "tessera-host-overhead"
OVERHEAD_VERSION = 3  # 2: weight bandwidth per shape; 3: cold weights' excess per shape and rows


class HostOverheadError(TesseraError, ValueError):
    """Host overhead figures that cannot be used: negative, not finite, or a damaged cache file."""


@dataclass(frozen=True)
class HostOverhead:
    """Per-kernel and per-step host costs of Tessera's engine on this CPU at ``threads`` threads.

    ``dispatch_s``: the executor's host seconds per kernel beyond the kernel's own call (measured on tiny
    kernels, where the call itself costs little); ``weight_bandwidth``: bytes per second a one-row GEMM reads
    weights at when they come from memory (weights beyond the last-level cache, cycled); ``engine_step_s``:
    the serving engine's own seconds per step outside the workers (building inputs, taking tokens,
    detokenising, events), 0 where not measured. ``source`` says how and when they were measured."""

    dispatch_s: float
    weight_bandwidth: float
    engine_step_s: float = 0.0
    threads: int = 1
    source: str = ""
    # (out, in, bytes/s) per measured 2-D weight shape: a GEMM reading only such weights streams each at its rate
    shape_bandwidth: tuple[tuple[int, int, float], ...] = ()
    # host seconds a kernel takes inside a real step beyond its profile and dispatch_s (`runtime.step_excess_probe`)
    in_step_s: float = 0.0
    # (out, in, rows, seconds) per measured 2-D weight shape and row count: how much longer a GEMM of that many
    # rows runs with its weight read from memory than with it warm in the caches, as the profiler calls it
    cold_excess: tuple[tuple[int, int, int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("dispatch_s", "engine_step_s", "in_step_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise HostOverheadError(f"host overhead {name} must be a finite number of seconds >= 0, got {value!r}")
        bw = self.weight_bandwidth
        if not isinstance(bw, (int, float)) or isinstance(bw, bool) or not math.isfinite(bw) or bw <= 0:
            raise HostOverheadError(f"host overhead weight_bandwidth must be a finite bytes/s > 0, got {bw!r}")
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1:
            raise HostOverheadError(f"host overhead threads must be a whole number >= 1, got {self.threads!r}")
        for row in self.shape_bandwidth:
            if (len(row) != 3 or min(row[0], row[1]) < 1 or not math.isfinite(row[2]) or row[2] <= 0):
                raise HostOverheadError(f"host overhead shape_bandwidth rows must be (out, in, bytes/s > 0), got {row!r}")
        for row in self.cold_excess:
            if len(row) != 4 or min(row[0], row[1], row[2]) < 1 or not math.isfinite(row[3]) or row[3] < 0:
                raise HostOverheadError(f"host overhead cold_excess rows must be (out, in, rows >= 1, seconds >= 0), "
                                        f"got {row!r}")

    def read_s(self, weight_bytes: float, reads: list[tuple[tuple[int, ...], float]] | None = None) -> float:
        """Seconds to read a kernel's weights from memory: each 2-D weight of ``reads`` (shape, bytes) at its
        shape's measured rate where every one has one, else ``weight_bytes`` at the averaged rate."""
        rates = {(o, i): bw for o, i, bw in self.shape_bandwidth}
        if reads and all(tuple(shape) in rates for shape, _ in reads):
            return sum(nbytes / rates[tuple(shape)] for shape, nbytes in reads)
        return weight_bytes / self.weight_bandwidth

    def cold_s(self, shape: tuple[int, ...], rows: int) -> float | None:
        """Seconds a GEMM of ``rows`` rows over a weight of ``shape`` runs longer with the weight read from memory
        than warm (``cold_excess``: linear between the measured row counts, the nearest one beyond them); None
        for a shape not measured."""
        points = sorted((r, s) for o, i, r, s in self.cold_excess if (o, i) == tuple(shape))
        if not points:
            return None
        at = bisect_left([r for r, _ in points], rows)
        if at == 0:
            return points[0][1]
        if at == len(points):
            return points[-1][1]
        (r0, s0), (r1, s1) = points[at - 1], points[at]
        return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)

    def kernel_s(self, profiled_s: float, weight_bytes: float,
                 reads: list[tuple[tuple[int, ...], float]] | None = None, rows: int | None = None) -> float:
        """A kernel's seconds inside a step of Tessera's engine, plus the executor's dispatch: for a GEMM of
        ``rows`` rows whose 2-D weights all have a measured ``cold_excess``, its profiled (warm) time plus their
        cold excess at those rows; otherwise its profiled time, or its weights read from memory where that takes
        longer (:meth:`read_s`). A kernel that reads no weight matrix also pays the excess of such a kernel
        inside a real step (``in_step_s``, measured on exactly those kernels); a weight-reading kernel's time in
        a step is what the weights' read models."""
        matrices = [shape for shape, _ in reads or () if len(shape) == 2]
        extra = [self.cold_s(shape, rows) for shape in matrices] if rows is not None else []
        if matrices and extra and None not in extra:
            body = profiled_s + sum(extra)
        else:
            body = max(profiled_s, self.read_s(weight_bytes, reads))
        return body + self.dispatch_s + (0.0 if matrices else self.in_step_s)

    def with_engine_step(self, seconds: float, how: str) -> HostOverhead:
        """The same figures with the engine's per-step work ``seconds`` (measured as ``how``)."""
        return replace(self, engine_step_s=seconds, source=f"{self.source}; engine step {how}")

    def with_in_step(self, seconds: float, how: str) -> HostOverhead:
        """The same figures with ``seconds`` more per kernel inside a real step (measured as ``how``)."""
        return replace(self, in_step_s=seconds, source=f"{self.source}; in a step {how}")

    def describe(self) -> str:
        step = f" + {self.in_step_s * 1e6:.1f} in a real step" if self.in_step_s else ""
        return (f"executor {self.dispatch_s * 1e6:.1f} us a kernel{step}, weights from memory at "
                f"{self.weight_bandwidth / 1e9:.2f} GB/s, engine {self.engine_step_s * 1e3:.2f} ms a step "
                f"({self.threads} thread{'s' if self.threads != 1 else ''})")

    def to_dict(self, key: dict[str, Any]) -> dict[str, Any]:
        """The versioned JSON object of these figures, for the cache ``key``."""
        return {"kind": OVERHEAD_KIND, "version": OVERHEAD_VERSION, "key": key, **asdict(self)}

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> HostOverhead:
        """Rebuild from :meth:`to_dict`'s object (kind, version and every field checked)."""
        if not isinstance(d, dict) or d.get("kind") != OVERHEAD_KIND or d.get("version") != OVERHEAD_VERSION:
            raise HostOverheadError(f"{source}: not a version-{OVERHEAD_VERSION} {OVERHEAD_KIND} file; delete it "
                                    "and it is measured again")
        names = ("dispatch_s", "weight_bandwidth", "engine_step_s", "threads", "source", "shape_bandwidth",
                 "cold_excess")
        missing = [n for n in names if n not in d]
        if missing:
            raise HostOverheadError(f"{source}: lacks field(s) {', '.join(missing)}; delete it and it is measured again")
        try:
            rows = tuple((int(o), int(i), float(bw)) for o, i, bw in d["shape_bandwidth"])
            cold = tuple((int(o), int(i), int(r), float(s)) for o, i, r, s in d["cold_excess"])
        except (TypeError, ValueError):
            raise HostOverheadError(f"{source}: shape_bandwidth must be [out, in, bytes/s] rows and cold_excess "
                                    "[out, in, rows, seconds] rows; delete it and it is measured again") from None
        return cls(**{n: d[n] for n in names[:-2]}, shape_bandwidth=rows, cold_excess=cold)


def read_cached(path: Path, key: dict[str, Any], quiet: bool = False) -> HostOverhead | None:
    """The figures cached at ``path`` if measured for ``key`` (`tessera.cost.figure_cache.read_figures`)."""
    return read_figures(path, key, HostOverhead.from_dict, quiet)


def write_cached(path: Path, key: dict[str, Any], overhead: HostOverhead, busy: bool = False) -> None:
    """Cache ``overhead`` at ``path`` for ``key`` (atomically); ``busy``: measured on a busy host."""
    write_figures(path, overhead.to_dict(key), busy)
