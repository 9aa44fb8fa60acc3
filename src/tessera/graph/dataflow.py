"""What the planner and the runtime both read off a graph's dependencies: the bytes each read-after-write
edge carries (coalesced per kernel pair) and which kernels must share a device (state touched by both;
an indirect or opaque kernel and the kernels it exchanges data with), as pairs and as units."""

from __future__ import annotations

from collections import defaultdict

from tessera.graph.ir import KernelGraph
from tessera.graph.ranges import Ranges


def data_edges(graph: KernelGraph) -> list[tuple[int, int, float]]:
    """(producer, consumer, bytes) of every read-after-write dependency, coalesced per kernel pair.

    A consumer's bytes are charged to their last writer before it: a kernel that updates part of a buffer in
    place (RoPE on the q and k of a fused QKV output) carries those bytes on, and the first writer carries only
    the bytes nobody overwrote (v). A pair whose bytes were all overwritten keeps its dependency edge but
    carries nothing."""
    regions: dict[tuple[int, str, str], Ranges] = {}
    for a in graph.accesses:
        key = (a.kernel, a.buffer, a.mode)
        r = Ranges.region(a.region)
        regions[key] = regions[key] | r if key in regions else r
    sources: dict[tuple[int, str], list[int]] = defaultdict(list)
    for e in graph.edges:
        if e.kind != "RAW" or graph.buffers[e.buffer].kind in ("weight", "constant", "state"):
            continue
        sources[(e.dst, e.buffer)].append(e.src)
    pairs: dict[tuple[int, int], float] = defaultdict(float)
    for (dst, buffer), srcs in sources.items():
        wanted = regions.get((dst, buffer, "read"), Ranges())
        for src in sorted(set(srcs), reverse=True):  # the latest writer first
            got = wanted & regions.get((src, buffer, "write"), Ranges())
            pairs[(src, dst)] += got.nbytes
            wanted = wanted - got
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
