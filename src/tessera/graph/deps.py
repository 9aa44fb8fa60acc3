"""RAW/WAR/WAW edges from exact byte overlaps between accesses, in program order."""

from __future__ import annotations

from collections import defaultdict

from tessera.graph.ir import Access, Edge
from tessera.graph.overlap import regions_overlap


def compute_edges(accesses: list[Access]) -> list[Edge]:
    """Edges between every pair of earlier/later accesses of a buffer that overlap and conflict.

    ``accesses`` must be in program order (by kernel index). A kernel that reads and writes the same
    bytes (in-place op) gets no edge to itself.
    """
    reads: dict[str, list[Access]] = defaultdict(list)
    writes: dict[str, list[Access]] = defaultdict(list)
    edges: set[tuple[int, int, str, str]] = set()
    for acc in accesses:
        prior_writes = writes.get(acc.buffer, ())
        if acc.mode == "read":
            for w in prior_writes:
                if w.kernel != acc.kernel and regions_overlap(w.region, acc.region):
                    edges.add((w.kernel, acc.kernel, "RAW", acc.buffer))
            reads[acc.buffer].append(acc)
        else:
            for r in reads.get(acc.buffer, ()):
                if r.kernel != acc.kernel and regions_overlap(r.region, acc.region):
                    edges.add((r.kernel, acc.kernel, "WAR", acc.buffer))
            for w in prior_writes:
                if w.kernel != acc.kernel and regions_overlap(w.region, acc.region):
                    edges.add((w.kernel, acc.kernel, "WAW", acc.buffer))
            writes[acc.buffer].append(acc)
    return [Edge(s, d, k, b) for s, d, k, b in sorted(edges)]
