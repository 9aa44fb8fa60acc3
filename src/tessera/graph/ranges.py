"""Sets of byte ranges of one buffer: what a view touches, what a device holds, what must move.

A :class:`Ranges` is a sorted tuple of disjoint, non-adjacent half-open ``(lo, hi)`` byte intervals.
Transfers between devices carry exactly the bytes a consumer reads and does not hold yet, so these
sets are built from the exact strided regions the trace recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tessera.graph.overlap import Region

# A region with more contiguous runs than this is taken as its covering interval (a superset: still
# exact for transfers, which only ever carry bytes the sender holds).
MAX_RUNS = 65_536


@dataclass(frozen=True)
class Ranges:
    """Disjoint sorted byte intervals ``[(lo, hi), ...]``."""

    spans: tuple[tuple[int, int], ...] = ()

    @staticmethod
    def of(spans) -> Ranges:
        """Normalise any iterable of (lo, hi) pairs: sorted, overlaps and neighbours merged, empties dropped."""
        pairs = np.asarray(list(spans), dtype=np.int64).reshape(-1, 2)
        return Ranges._merged(pairs[:, 0], pairs[:, 1])

    @staticmethod
    def _merged(lo: np.ndarray, hi: np.ndarray) -> Ranges:
        keep = hi > lo
        lo, hi = lo[keep], hi[keep]
        if lo.size == 0:
            return Ranges()
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
        reach = np.maximum.accumulate(hi)
        first = np.ones(lo.size, dtype=bool)
        first[1:] = lo[1:] > reach[:-1]  # touching intervals merge too
        starts = np.flatnonzero(first)
        ends = np.append(starts[1:], lo.size) - 1
        return Ranges(tuple(zip(lo[starts].tolist(), reach[ends].tolist(), strict=True)))

    @staticmethod
    @lru_cache(maxsize=4096)
    def region(region: Region) -> Ranges:
        """The bytes a strided view touches (cached: a graph's views repeat across layers and micro-batches)."""
        if region.empty:
            return Ranges()
        if region.count > MAX_RUNS:
            return Ranges((region.bounds,))
        starts = np.asarray(region.starts(), dtype=np.int64)
        return Ranges._merged(starts, starts + region.runs[2])

    def __bool__(self) -> bool:
        return bool(self.spans)

    @property
    def nbytes(self) -> int:
        return sum(b - a for a, b in self.spans)

    def __or__(self, other: Ranges) -> Ranges:
        return Ranges.of(self.spans + other.spans)

    def __and__(self, other: Ranges) -> Ranges:
        return self._combine(other, keep_other=True)

    def __sub__(self, other: Ranges) -> Ranges:
        return self._combine(other, keep_other=False)

    def _combine(self, other: Ranges, keep_other: bool) -> Ranges:
        """Bytes in self and (``keep_other``) in other, or (not ``keep_other``) not in other: one sweep over
        both sets' boundaries."""
        if not self.spans or not other.spans:
            return Ranges() if keep_other else self
        if len(self.spans) == 1 and len(other.spans) == 1:  # two intervals (most views): no arrays
            (a0, a1), (b0, b1) = self.spans[0], other.spans[0]
            if keep_other:
                return Ranges(((max(a0, b0), min(a1, b1)),)) if min(a1, b1) > max(a0, b0) else Ranges()
            return Ranges(tuple(p for p in ((a0, min(a1, b0)), (max(a0, b1), a1)) if p[1] > p[0]))
        if self.spans == other.spans:  # a consumer reading all its producer wrote (per-row views, often)
            return self if keep_other else Ranges()
        if len(other.spans) == 1:  # one interval against many: each of ours clipped to it, or cut by it
            (b0, b1), out = other.spans[0], []
            if b0 <= self.spans[0][0] and self.spans[-1][1] <= b1:  # it covers all of ours
                return self if keep_other else Ranges()
            if b1 <= self.spans[0][0] or self.spans[-1][1] <= b0:  # it misses all of ours
                return Ranges() if keep_other else self
            for a0, a1 in self.spans:
                if keep_other:
                    if min(a1, b1) > max(a0, b0):
                        out.append((max(a0, b0), min(a1, b1)))
                else:
                    out.extend(p for p in ((a0, min(a1, b0)), (max(a0, b1), a1)) if p[1] > p[0])
            return Ranges(tuple(out))
        if len(self.spans) == 1 and keep_other:
            return other._combine(self, keep_other=True)
        return self._sweep(other, keep_other)

    def _sweep(self, other: Ranges, keep_other: bool) -> Ranges:
        a = np.asarray(self.spans, dtype=np.int64)
        b = np.asarray(other.spans, dtype=np.int64)
        points = np.concatenate([a.ravel(), b.ravel()])
        in_a = np.concatenate([np.tile([1, -1], len(a)), np.zeros(2 * len(b), dtype=np.int64)])
        in_b = np.concatenate([np.zeros(2 * len(a), dtype=np.int64), np.tile([1, -1], len(b))])
        order = np.argsort(points, kind="stable")
        points, cov_a, cov_b = points[order], np.cumsum(in_a[order]), np.cumsum(in_b[order])
        last = np.append(points[1:] != points[:-1], True)  # the coverage after every event at a position
        points, cov_a, cov_b = points[last], cov_a[last], cov_b[last]
        inside = (cov_a[:-1] > 0) & ((cov_b[:-1] > 0) if keep_other else (cov_b[:-1] == 0))
        return Ranges._merged(points[:-1][inside], points[1:][inside])
