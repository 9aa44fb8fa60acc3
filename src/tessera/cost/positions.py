"""Decode kernels whose time follows the cache position: on a CPU, Tessera's decode attention reads every row's
cache up to the step's furthest position (`tessera.kernels.attention.decode_attention`), so its time grows
with the KV positions it reads, rows x (furthest position + 1), whatever the cache's size and whatever the
other rows' positions (a batch of mixed positions costs what every row at the furthest costs, measured in
benchmarks/README.md, "Decode attention by each step's position"). No other kernel of a decode step varies with
the position beyond the noise of two profiles.

A `PositionModel` fits each such kernel's time piecewise linearly in the KV positions it reads, from a decode step
profiled at a few positions on one device (`profiled_positions`: a very short context, a short one and the
longest), and charges it for a step of any rows at any position of the cache. The time is not one line: a short
context has a floor of fixed work per call, and the working set leaving the last-level cache bends it upward
further on (benchmarks/README.md).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
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


def profiled_positions(ctx: int) -> tuple[int, ...]:
    """The cache positions, rising, a decode step of a cache of ``ctx`` positions is profiled at: a very short
    context (a sixty-fourth into the cache, where it is at least position 1 and short of the next), a short one (an
    eighth into it) and the longest (its last position)."""
    if ctx < 2:
        raise PositionError(f"a decode step is profiled at two positions of its cache; a cache of {ctx} position "
                            "has one")
    short = max(0, ctx // 8 - 1)
    shortest = ctx // 64 - 1
    return ((shortest,) if 1 <= shortest < short else ()) + (short, ctx - 1)


def segment(positions: tuple[int, ...], position: int) -> int:
    """The index i of the segment (positions[i], positions[i + 1]) of rising ``positions`` that charges
    ``position``: the one holding it, the first below them, the last beyond them."""
    return min(max(bisect.bisect_right(positions, position) - 1, 0), len(positions) - 2)


def check_position(position: int, ctx: int, what: str = "the step's cache") -> None:
    """Raise `PositionError` unless ``position`` is a position of a cache of ``ctx`` (0 .. ctx - 1)."""
    if not 0 <= position < ctx:
        raise PositionError(f"position {position} is outside {what} of {ctx} positions (0 .. {ctx - 1})")


def interpolate(times_s: Sequence[float], positions: tuple[int, ...], position: int) -> float:
    """A time measured ``times_s[i]`` at each of ``positions`` (rising), piecewise linearly at ``position``: the
    segment holding it, the end segments continued beyond them (never below 0)."""
    i = segment(positions, position)
    lo, hi = positions[i], positions[i + 1]
    return max(0.0, times_s[i] + (times_s[i + 1] - times_s[i]) * (position - lo) / (hi - lo))


@dataclass(frozen=True)
class PositionFit:
    """One positional kernel's seconds against the KV positions it reads, rows x (furthest + 1): piecewise linear
    through its measured points (``reads``, rising, and their ``seconds``), the end segments continued beyond them
    (never below 0)."""

    reads: tuple[int, ...]
    seconds: tuple[float, ...]

    def time_s(self, rows: int, position: int) -> float:
        """Seconds of the kernel over ``rows`` rows whose furthest position is ``position``."""
        return interpolate(self.seconds, self.reads, rows * (position + 1))


@dataclass(frozen=True)
class PositionModel:
    """The positional kernels of decode steps profiled on ``device`` at ``positions`` (rising) of a cache of
    ``ctx`` positions, each kernel's time fitted through its measurements (by `positional_key`); ``planned``: the
    planned workload's mean position, where a step without a position of its own is charged."""

    device: str
    positions: tuple[int, ...]
    ctx: int
    fits: dict[str, PositionFit] = field(default_factory=dict)
    planned: int | None = None

    @classmethod
    def fit(cls, graph: KernelGraph, device: str, positions: tuple[int, ...], times_s: list[list[float]],
            planned: int | None = None) -> PositionModel:
        """Fit the positional kernels of ``graph`` (a decode step) from its kernels' times measured on
        ``device`` with every row at each of ``positions`` (``times_s[i]``, by kernel index, at ``positions[i]``); a
        kernel shared by several layers takes the median of their times."""
        ctx = int(graph.meta.get("ctx") or 0)
        for p in positions:
            check_position(p, ctx, "the profiled decode step's cache")
        if len(positions) < 2 or any(b <= a for a, b in zip(positions, positions[1:], strict=False)):
            raise PositionError(f"a fit needs a short and a longer position, each further than the one before (got "
                                f"{', '.join(map(str, positions))})")
        if len(times_s) != len(positions) or any(len(t) != len(graph.kernels) for t in times_s):
            raise PositionError(f"times of {', '.join(str(len(t)) for t in times_s)} kernels at {len(positions)} "
                                f"positions for a graph of {len(graph.kernels)}: every profile must time this graph")
        groups: dict[str, tuple[int, list[list[float]]]] = {}
        for k in graph.kernels:
            key = positional_key(k)
            if key is not None:
                rows, measured = groups.setdefault(key, (kernel_rows(k), [[] for _ in positions]))
                for i, times in enumerate(times_s):
                    measured[i].append(times[k.index])
        fits = {key: PositionFit(tuple(rows * (p + 1) for p in positions),
                                 tuple(statistics.median(m) for m in measured))
                for key, (rows, measured) in groups.items()}
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

