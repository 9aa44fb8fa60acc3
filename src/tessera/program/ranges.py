"""Sets of byte ranges of one buffer: what a view touches, what a device holds, what must move.

A :class:`Ranges` is a sorted tuple of disjoint, non-adjacent half-open ``(lo, hi)`` byte intervals.
Transfers between devices carry exactly the bytes a consumer reads and does not hold yet, so these
sets are built from the exact strided regions the trace recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        out: list[list[int]] = []
        for lo, hi in sorted((int(a), int(b)) for a, b in spans if b > a):
            if out and lo <= out[-1][1]:
                out[-1][1] = max(out[-1][1], hi)
            else:
                out.append([lo, hi])
        return Ranges(tuple((a, b) for a, b in out))

    @staticmethod
    def region(region: Region) -> Ranges:
        """The bytes a strided view touches."""
        if region.empty:
            return Ranges()
        if region.count > MAX_RUNS:
            return Ranges((region.bounds,))
        width = region.runs[2]
        starts = region.starts()
        return Ranges.of(zip(starts.tolist(), (starts + width).tolist(), strict=True))

    def __bool__(self) -> bool:
        return bool(self.spans)

    @property
    def nbytes(self) -> int:
        return sum(b - a for a, b in self.spans)

    def __or__(self, other: Ranges) -> Ranges:
        return Ranges.of(self.spans + other.spans)

    def __and__(self, other: Ranges) -> Ranges:
        out, i, j = [], 0, 0
        a, b = self.spans, other.spans
        while i < len(a) and j < len(b):
            lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
            if lo < hi:
                out.append((lo, hi))
            if a[i][1] < b[j][1]:
                i += 1
            else:
                j += 1
        return Ranges(tuple(out))

    def __sub__(self, other: Ranges) -> Ranges:
        out = []
        b = other.spans
        j = 0
        for lo, hi in self.spans:
            while j < len(b) and b[j][1] <= lo:
                j += 1
            k, cur = j, lo
            while k < len(b) and b[k][0] < hi:
                if b[k][0] > cur:
                    out.append((cur, b[k][0]))
                cur = max(cur, b[k][1])
                k += 1
            if cur < hi:
                out.append((cur, hi))
        return Ranges(tuple(out))
