"""Merge kernels that share one placement: folding identical layers, and layers as pipeline units.

``merge`` turns a problem and a partition of its kernels into a smaller problem whose kernels are the
groups: times add up, edges between groups add up (bytes and messages), edges inside a group vanish,
and an edge that runs against the groups' order (layer l+1 back to the kernel at the same position in
layer l's group) becomes a loop edge. Busy times and link loads of the merged problem are exact for
every assignment it can express; its critical path treats a group of n folded layers as n times its
template, which is exact for chains of identical layers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from tessera.graph.layers import LayerStructure
from tessera.plan.problem import MemorySpec, PlacementProblem, PlacementProblemError


@dataclass
class Merged:
    """A merged problem and, for each of its kernels, the original kernels it stands for."""

    problem: PlacementProblem
    groups: list[list[int]]

    def unfold(self, assignment: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """The original problem's assignment: every kernel gets its group's device."""
        out = [0] * sum(len(g) for g in self.groups)
        for g, dev in zip(self.groups, assignment, strict=True):
            for k in g:
                out[k] = int(dev)
        return tuple(out)

    def fold(self, assignment: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """The merged assignment of an original one that is constant on every group."""
        folded = []
        for g in self.groups:
            devices = {assignment[k] for k in g}
            if len(devices) != 1:
                raise PlacementProblemError(f"kernels {g[:4]}... of one merged group are on different devices")
            folded.append(devices.pop())
        return tuple(folded)


def merge(problem: PlacementProblem, groups: list[list[int]]) -> Merged:
    """The problem whose kernels are ``groups`` (a partition of the kernels), each placed as one."""
    k = problem.kernels
    groups = sorted((sorted(g) for g in groups if g), key=lambda g: g[0])
    owner = np.full(k, -1)
    for gi, g in enumerate(groups):
        if (owner[g] >= 0).any():
            raise PlacementProblemError(f"kernel {g[int(np.argmax(owner[g] >= 0))]} is in two merged groups")
        owner[g] = gi
    if (owner < 0).any():
        raise PlacementProblemError(f"kernel {int(np.flatnonzero(owner < 0)[0])} is in no merged group")
    times = np.stack([problem.times[g].sum(axis=0) for g in groups])
    forward: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    backward: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for (src, dst, nbytes), count in zip(problem.edges, problem.messages, strict=True):
        a, b = int(owner[src]), int(owner[dst])
        if a != b:
            acc = forward[(a, b)] if a < b else backward[(a, b)]
            acc[0] += nbytes
            acc[1] += count
    for src, dst, nbytes, count in problem.loop_edges:
        a, b = int(owner[src]), int(owner[dst])
        if a != b:
            acc = backward[(a, b)]
            acc[0] += nbytes
            acc[1] += count
    pinned: dict[int, int] = {}
    for i, dev in problem.pinned.items():
        g = int(owner[i])
        if pinned.get(g, dev) != dev:
            raise PlacementProblemError(f"merged group {g} holds kernels pinned to devices {pinned[g]} and {dev}")
        pinned[g] = dev
    together = sorted({(min(a, b), max(a, b)) for i, j in problem.together
                       if (a := int(owner[i])) != (b := int(owner[j]))})
    edges = sorted(forward.items())
    merged = PlacementProblem(
        problem.devices, times, [(a, b, v[0]) for (a, b), v in edges], problem.bandwidth, problem.latency,
        pinned, together, problem.micro_batches, [v[1] for _, v in edges],
        _merge_memory(problem.memory, owner), [(a, b, v[0], v[1]) for (a, b), v in sorted(backward.items())])
    return Merged(merged, groups)


def _merge_memory(memory: MemorySpec | None, owner: np.ndarray) -> MemorySpec | None:
    """Reads mapped to groups; items read by the same set of groups become one item (bytes added)."""
    if memory is None:
        return None
    readers: dict[int, set[int]] = defaultdict(set)
    for i, w in memory.reads:
        readers[w].add(int(owner[i]))
    by_set: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for w, gs in readers.items():
        by_set[tuple(sorted(gs))].append(w)
    names = memory.item_names or [f"item{w}" for w in range(len(memory.item_bytes))]
    sizes, reads, labels = [], [], []
    for n, (gs, items) in enumerate(sorted(by_set.items())):
        sizes.append(float(memory.item_bytes[items].sum()))
        labels.append(names[items[0]] + (f" (+{len(items) - 1} more)" if len(items) > 1 else ""))
        reads.extend((g, n) for g in gs)
    return MemorySpec(np.array(sizes), sorted(reads), memory.capacity.copy(), labels)


def fold_groups(structure: LayerStructure, kernels: int, chunks: int = 1) -> list[list[int]]:
    """Groups that fold identical layers: each class's layers are cut into ``chunks`` runs, and the kernels
    at one position of the layers of a run form one group; kernels outside layers stay alone."""
    groups = [[k] for k in structure.outside]
    for cls in structure.classes:
        layers = list(cls.layers)
        for run in np.array_split(np.arange(len(layers)), max(1, min(chunks, len(layers)))):
            members = [structure.spans[layers[i]] for i in run]
            for pos in range(cls.kernels_per_layer):
                groups.append([s.start + pos for s in members])
    covered = sum(len(g) for g in groups)
    if covered != kernels:
        raise PlacementProblemError(f"layer structure covers {covered} of {kernels} kernels")
    return groups


def layer_groups(structure: LayerStructure, kernels: int) -> list[list[int]]:
    """One group per layer (whole layers move as units); kernels before the first layer join it, kernels
    after the last layer join that one, kernels between layers join the layer before them."""
    spans = sorted(structure.spans.values(), key=lambda s: s.start)
    if not spans:
        raise PlacementProblemError("the graph has no numbered layers to pipeline")
    groups = [list(range(s.start, s.end)) for s in spans]
    for k in structure.outside:
        before = [i for i, s in enumerate(spans) if s.start <= k]
        groups[before[-1] if before else 0].append(k)
    covered = sum(len(g) for g in groups)
    if covered != kernels:
        raise PlacementProblemError(f"layers cover {covered} of {kernels} kernels")
    return groups
