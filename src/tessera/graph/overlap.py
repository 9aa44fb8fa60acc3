"""Exact overlap test between strided byte regions of one storage.

A region is what a tensor view touches: ``offset + sum(i_k * stride_k)`` for every index vector, each
element covering ``itemsize`` bytes. Two regions overlap when they share at least one byte. The test
is exact: interleaved views (``x[:, ::2]`` vs ``x[:, 1::2]``), per-head and per-row slices give no
false overlap. Only when both regions are enormous *and* irregular does it fall back to the
conservative answer (overlap), which can add an edge but never drop one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

# Above this many contiguous runs per region the exact enumeration is skipped (conservative answer).
MAX_ENUMERATED_RUNS = 4_000_000


@dataclass(frozen=True)
class Region:
    """Bytes touched by a strided view: byte offset, sizes, element strides and element size."""

    offset: int  # in elements of ``itemsize``
    sizes: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    itemsize: int

    @cached_property
    def runs(self) -> tuple[int, tuple[tuple[int, int], ...], int]:
        """Canonical form: (first byte, ((size, byte stride), ...) outer dims, contiguous run width)."""
        if any(s == 0 for s in self.sizes):
            return (0, (), 0)
        dims = [(n, st * self.itemsize) for n, st in zip(self.sizes, self.strides, strict=True)
                if n > 1 and st != 0]
        dims.sort(key=lambda d: d[1], reverse=True)
        merged: list[tuple[int, int]] = []
        for n, st in dims:
            if merged and merged[-1][1] == n * st:
                outer_n, _ = merged.pop()
                merged.append((outer_n * n, st))
            else:
                merged.append((n, st))
        width = self.itemsize
        if merged and merged[-1][1] == self.itemsize:
            n, _ = merged.pop()
            width = n * self.itemsize
        return (self.offset * self.itemsize, tuple(merged), width)

    @property
    def empty(self) -> bool:
        return self.runs[2] == 0

    @cached_property
    def count(self) -> int:
        """Number of contiguous runs."""
        return int(np.prod([n for n, _ in self.runs[1]], dtype=np.int64)) if self.runs[1] else 1

    @cached_property
    def bounds(self) -> tuple[int, int]:
        """Half-open byte interval [lo, hi) covering the region."""
        start, dims, width = self.runs
        return start, start + sum((n - 1) * st for n, st in dims) + width

    @property
    def nbytes_touched(self) -> int:
        """Bytes covered, counting each byte once when runs do not alias (the usual case)."""
        start, dims, width = self.runs
        if not dims:
            return width
        span = self.bounds[1] - self.bounds[0]
        return min(span, self.count * width)

    def starts(self) -> np.ndarray:
        """Sorted start byte of every contiguous run."""
        start, dims, width = self.runs
        acc = np.array([start], dtype=np.int64)
        for n, st in dims:
            acc = (acc[:, None] + np.arange(n, dtype=np.int64)[None, :] * st).reshape(-1)
        if not self._nested(dims, width):
            acc.sort()
        return acc

    @staticmethod
    def _nested(dims: tuple[tuple[int, int], ...], width: int) -> bool:
        """Whether every dimension's stride clears everything inside it (runs enumerate in sorted order)."""
        inner = width
        for n, st in reversed(dims):
            if st < inner:
                return False
            inner += (n - 1) * st
        return True


def regions_overlap(a: Region, b: Region) -> bool:
    """True when the two regions share at least one byte (exact, conservative only past size limits)."""
    if a.empty or b.empty:
        return False
    alo, ahi = a.bounds
    blo, bhi = b.bounds
    if ahi <= blo or bhi <= alo:
        return False
    if a.count == 1 or b.count == 1:
        if a.count == 1 and b.count == 1:
            return True
        single, other = (a, b) if a.count == 1 else (b, a)
        if other.count > MAX_ENUMERATED_RUNS:
            return True
        return _runs_intersect(single.starts(), single.runs[2], other.starts(), other.runs[2])
    if a.count > MAX_ENUMERATED_RUNS or b.count > MAX_ENUMERATED_RUNS:
        return True
    return _runs_intersect(a.starts(), a.runs[2], b.starts(), b.runs[2])


def _runs_intersect(a: np.ndarray, wa: int, b: np.ndarray, wb: int) -> bool:
    """Whether any [a_i, a_i+wa) meets any [b_j, b_j+wb); both start arrays sorted."""
    if len(a) > len(b):
        a, wa, b, wb = b, wb, a, wa
    # first b_j with b_j > a_i - wb, i.e. whose run ends after a_i starts
    idx = np.searchsorted(b, a - wb, side="right")
    ok = idx < len(b)
    return bool(np.any(b[idx[ok]] < a[ok] + wa))
