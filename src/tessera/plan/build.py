"""Build a step's placement problem from its KernelGraph, the cost model and the cluster's targets.

Times: every kernel on every target (one GPU: the cost model; a device group: its sharding model).
Edges: read-after-write dependencies between kernels, coalesced per (producer, consumer), carrying the
bytes the consumer reads of what the producer wrote. Constraints: every kernel touching a state buffer
(KV/conv/SSM cache) shares a device with the others that touch it (state never moves inside a step);
kernels whose PTX is indirect or opaque share a device with the kernels they exchange data with.
Memory: weights and state are items resident where the kernels that read them run; activations are a
reserve of M times the largest working set of one kernel. With ``expert_parts`` > 1 every grouped
expert GEMM becomes that many expert-group parts plus a combine (:mod:`tessera.plan.experts`), so the
problem has more kernels than the graph; ``StepProblem`` maps between the two.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from tessera.capture.trace_facts import graph_colocation, graph_edges
from tessera.cost.features import FeatureExtractor, KernelFeatures, block_of, is_kv_buffer
from tessera.cost.model import CostModel
from tessera.cost.options import CostOptions
from tessera.cost.profile import Profile
from tessera.cost.routing import RoutingDistribution
from tessera.graph.ir import KernelGraph
from tessera.hardware.cluster import SAME_DEVICE, Cluster
from tessera.plan.config import DEFAULT_MEMORY_UTILIZATION
from tessera.plan.experts import SplitMapping
from tessera.plan.groups import DeviceGroup, GraphTraffic, default_routing, group_kernel_times
from tessera.plan.problem import MemorySpec, PlacementProblem
from tessera.plan.targets import Target, link_between


@dataclass
class StepProblem:
    """A step's placement problem with what it was built from. Problem kernel i is graph kernel i unless
    expert GEMMs were split: then ``mapping.origin[i]`` = (graph kernel, part number or "combine")."""

    graph: KernelGraph
    targets: list[Target]
    problem: PlacementProblem
    features: list[KernelFeatures]
    activation_reserve: float  # bytes per target kept for activations (M micro-batches in flight)
    mapping: SplitMapping | None = None

    @property
    def micro_batches(self) -> int:
        return self.problem.micro_batches

    def problem_kernels(self) -> list[list[int]]:
        """For each graph kernel, its problem kernels (expert parts then combine, when split); shared between
        calls, not to be changed."""
        return self._problem_kernels

    @cached_property
    def _problem_kernels(self) -> list[list[int]]:
        if self.mapping is None:
            return [[i] for i in range(len(self.graph.kernels))]
        out: list[list[int]] = [[] for _ in self.graph.kernels]
        for i, (k, _) in enumerate(self.mapping.origin):
            out[k].append(i)
        return out

    @cached_property
    def block_kernels(self) -> dict[str, np.ndarray]:
        """The problem kernels of the graph's ``attention`` and ``ffn`` kernels (`block_of`, by module scope)."""
        rows: dict[str, list[int]] = {"attention": [], "ffn": []}
        for k, own in zip(self.graph.kernels, self.problem_kernels(), strict=True):
            blk = block_of(k)
            if blk in rows:
                rows[blk] += own
        return {blk: np.array(r, dtype=np.int64) for blk, r in rows.items()}

    def graph_assignment(self, assignment) -> list[int]:
        """Each graph kernel's target: its own, or its combine's when its experts were split."""
        if self.mapping is None:
            return [int(t) for t in assignment[:len(self.graph.kernels)]]
        return np.asarray(assignment, dtype=np.int64)[self._last_parts].tolist()

    @cached_property
    def _last_parts(self) -> np.ndarray:
        return np.array([ks[-1] for ks in self.problem_kernels()], dtype=np.int64)

    def problem_assignment(self, graph_assignment, expert_parts: dict | None = None) -> list[int]:
        """The problem-level assignment of a StepPlan's graph-level one and its expert parts' targets."""
        parts = {int(k): v for k, v in (expert_parts or {}).items()}
        out = []
        for k, ks in enumerate(self.problem_kernels()):
            out += [*parts[k], graph_assignment[k]] if len(ks) > 1 else [graph_assignment[k]]
        return out

    def expert_parts(self, assignment) -> dict[int, list[int]]:
        """Graph kernel -> target of each expert part, for split kernels (empty when nothing is split)."""
        if self.mapping is None:
            return {}
        return {k: [int(assignment[i]) for i in self.mapping.parts_of(k)]
                for k in sorted({k for k, tag in self.mapping.origin if isinstance(tag, int)})}


def transfer_assignment(planned: KernelGraph, graph: KernelGraph, assignment: list[int]) -> list[int]:
    """``assignment`` (of ``planned``'s kernels) carried over to ``graph``, a trace of the same step at another
    shape whose kernel count differs: each kernel takes the target of the planned kernel with the same module
    scope and op at the same ordinal (the last one when the bucket repeats it more often), a kernel of a scope
    the plan never saw its predecessor's."""
    by_key: dict[tuple[str, str], list[int]] = defaultdict(list)
    for k in planned.kernels:
        by_key[(k.scope, k.op)].append(int(assignment[k.index]))
    out: list[int] = []
    for k in graph.kernels:
        seen = by_key.get((k.scope, k.op))
        out.append(seen[min(k.ordinal, len(seen) - 1)] if seen else (out[-1] if out else int(assignment[0])))
    return out


def target_times(graph: KernelGraph, features: list[KernelFeatures], target: Target, options: CostOptions,
                 profile: Profile | None = None, routing: RoutingDistribution | None = None,
                 whole_s: np.ndarray | None = None, traffic: GraphTraffic | None = None) -> np.ndarray:
    """[K] seconds of each kernel on ``target`` (a single GPU, or a group with its sharding costs; ``whole_s``:
    the kernels' seconds on one GPU of the group's type, and ``traffic``, the graph's, where the caller has
    them)."""
    usable = profile if profile is not None and profile.device == target.spec.id else None
    model = CostModel(target.spec, options, usable)
    if target.size == 1:
        return np.array([c.time_s for c in model.kernel_costs(graph, features)])
    group = DeviceGroup(target.spec, target.size, target.intra, tp=target.size, ep=target.size)
    return np.asarray(group_kernel_times(graph, features, model, group, routing, whole_s, traffic).total_s,
                      dtype=float)


def cached_target_times(graph: KernelGraph, facts: GraphFacts, target: Target, options: CostOptions,
                        profile: Profile | None, cache: dict[tuple, np.ndarray]) -> np.ndarray:
    """:func:`target_times` of ``graph`` (its ``facts``) kept in ``cache`` by :func:`target_key`; a group's
    sharded times reuse one GPU's entry for its unsharded kernels and the facts' traffic."""
    key = target_key(target)
    if key not in cache:
        whole, traffic = None, None
        if target.size > 1:
            single = Target(target.spec, target.members[:1], SAME_DEVICE)
            whole = cached_target_times(graph, facts, single, options, profile, cache)
            traffic = facts.traffic
        cache[key] = target_times(graph, facts.features, target, options, profile, facts.routing, whole, traffic)
    return cache[key]


def memory_items(graph: KernelGraph, options: CostOptions, micro_batches: int, state_scale: float = 1.0) -> MemorySpec:
    """Weights and state as resident items (state for all M micro-batches, times ``state_scale`` when the
    cache holds more than the traced context); capacities are filled later."""
    names, sizes, index = [], [], {}
    for name, b in graph.buffers.items():
        if b.kind == "weight":
            size = b.nbytes * (options.weight_scale(b.dtype) if len(b.shape) >= 2 else 1.0)
        elif b.kind == "state":
            kv = is_kv_buffer(name)
            size = b.nbytes * (options.kv_scale(b.dtype) * state_scale if kv else 1.0) * micro_batches
        else:
            continue
        index[name] = len(names)
        names.append(name)
        sizes.append(size)
    reads = sorted({(a.kernel, index[a.buffer]) for a in graph.accesses if a.buffer in index})
    return MemorySpec(np.array(sizes, dtype=float), reads, np.zeros(0), names)


def activation_peak(graph: KernelGraph) -> float:
    """Bytes of the largest single-kernel working set of activations, inputs and outputs."""
    per_kernel: dict[int, float] = defaultdict(float)
    moving = {name for name, b in graph.buffers.items() if b.kind in ("activation", "input", "output")}
    for a in graph.accesses:
        if a.buffer in moving:
            per_kernel[a.kernel] += float(math.prod(a.sizes)) * a.itemsize if a.sizes else a.itemsize
    return max(per_kernel.values(), default=0.0)


@dataclass(frozen=True)
class GraphFacts:
    """What every step problem of one traced graph shares, whatever its targets and M: kernel features, the
    expert routing, the coalesced data edges, the co-location pairs and the largest activation working set."""

    features: list[KernelFeatures]
    routing: RoutingDistribution | None
    edges: list[tuple[int, int, float]]
    together: list[tuple[int, int]]
    activation_peak: float
    state_first: list[tuple[str, int]]  # each state buffer and the first kernel touching it, in that order
    graph: KernelGraph = field(repr=False, compare=False)  # what they were read off (for `traffic`)

    @classmethod
    def of(cls, graph: KernelGraph, options: CostOptions, routing_skew: float = 0.0) -> GraphFacts:
        return cls(FeatureExtractor(graph, options).all(), default_routing(graph, routing_skew), graph_edges(graph),
                   graph_colocation(graph), activation_peak(graph), state_first(graph), graph)

    @cached_property
    def traffic(self) -> GraphTraffic:
        """Activation bytes and matrix weights per kernel, for sharding the graph over device groups (built on
        first use: a graph placed on single GPUs never needs it)."""
        return GraphTraffic(self.graph)


def state_first(graph: KernelGraph) -> list[tuple[str, int]]:
    """(state buffer, the first kernel that touches it) in the order of those first touches."""
    state, first = set(graph.state), {}
    for a in graph.accesses:
        if a.buffer in state and a.buffer not in first:
            first[a.buffer] = a.kernel
    return list(first.items())


def target_key(target: Target) -> tuple:
    """What a target's kernel times depend on: its GPU type, how many GPUs and the link between them."""
    return target.spec.id, target.size, target.intra


def build_step_problem(graph: KernelGraph, targets: list[Target], cluster: Cluster, *, micro_batches: int = 1,
                       options: CostOptions = CostOptions(), profile: Profile | None = None,
                       routing_skew: float = 0.0, memory: bool = True, state_scale: float = 1.0,
                       expert_parts: int = 1, utilization: float = DEFAULT_MEMORY_UTILIZATION,
                       facts: GraphFacts | None = None, times_cache: dict | None = None) -> StepProblem:
    """The placement problem of one step (``graph`` traced at the micro-batch size) over ``targets``
    (``expert_parts`` > 1: every grouped expert GEMM split into that many expert groups plus a combine; each
    target keeps ``utilization`` of its memory). ``facts`` (the graph's, built with the same options and
    skew) and ``times_cache`` (kernel times by target key, for this graph) skip work a caller already did."""
    facts = GraphFacts.of(graph, options, routing_skew) if facts is None else facts
    features, routing = facts.features, facts.routing
    cache = {} if times_cache is None else times_cache
    times = np.stack([cached_target_times(graph, facts, t, options, profile, cache) for t in targets], axis=1)
    d = len(targets)
    bandwidth, latency = np.full((d, d), np.inf), np.zeros((d, d))
    for i, a in enumerate(targets):
        for j, b in enumerate(targets):
            if i != j:
                link = link_between(cluster, a, b)
                bandwidth[i, j], latency[i, j] = link.bandwidth, link.latency_s
    edges = facts.edges
    reserve = facts.activation_peak * micro_batches
    spec = None
    if memory:
        spec = memory_items(graph, options, micro_batches, state_scale)
        spec.capacity = np.array([max(t.usable_bytes(utilization) - reserve, 0.0) for t in targets])
    problem = PlacementProblem([t.name for t in targets], times, list(edges), bandwidth, latency,
                               together=list(facts.together), micro_batches=micro_batches, memory=spec)
    mapping = None
    if expert_parts > 1 and routing is not None:
        problem, mapping = _split_experts(problem, features, targets, options, profile, routing, expert_parts)
    return StepProblem(graph, targets, problem, features, reserve, mapping)


def _split_experts(problem: PlacementProblem, features: list[KernelFeatures], targets: list[Target],
                   options: CostOptions, profile: Profile | None, routing: RoutingDistribution,
                   parts: int) -> tuple[PlacementProblem, SplitMapping | None]:
    """Every grouped expert GEMM of the problem split into ``parts`` expert groups plus a combine."""
    from tessera.plan.experts import (
        KernelSplit,
        combine_times,
        expert_part_times,
        part_bytes,
        split_kernels,
        weight_shares,
    )

    models = [CostModel(t.spec, options, profile if profile is not None and profile.device == t.spec.id else None)
              for t in targets]
    splits = []
    for f in features:
        if f.cost_class != "grouped_gemm" or f.gemm is None or f.gemm[1] < parts:  # fewer routed rows than
            continue  # parts: nothing to spread
        n = min(parts, routing.experts)
        times = expert_part_times(f, models, n, routing) / np.array([max(t.size, 1) for t in targets])
        into, out = part_bytes(f, n, routing)
        splits.append(KernelSplit(f.index, times, combine_times(f, models), into, out,
                                  weight_shares(routing.experts, n)))
    if not splits:
        return problem, None
    return split_kernels(problem, splits)
