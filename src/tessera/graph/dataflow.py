"""What the planner and the runtime both read off a graph's dependencies: the bytes each read-after-write
edge carries (coalesced per kernel pair) and which kernels must share a device (state touched by both;
an indirect or opaque kernel and the kernels it exchanges data with), as pairs and as units."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from tessera.graph.ir import KernelGraph


def _access_bytes(graph: KernelGraph) -> tuple[dict, dict]:
    written: dict[tuple[int, str], int] = defaultdict(int)
    read: dict[tuple[int, str], int] = defaultdict(int)
    for a in graph.accesses:
        n = int(np.prod(a.sizes)) * a.itemsize if a.sizes else a.itemsize
        (written if a.mode == "write" else read)[(a.kernel, a.buffer)] += n
    return written, read


def data_edges(graph: KernelGraph) -> list[tuple[int, int, float]]:
    """(producer, consumer, bytes) of every read-after-write dependency, coalesced per kernel pair."""
    written, read = _access_bytes(graph)
    pairs: dict[tuple[int, int], float] = defaultdict(float)
    for e in graph.edges:
        if e.kind != "RAW" or graph.buffers[e.buffer].kind in ("weight", "constant", "state"):
            continue
        pairs[(e.src, e.dst)] += min(written[(e.src, e.buffer)], read[(e.dst, e.buffer)])
    return [(s, d, b) for (s, d), b in sorted(pairs.items())]


def colocation(graph: KernelGraph, edges: list[tuple[int, int, float]]) -> list[tuple[int, int]]:
    """Pairs of kernels that must share a device: state touched by both, or an indirect/opaque kernel
    and the kernels it exchanges data with."""
    state = set(graph.state)
    touching: dict[str, list[int]] = defaultdict(list)
    for a in graph.accesses:
        if a.buffer in state and (not touching[a.buffer] or touching[a.buffer][-1] != a.kernel):
            touching[a.buffer].append(a.kernel)
    pairs = {(ks[0], k) for ks in touching.values() for k in ks[1:]}
    indirect = {k.index for k in graph.kernels if k.indirect}
    pairs |= {(s, d) for s, d, _ in edges if s in indirect or d in indirect}
    return sorted(pairs)


def colocation_units(graph: KernelGraph) -> list[int]:
    """Kernel -> unit id: kernels that must share a device have the same unit (ids in order of first kernel)."""
    parent = list(range(len(graph.kernels)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in colocation(graph, data_edges(graph)):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    ids: dict[int, int] = {}
    return [ids.setdefault(find(k), len(ids)) for k in range(len(graph.kernels))]
