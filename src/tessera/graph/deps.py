"""RAW/WAR/WAW edges from exact byte overlaps between accesses, in program order."""

from __future__ import annotations

from collections import defaultdict

from tessera.graph.ir import Access, Edge
from tessera.graph.overlap import regions_overlap


def _span(a: Access) -> tuple[int, int, bool]:
    """Byte interval [lo, hi) covering the access, and whether it is one dense run."""
    lo = a.offset * a.itemsize
    if any(n == 0 for n in a.sizes):
        return lo, lo, True
    extent = sum((n - 1) * s for n, s in zip(a.sizes, a.strides, strict=True)) + 1
    dense = True
    expected = 1
    for n, s in sorted(((n, s) for n, s in zip(a.sizes, a.strides, strict=True) if n > 1), key=lambda d: d[1]):
        if s != expected:
            dense = False
            break
        expected *= n
    return lo, lo + extent * a.itemsize, dense


def _overlap(a: Access, sa: tuple[int, int, bool], b: Access, sb: tuple[int, int, bool]) -> bool:
    if sa[1] <= sb[0] or sb[1] <= sa[0] or sa[0] == sa[1] or sb[0] == sb[1]:
        return False
    if sa[2] and sb[2]:
        return True
    return regions_overlap(a.region, b.region)


def compute_edges(accesses: list[Access]) -> list[Edge]:
    """Edges between every pair of earlier/later accesses of a buffer that overlap and conflict.

    ``accesses`` must be in program order (by kernel index). A kernel that reads and writes the same
    bytes (in-place op) gets no edge to itself.
    """
    reads: dict[str, list[tuple[Access, tuple]]] = defaultdict(list)
    writes: dict[str, list[tuple[Access, tuple]]] = defaultdict(list)
    edges: set[tuple[int, int, str, str]] = set()
    for acc in accesses:
        span = _span(acc)
        prior_writes = writes.get(acc.buffer, ())
        if acc.mode == "read":
            for w, ws in prior_writes:
                if w.kernel != acc.kernel and _overlap(w, ws, acc, span):
                    edges.add((w.kernel, acc.kernel, "RAW", acc.buffer))
            reads[acc.buffer].append((acc, span))
        else:
            for r, rs in reads.get(acc.buffer, ()):
                if r.kernel != acc.kernel and _overlap(r, rs, acc, span):
                    edges.add((r.kernel, acc.kernel, "WAR", acc.buffer))
            for w, ws in prior_writes:
                if w.kernel != acc.kernel and _overlap(w, ws, acc, span):
                    edges.add((w.kernel, acc.kernel, "WAW", acc.buffer))
            writes[acc.buffer].append((acc, span))
    return [Edge(s, d, k, b) for s, d, k, b in sorted(edges)]
