"""Decode kernels whose time follows the cache position: on a CPU, Tessera's decode attention reads every row's
cache up to the step's furthest position (`tessera.kernels.attention.decode_attention`), so its time grows
with the KV positions it reads, rows x (furthest position + 1), whatever the cache's size and whatever the
other rows' positions (a batch of mixed positions costs what every row at the furthest costs, measured in
benchmarks/README.md, "Decode attention by each step's position"). No other kernel of a decode step varies with
the position beyond the noise of two profiles.

A `PositionModel` fits each such kernel's time linearly in the KV positions it reads, from a decode step profiled
at two positions on one device, and charges it for a step of any rows at any position of the cache.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from tessera.errors import TesseraError
from tessera.graph.ir import Kernel, KernelGraph

POSITIONAL_OPS = frozenset({"tessera.decode_attention.default"})


class PositionError(TesseraError, ValueError):
    """A cache position outside the context, or two profiles that cannot be fitted between."""


def positional_key(kernel: Kernel) -> str | None:
    """What a kernel whose time follows the cache position shares its fit with (op, dtypes, heads, head sizes,
    scale, window: not its rows or cache length); None for a kernel whose time does not follow the position."""
    if kernel.op not in POSITIONAL_OPS:
        return None
    q, k, v = (a["$t"] for a in kernel.args[:3])
    rest = [a for a in kernel.args[5:] if not (isinstance(a, dict) and "$t" in a)]
    return repr((kernel.op, q[1], tuple(q[3][1:]), k[1], k[3][1], k[3][3], v[3][1], v[3][3], rest))


def kernel_rows(kernel: Kernel) -> int:
    """The rows (queries) a positional kernel serves: its query's first dimension."""
    return int(kernel.args[0]["$t"][3][0])


def profiled_positions(ctx: int) -> tuple[int, int]:
    """The two cache positions a decode step of a cache of ``ctx`` positions is profiled at: a short context (an
    eighth into the cache) and the longest (its last position)."""
    if ctx < 2:
        raise PositionError(f"a decode step is profiled at two positions of its cache; a cache of {ctx} position "
                            "has one")
    return max(0, ctx // 8 - 1), ctx - 1


def check_position(position: int, ctx: int, what: str = "the step's cache") -> None:
    """Raise `PositionError` unless ``position`` is a position of a cache of ``ctx`` (0 .. ctx - 1)."""
    if not 0 <= position < ctx:
        raise PositionError(f"position {position} is outside {what} of {ctx} positions (0 .. {ctx - 1})")


def interpolate(short_s: float, long_s: float, positions: tuple[int, int], position: int) -> float:
    """A time measured ``short_s`` and ``long_s`` at the two ``positions``, linearly at ``position`` (>= 0)."""
    lo, hi = positions
    return max(0.0, short_s + (long_s - short_s) * (position - lo) / (hi - lo))


@dataclass(frozen=True)
class PositionFit:
    """One positional kernel's seconds: ``base_s`` plus ``per_position_s`` for every KV position it reads."""

    base_s: float
    per_position_s: float

    def time_s(self, rows: int, position: int) -> float:
        """Seconds of the kernel over ``rows`` rows whose furthest position is ``position``."""
        return max(0.0, self.base_s + self.per_position_s * rows * (position + 1))


@dataclass(frozen=True)
class PositionModel:
    """The positional kernels of decode steps profiled on ``device`` at ``positions`` (short, long) of a cache of
    ``ctx`` positions, each kernel's time fitted through its two measurements (by `positional_key`); ``planned``:
    the planned workload's mean position, where a step without a position of its own is charged."""

    device: str
    positions: tuple[int, int]
    ctx: int
    fits: dict[str, PositionFit] = field(default_factory=dict)
    planned: int | None = None

    @classmethod
    def fit(cls, graph: KernelGraph, device: str, positions: tuple[int, int], short_s: list[float],
            long_s: list[float], planned: int | None = None) -> PositionModel:
        """Fit the positional kernels of ``graph`` (a decode step) from its kernels' times measured on
        ``device`` with every row at ``positions[0]`` (``short_s``, by kernel index) and at ``positions[1]``
        (``long_s``); a kernel shared by several layers takes the median of their times."""
        ctx = int(graph.meta.get("ctx") or 0)
        lo, hi = positions
        for p in positions:
            check_position(p, ctx, "the profiled decode step's cache")
        if hi <= lo:
            raise PositionError(f"a fit needs a short and a longer position (got {lo} and {hi})")
        if len(short_s) != len(graph.kernels) or len(long_s) != len(graph.kernels):
            raise PositionError(f"times of {len(short_s)} and {len(long_s)} kernels for a graph of "
                                f"{len(graph.kernels)}: both profiles must time this graph")
        groups: dict[str, tuple[int, list[float], list[float]]] = {}
        for k in graph.kernels:
            key = positional_key(k)
            if key is not None:
                rows, short, long = groups.setdefault(key, (kernel_rows(k), [], []))
                short.append(short_s[k.index])
                long.append(long_s[k.index])
        fits = {}
        for key, (rows, short, long) in groups.items():
            t_lo, t_hi = statistics.median(short), statistics.median(long)
            per = (t_hi - t_lo) / (rows * (hi - lo))
            fits[key] = PositionFit(t_lo - per * rows * (lo + 1), per)
        if planned is not None:
            check_position(planned, ctx, "the profiled decode step's cache")
        return cls(device, positions, ctx, fits, planned)

    def merged(self, other: PositionModel) -> PositionModel:
        """This model with ``other``'s fits (another decode graph's; its fit wins for a shared kernel)."""
        if other.device != self.device:
            raise PositionError(f"position models of {self.device} and {other.device} cannot be merged")
        return PositionModel(self.device, other.positions, max(self.ctx, other.ctx), {**self.fits, **other.fits},
                             other.planned if other.planned is not None else self.planned)

    def kernel_s(self, kernel: Kernel, position: int) -> float | None:
        """Seconds of ``kernel`` in a step whose furthest cache position is ``position``; None for a kernel this
        model has no fit for (not positional, or of another layout)."""
        key = positional_key(kernel)
        fit = self.fits.get(key) if key is not None else None
        if fit is None:
            return None
        if position < 0:
            raise PositionError(f"position {position} is outside the cache (positions are 0 or more)")
        return fit.time_s(kernel_rows(kernel), position)

