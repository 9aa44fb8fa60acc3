"""Device groups: several GPUs of one type acting as one placement target, with a sharding cost model.

A :class:`DeviceGroup` is ``size`` GPUs of one type joined by one ``link`` and run with tensor
parallelism ``tp`` and expert parallelism ``ep`` (both divide ``size``). Its layout:

* **dense part** (everything but MoE experts): ``dp = size / tp`` data-parallel replicas, each a
  tp-way tensor-parallel copy of the model; a micro-batch's sequences are dealt out to the replicas,
  the busiest getting ``r = ceil(batch / dp) / batch`` of them (:func:`replica_share`; batch from the
  trace's meta, 1 / dp when it does not say). With dp = 1, r = 1.
* **experts**: ``ep`` expert-parallel ranks, rank g holding the experts that the routing
  distribution's greedy spread gives it (hottest first onto the least-loaded rank, equal counts, as
  :meth:`RoutingDistribution.imbalance` spreads them, see :func:`expert_layout`); ``size / ep`` expert
  replicas each serve an even share of the token-expert assignments. Expert weights are not
  tensor-sharded.

A kernel's group time is that of the busiest GPU: its sharded work timed by the roofline
(:func:`tessera.cost.roofline.kernel_time` with the model's efficiency class of the sharded kernel, so
a small shard pays its floor and overhead in full; a GEMM whose shard has at most 16 rows or columns
is timed as a GEMV) plus the collective it adds on the group link (:mod:`tessera.cost.collectives`).
A kernel whose shard is the whole kernel (replicated work with r = 1, and every kernel of a one-GPU
group) keeps the cost model's time, measured where profiled.

Sharding rules (:func:`kernel_rule`), by block (:func:`tessera.cost.features.block_of`) and scope:

* ``column``: GEMMs/GEMVs with weights in attention/FFN blocks that are not row-parallel (q/k/v,
  gate/up, fc1, in_proj, fused qkv, ...): FLOPs x r / tp, weight bytes / tp (k/v projections:
  ceil(kv_heads / tp) / kv_heads, since KV heads below tp are replicated), input activation x r,
  output x r / tp; rows x r, N / tp.
* ``row``: o_proj, down_proj, out_proj, c_proj, fc2, w2, wo, dense_4h_to_h: FLOPs x r / tp, weights
  / tp, input x r / tp, output x r; rows x r, K / tp; plus a ring all-reduce of the replica's output
  activation over the tp GPUs, ``all_reduce_time(output x r, tp, link)``.
* ``heads``: attention kernels (and weightless matmuls of the attention block): split by heads, query
  work x ceil(q_heads / tp) / q_heads, KV bytes x ceil(kv_heads / tp) / kv_heads, all x r.
* ``sharded``: other kernels of attention/FFN blocks (elementwise, reductions, copies, scans on sharded
  activations): FLOPs, activations and weights / tp (KV bytes by the KV-head share), all x r.
* ``replicated``: 'other'-block kernels (norms, residual adds, rotary tables, embeddings) and MoE
  routers (scope part ``router`` or ``gate``): every GPU of a replica runs them whole on the
  replica's tokens: FLOPs, activations and KV x r; weights in full (embedding gathers: x r).
* ``lm_head``: the LM head (``lm_head``/``embed_out``/``output`` GEMMs of the 'other' block):
  column-parallel plus a ring all-gather of the replica's logits over tp.
* ``expert_gemm``: grouped expert GEMMs: rank g serves ``assignments / (size / ep) x load_g`` rows
  (load_g: the routed share of its experts), FLOPs and activations scaled alike, weight bytes for the
  expected distinct experts of its own that the rows touch; the busiest rank sets the time (its load
  is ``imbalance(ep) / ep``, so it serves imbalance(ep) / size of all assignments). When ep > 1 the
  first grouped GEMM of an MoE layer (same layer and scope) pays the token dispatch and the last the
  combine, each ``all_to_all_time(assignments / size x width x itemsize, ep, link, imbalance(ep))``
  (each GPU owns 1 / size of the assignments inside the MoE block); with tp > 1 the last also
  all-gathers the MoE output of the replica's tokens (assignments / top_k x r) over tp.
* ``expert``: other kernels of an ``experts`` scope (gathers, activations, sorts on dispatched tokens):
  everything x the busiest rank's share of the assignments, imbalance(ep) / size.

Memory per GPU (:func:`weight_share`, :func:`state_share`, :func:`group_footprint`): matrices read by
column/row/lm_head/heads/sharded kernels / tp (k/v: the KV-head share), expert weights (every buffer
under an ``experts`` scope) ceil(experts / ep) / experts, vectors (norms, biases), matrices of
replicated kernels (embeddings, routers; a tied embedding/LM head) and unread weights in full; KV
cache by the KV-head share x r, other state / tp x r. The group's capacity is size x one GPU's memory.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, fields, replace
from functools import cached_property

import numpy as np

from tessera.cost.collectives import all_gather_time, all_reduce_time, all_to_all_time
from tessera.cost.features import GEMV_MAX_ROWS, KernelFeatures, cost_class, gemm_dims, is_kv_buffer
from tessera.cost.model import CostModel, MemoryFootprint
from tessera.cost.options import TRACE_DTYPE_BITS, CostOptions
from tessera.cost.roofline import kernel_time
from tessera.cost.routing import RoutingDistribution
from tessera.errors import TesseraError
from tessera.graph.ir import Kernel, KernelGraph
from tessera.hardware.catalog import DeviceSpec
from tessera.hardware.cluster import Link

RULES = ("column", "row", "heads", "sharded", "replicated", "lm_head", "expert_gemm", "expert")
ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "c_proj", "fc2", "w2", "wo", "dense_4h_to_h")
KV_PROJECTIONS = ("k_proj", "v_proj", "wk", "wv", "key", "value")
LM_HEADS = ("lm_head", "embed_out", "output")
ROUTER_SCOPES = ("router", "gate")
EXPERT_SCOPE = "experts"


class DeviceGroupError(TesseraError, ValueError):
    """A device group whose sizes do not fit together, or a graph/model that does not match it."""


@dataclass(frozen=True)
class DeviceGroup:
    """``size`` GPUs of type ``spec`` over ``link``, tensor-parallel ``tp`` and expert-parallel ``ep`` ways."""

    spec: DeviceSpec
    size: int
    link: Link
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("size", "tp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DeviceGroupError(f"a device group's {name} must be a whole number >= 1 (got {value!r})")
        for name in ("tp", "ep"):
            value = getattr(self, name)
            if self.size % value:
                divisors = [d for d in range(1, self.size + 1) if self.size % d == 0]
                raise DeviceGroupError(f"{name}={value} does not divide the group's {self.size} GPUs; use one of "
                                       f"{', '.join(map(str, divisors))}")

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the dense part (size / tp)."""
        return self.size // self.tp

    @property
    def expert_replicas(self) -> int:
        """Copies of the expert set (size / ep), each serving an even share of the routed tokens."""
        return self.size // self.ep

    @property
    def name(self) -> str:
        """E.g. "B200x8 (tp8)", "H100x8 (tp4, dp2, ep8)"; a one-GPU group is its device id."""
        if self.size == 1:
            return self.spec.id
        parts = [f"tp{self.tp}"] + ([f"dp{self.dp}"] if self.dp > 1 else []) + ([f"ep{self.ep}"] if self.ep > 1 else [])
        return f"{self.spec.id}x{self.size} ({', '.join(parts)})"

    @property
    def memory_bytes(self) -> float:
        """Memory of the whole group: size x one GPU's."""
        return float(self.size * self.spec.memory_bytes)


@dataclass(frozen=True)
class KernelShard:
    """What one GPU of a group runs of a kernel: ``features`` (one per expert-parallel rank for expert
    GEMMs, the busiest of which sets the time), and the collective the kernel adds."""

    rule: str
    features: tuple[KernelFeatures, ...]
    collective_s: float = 0.0
    collective: str = ""  # e.g. "all-reduce", "all-to-all + all-gather"


@dataclass(frozen=True)
class GroupTimes:
    """Per-kernel seconds on a device group: sharded compute, collectives, and their sum."""

    compute_s: np.ndarray  # [K]
    collective_s: np.ndarray  # [K]
    total_s: np.ndarray  # [K]
    rules: tuple[str, ...]  # the sharding rule each kernel followed (see RULES)

    @property
    def step_time_s(self) -> float:
        """Seconds of the step with kernels back to back on the group."""
        return float(self.total_s.sum())


def expert_layout(routing: RoutingDistribution, ranks: int) -> list[list[int]]:
    """Experts (by popularity rank, 0 hottest) held by each of ``ranks`` expert-parallel ranks: hottest
    first onto the least-loaded rank, equal counts (the spread :meth:`RoutingDistribution.imbalance` uses)."""
    if ranks < 1:
        raise DeviceGroupError(f"experts must be spread over at least one rank (got {ranks})")
    per_rank = -(-routing.experts // ranks)
    loads = [(0.0, r) for r in range(ranks)]
    held: list[list[int]] = [[] for _ in range(ranks)]
    for expert, p in enumerate(routing.probabilities()):
        full = []
        load, r = heapq.heappop(loads)
        while len(held[r]) >= per_rank:
            full.append((load, r))
            load, r = heapq.heappop(loads)
        held[r].append(expert)
        heapq.heappush(loads, (load + p, r))
        for item in full:
            heapq.heappush(loads, item)
    return held


# ---------------------------------------------------------------------------------------------------------
# Which rule a kernel follows


def _scope_parts(scope: str) -> list[str]:
    return scope.lower().replace("[", ".").replace("]", "").split(".")


def _leaf(kernel: Kernel) -> str:
    return _scope_parts(kernel.scope)[-1]


def is_kv_projection(name: str) -> bool:
    """Whether a weight (or a kernel scope) is a K or V projection, whose heads below tp are replicated."""
    return any(p in KV_PROJECTIONS for p in _scope_parts(name))


def kernel_rule(kernel: Kernel, feature: KernelFeatures) -> str:
    """The sharding rule of a kernel (one of RULES; see the module docstring)."""
    parts = _scope_parts(kernel.scope)
    if feature.cost_class == "grouped_gemm":
        return "expert_gemm"
    if EXPERT_SCOPE in parts:
        return "expert"
    is_matmul = feature.cost_class in ("gemm", "gemv")
    if feature.block == "other":
        if is_matmul and feature.weight_bytes > 0 and parts[-1] in LM_HEADS:
            return "lm_head"
        return "replicated"
    if any(p in ROUTER_SCOPES for p in parts):
        return "replicated"
    if feature.cost_class == "attention" or (is_matmul and feature.weight_bytes == 0 and feature.block == "attention"):
        return "heads"
    if is_matmul and feature.weight_bytes > 0:
        return "row" if parts[-1] in ROW_PARALLEL else "column"
    return "sharded"


# ---------------------------------------------------------------------------------------------------------
# Shards


def _head_share(heads: int | None, tp: int) -> float:
    """Share of ``heads`` one of tp GPUs holds (heads below tp are replicated); 1/tp when unknown."""
    if not heads:
        return 1.0 / tp
    return math.ceil(heads / tp) / heads


def kv_heads(graph: KernelGraph) -> int | None:
    """KV heads of the graph's attention, read off its first 4-D KV-cache buffer (None without one)."""
    for b in graph.buffers.values():
        if b.kind == "state" and is_kv_buffer(b.name) and len(b.shape) == 4:
            return int(b.shape[1])
    return None


class GraphTraffic:
    """What sharding reads off a graph's accesses, whatever the group: the bytes each kernel reads and writes
    of activations (not weights, not KV cache) and the matrix weights each kernel reads (one walk per graph)."""

    def __init__(self, graph: KernelGraph):
        self.read: dict[int, float] = defaultdict(float)
        self.written: dict[int, float] = defaultdict(float)
        self.matrices: dict[int, dict[str, float]] = defaultdict(dict)  # kernel -> matrix weights it reads
        for a in graph.accesses:
            buf = graph.buffers[a.buffer]
            if buf.kind == "weight" and len(buf.shape) >= 2:
                self.matrices[a.kernel][a.buffer] = float(buf.nbytes)
            if buf.kind == "weight" or is_kv_buffer(a.buffer):
                continue
            n = float(math.prod(a.sizes)) * a.itemsize
            (self.written if a.mode == "write" else self.read)[a.kernel] += n

    def split(self, f: KernelFeatures) -> tuple[float, float]:
        """(input, output) activation bytes of kernel f, summing to its ``other_bytes``."""
        r, w = self.read[f.index], self.written[f.index]
        frac = r / (r + w) if r + w > 0 else 0.5
        return f.other_bytes * frac, f.other_bytes * (1 - frac)

    def output(self, f: KernelFeatures) -> float:
        """Bytes of kernel f's output activation, as traced."""
        return self.written[f.index]


def _ceil(x: float) -> int:
    return max(1, math.ceil(x - 1e-9))


def _with_dims(f: KernelFeatures, gemm: tuple[int, int, int, int] | None, **scaled) -> KernelFeatures:
    """``f`` with new figures and GEMM dims; a GEMM that became narrow enough is timed as a GEMV."""
    cls = f.cost_class
    if gemm is not None and cls in ("gemm", "gemv"):
        cls = "gemv" if min(gemm[1], gemm[2]) <= GEMV_MAX_ROWS else "gemm"
    return replace(f, cost_class=cls, gemm=gemm, **scaled)


def _itemsize(f: KernelFeatures) -> float:
    return TRACE_DTYPE_BITS.get(f.compute_dtype, 16) / 8


def replica_share(graph: KernelGraph, group: DeviceGroup) -> float:
    """Share of a micro-batch's sequences the busiest of the group's dp replicas serves:
    ceil(batch / dp) / batch (``graph.meta['batch']``; 1 / dp when the trace does not say)."""
    batch = graph.meta.get("batch")
    if isinstance(batch, int) and batch >= 1:
        return math.ceil(batch / group.dp) / batch
    return 1.0 / group.dp


def default_routing(graph: KernelGraph, skew: float = 0.0) -> RoutingDistribution | None:
    """Uniform (or ``skew``) routing over the experts of the graph's first grouped GEMM, top-k from its
    rows per token (batch x seq of the trace); None for a graph without grouped GEMMs."""
    tokens = int(graph.meta.get("batch", 1)) * int(graph.meta.get("seq", 1))
    for k in graph.kernels:
        dims = gemm_dims(k)
        # the expert weights are the second argument ([E, K, N]; MXFP4 blocks [E, N, K/32, 16]); M rows are
        # token-expert assignments (the first GEMM of the MoE pipeline gathers them from the tokens)
        if cost_class(k) == "grouped_gemm" and dims is not None and len(k.shapes) > 1 and len(k.shapes[1]) >= 3:
            experts, rows = k.shapes[1][0], dims[1]
            return RoutingDistribution(experts, max(1, min(experts, rows // max(tokens, 1))), skew)
    return None


class _Sharder:
    def __init__(self, graph: KernelGraph, group: DeviceGroup, routing: RoutingDistribution | None,
                 traffic: GraphTraffic | None = None):
        self.graph, self.group, self.routing = graph, group, routing
        self.io = GraphTraffic(graph) if traffic is None else traffic
        self.kv_share = _head_share(kv_heads(graph), group.tp)
        self.replica_share = replica_share(graph, group)
        self.layout = expert_layout(routing, group.ep) if routing is not None else None
        self._uniform_active: dict[int, float] = {}
        self._rank_loads: dict[int, list[tuple[float, float]]] = {}  # routed rows -> (load, active experts) per rank
        self.matrices = self.io.matrices

    def column_share(self, kernel: Kernel) -> float:
        """Share of a column-parallel GEMM one GPU runs: 1/tp, the KV-head share for a K/V projection, and for
        a merged projection (QKV as one GEMM) the weight-weighted mean of its parts' shares."""
        tp = self.group.tp
        weights = self.matrices.get(kernel.index)
        if not weights or _leaf(kernel) in KV_PROJECTIONS:
            return self.kv_share if _leaf(kernel) in KV_PROJECTIONS else 1.0 / tp
        total = sum(weights.values())
        return sum(n * (self.kv_share if is_kv_projection(name) else 1.0 / tp) for name, n in weights.items()) / total

    # dense rules -------------------------------------------------------------------------------------
    def dense(self, kernel: Kernel, f: KernelFeatures, rule: str) -> KernelShard:
        g = self.group
        tp, r = g.tp, self.replica_share  # r: the busiest replica's share of the micro-batch
        dims = f.gemm
        inp, out = self.io.split(f)
        if rule in ("column", "lm_head"):
            w = self.column_share(kernel)
            gemm = None if dims is None else (dims[0], _ceil(dims[1] * r), _ceil(dims[2] * w), dims[3])
            sf = _with_dims(f, gemm, flops=f.flops * w * r, weight_bytes=f.weight_bytes * w,
                            kv_bytes=f.kv_bytes * r, other_bytes=(inp + out * w) * r)
            if rule == "lm_head" and tp > 1:
                return KernelShard(rule, (sf,), all_gather_time(self.io.output(f) * r, tp, g.link), "all-gather")
            return KernelShard(rule, (sf,))
        if rule == "row":
            gemm = None if dims is None else (dims[0], _ceil(dims[1] * r), dims[2], _ceil(dims[3] / tp))
            sf = _with_dims(f, gemm, flops=f.flops / tp * r, weight_bytes=f.weight_bytes / tp,
                            kv_bytes=f.kv_bytes * r, other_bytes=(inp / tp + out) * r)
            if tp == 1:
                return KernelShard(rule, (sf,))
            return KernelShard(rule, (sf,), all_reduce_time(self.io.output(f) * r, tp, g.link), "all-reduce")
        if rule == "heads":
            q = _head_share(kernel.shapes[0][1] if kernel.shapes and len(kernel.shapes[0]) == 4 else None, tp)
            gemm = None if dims is None else (_ceil(dims[0] * q * r), dims[1], dims[2], dims[3])
            return KernelShard(rule, (_with_dims(f, gemm, flops=f.flops * q * r, weight_bytes=f.weight_bytes * q,
                                                 kv_bytes=f.kv_bytes * self.kv_share * r,
                                                 other_bytes=f.other_bytes * q * r),))
        if rule == "sharded":
            return KernelShard(rule, (replace(f, flops=f.flops / tp * r, weight_bytes=f.weight_bytes / tp,
                                              kv_bytes=f.kv_bytes * self.kv_share * r,
                                              other_bytes=f.other_bytes / tp * r),))
        # replicated: the replica's tokens, weights in full (an embedding gathers rows per token)
        weights = f.weight_bytes * r if f.cost_class == "embedding" else f.weight_bytes
        gemm = None if dims is None else (dims[0], _ceil(dims[1] * r), dims[2], dims[3])
        sf = f if r == 1 else _with_dims(f, gemm, flops=f.flops * r, weight_bytes=weights,
                                         kv_bytes=f.kv_bytes * r, other_bytes=f.other_bytes * r)
        return KernelShard(rule, (sf,))

    # expert rules ------------------------------------------------------------------------------------
    def _routing_for(self, kernel: Kernel) -> RoutingDistribution:
        experts = kernel.shapes[1][0] if len(kernel.shapes) > 1 and kernel.shapes[1] else None
        if self.routing is None:
            raise DeviceGroupError(f"kernel {kernel.index} ({kernel.id}) is a grouped expert GEMM; give the "
                                   "routing distribution of the model's experts")
        if experts is not None and experts != self.routing.experts:
            raise DeviceGroupError(f"kernel {kernel.index} ({kernel.id}) has {experts} experts but the routing "
                                   f"distribution has {self.routing.experts}; describe this MoE layer's experts")
        return self.routing

    def expert_gemm(self, kernel: Kernel, f: KernelFeatures) -> tuple[KernelFeatures, ...]:
        """One shard per expert-parallel rank."""
        routing = self._routing_for(kernel)
        g = self.group
        probs = self._probabilities
        rows = f.gemm[1] if f.gemm is not None else 0
        if rows not in self._uniform_active:
            self._uniform_active[rows] = RoutingDistribution(routing.experts).expected_active(rows)
        uniform_active = self._uniform_active[rows]
        total_weights = f.weight_bytes * routing.experts / uniform_active if uniform_active > 0 else f.weight_bytes
        served = rows / g.expert_replicas  # assignments one expert replica serves
        if rows not in self._rank_loads:  # every MoE layer of the graph routes as many rows
            self._rank_loads[rows] = [
                (float(probs[held].sum()), float(np.sum(1.0 - (1.0 - probs[held]) ** served)) if served > 0 else 0.0)
                for held in self.layout]
        shards = []
        for load, active in self._rank_loads[rows]:
            share = load / g.expert_replicas
            gemm = None if f.gemm is None else (f.gemm[0], _ceil(rows * share), f.gemm[2], f.gemm[3])
            shards.append(replace(f, gemm=gemm, flops=f.flops * share, kv_bytes=f.kv_bytes * share,
                                  weight_bytes=total_weights * active / routing.experts,
                                  other_bytes=f.other_bytes * share))
        return tuple(shards)

    @cached_property
    def _probabilities(self) -> np.ndarray:
        return np.array(self.routing.probabilities())

    @cached_property
    def _imbalance(self) -> float:  # the same for every MoE layer of the graph: computed once
        return self.routing.imbalance(self.group.ep)

    def busiest_share(self) -> float:
        """Share of all token-expert assignments the busiest GPU serves: imbalance(ep) / size."""
        if self.routing is None:
            return 1.0 / self.group.size
        return self._imbalance / self.group.size

    def moe_collectives(self, first: KernelFeatures, last: KernelFeatures) -> tuple[float, float]:
        """(dispatch, combine) seconds of one MoE layer whose grouped GEMMs run from ``first`` to ``last``."""
        g = self.group
        dispatch = combine = 0.0
        if g.ep > 1 and first.gemm is not None and last.gemm is not None:
            imbalance = self._imbalance if self.routing is not None else 1.0
            per_device = first.gemm[1] / g.size
            dispatch = all_to_all_time(per_device * first.gemm[3] * _itemsize(first), g.ep, g.link, imbalance)
            combine = all_to_all_time(per_device * last.gemm[2] * _itemsize(last), g.ep, g.link, imbalance)
        if g.tp > 1 and last.gemm is not None:
            top_k = self.routing.top_k if self.routing is not None else 1
            tokens = last.gemm[1] / top_k * self.replica_share
            combine += all_gather_time(tokens * last.gemm[2] * _itemsize(last), g.tp, g.link)
        return dispatch, combine


def shard_kernels(graph: KernelGraph, features: list[KernelFeatures], group: DeviceGroup,
                  routing: RoutingDistribution | None = None, traffic: GraphTraffic | None = None) -> list[KernelShard]:
    """What one GPU of ``group`` runs of every kernel of ``graph``, and the collectives the kernels add.

    ``routing``: the experts' routing distribution (default: uniform over the first grouped GEMM's
    experts, top-k from its rows per token); ignored for dense graphs. ``traffic``: the graph's, where the
    caller has it."""
    if len(features) != len(graph.kernels):
        raise DeviceGroupError(f"{len(features)} kernel features for a graph of {len(graph.kernels)} kernels; "
                               "extract the features of this graph")
    if routing is None:
        routing = default_routing(graph)
    s = _Sharder(graph, group, routing, traffic)
    rules = [kernel_rule(k, f) for k, f in zip(graph.kernels, features, strict=True)]
    out: list[KernelShard] = []
    for k, f, rule in zip(graph.kernels, features, rules, strict=True):
        if group.size == 1:
            out.append(KernelShard(rule, (f,)))
        elif rule == "expert_gemm":
            out.append(KernelShard(rule, s.expert_gemm(k, f)))
        elif rule == "expert":
            share = s.busiest_share()
            out.append(KernelShard(rule, (replace(f, flops=f.flops * share, weight_bytes=f.weight_bytes * share,
                                                  kv_bytes=f.kv_bytes * share, other_bytes=f.other_bytes * share),)))
        else:
            out.append(s.dense(k, f, rule))
    if group.size > 1:
        layers: dict[tuple, list[int]] = defaultdict(list)
        for k, rule in zip(graph.kernels, rules, strict=True):
            if rule == "expert_gemm":
                layers[(k.layer, k.scope)].append(k.index)
        for members in layers.values():
            first, last = members[0], members[-1]
            dispatch, combine = s.moe_collectives(features[first], features[last])
            if dispatch > 0:
                out[first] = replace(out[first], collective_s=out[first].collective_s + dispatch,
                                     collective="all-to-all")
            if combine > 0:
                kinds = [out[last].collective] if out[last].collective else []
                kinds += [name for name, on in (("all-to-all", group.ep > 1), ("all-gather", group.tp > 1)) if on]
                out[last] = replace(out[last], collective_s=out[last].collective_s + combine,
                                    collective=" + ".join(kinds))
    return out


_SHARD_KEY = tuple(f.name for f in fields(KernelFeatures) if f.name != "index")  # what a kernel's time depends on


def group_kernel_times(graph: KernelGraph, features: list[KernelFeatures], model: CostModel, group: DeviceGroup,
                       routing: RoutingDistribution | None = None, whole_s: np.ndarray | None = None,
                       traffic: GraphTraffic | None = None) -> GroupTimes:
    """Seconds of every kernel of ``graph`` on ``group``: the busiest GPU's sharded compute (roofline with
    the model's efficiency classes; the model's own time where the shard is the whole kernel) and the
    collective each kernel adds on the group link (``whole_s``: the model's times of the whole kernels on one
    GPU, and ``traffic``, the graph's, where the caller has them)."""
    if model.device.id != group.spec.id:
        raise DeviceGroupError(f"the cost model is for {model.device.id} but the group is of {group.spec.id}; "
                               f"use a CostModel of {group.spec.id}")
    shards = shard_kernels(graph, features, group, routing, traffic)
    whole = [c.time_s for c in model.kernel_costs(graph, features)] if whole_s is None else whole_s
    compute = np.empty(len(shards))
    seen: dict[tuple, float] = {}  # a shard's time by its features but the kernel index: the layers repeat them

    def shard_time(sf: KernelFeatures) -> float:
        key = tuple(getattr(sf, name) for name in _SHARD_KEY)
        if key not in seen:
            seen[key] = kernel_time(sf, model.device, model.efficiency.for_kernel(sf.cost_class, sf.op),
                                    model.options).time_s
        return seen[key]

    for i, (shard, f, t) in enumerate(zip(shards, features, whole, strict=True)):
        compute[i] = t if shard.features == (f,) else max(shard_time(sf) for sf in shard.features)
    collective = np.array([s.collective_s for s in shards], dtype=float)
    return GroupTimes(compute, collective, compute + collective, tuple(s.rule for s in shards))


# ---------------------------------------------------------------------------------------------------------
# Memory


def _readers(graph: KernelGraph) -> dict[str, set[int]]:
    out: dict[str, set[int]] = defaultdict(set)
    for a in graph.accesses:
        out[a.buffer].add(a.kernel)
    return out


def _weight_share(name: str, graph: KernelGraph, group: DeviceGroup, readers: dict[str, set[int]],
                  rules: dict[int, str], kv_share: float) -> float:
    buf = graph.buffers[name]
    if EXPERT_SCOPE in _scope_parts(name):
        experts = buf.shape[0] if len(buf.shape) >= 2 else None
        return math.ceil(experts / group.ep) / experts if experts else 1.0 / group.ep
    if len(buf.shape) < 2:
        return 1.0
    share = 0.0
    for k in readers.get(name, ()):
        rule = rules[k]
        if rule in ("column", "row", "lm_head", "heads", "sharded"):
            kernel = graph.kernels[k]
            kv = rule == "column" and (_leaf(kernel) in KV_PROJECTIONS or is_kv_projection(name))
            share = max(share, kv_share if kv else 1.0 / group.tp)
        else:
            share = 1.0
    return share or 1.0


_RULES_CACHE: dict[str, dict[int, str]] = {}


def _rules(graph: KernelGraph) -> dict[int, str]:
    """Kernel index -> sharding rule (deployment options change no rule; cached by graph content)."""
    from tessera.cost.features import FeatureExtractor

    if graph.hash not in _RULES_CACHE:
        if len(_RULES_CACHE) >= 8:
            _RULES_CACHE.pop(next(iter(_RULES_CACHE)))
        fx = FeatureExtractor(graph)
        _RULES_CACHE[graph.hash] = {k.index: kernel_rule(k, fx.features(k)) for k in graph.kernels}
    return _RULES_CACHE[graph.hash]


def weight_share(buffer_name: str, graph: KernelGraph, group: DeviceGroup) -> float:
    """Fraction of weight ``buffer_name`` that one GPU of ``group`` holds (see the module docstring)."""
    buf = graph.buffers.get(buffer_name)
    if buf is None or buf.kind != "weight":
        raise DeviceGroupError(f"{buffer_name!r} is not a weight of the graph of {graph.model}")
    return _weight_share(buffer_name, graph, group, _readers(graph), _rules(graph),
                         _head_share(kv_heads(graph), group.tp))


def state_share(buffer_name: str, graph: KernelGraph, group: DeviceGroup) -> float:
    """Fraction of state buffer ``buffer_name`` one GPU of ``group`` holds: KV cache by its KV-head
    share, other state (SSM, conv) / tp, both x the busiest replica's share of the sequences."""
    buf = graph.buffers.get(buffer_name)
    if buf is None or buf.kind != "state":
        raise DeviceGroupError(f"{buffer_name!r} is not a state buffer of the graph of {graph.model}")
    if is_kv_buffer(buffer_name):
        return _head_share(kv_heads(graph), group.tp) * replica_share(graph, group)
    return replica_share(graph, group) / group.tp


def group_footprint(graph: KernelGraph, options: CostOptions, group: DeviceGroup) -> MemoryFootprint:
    """Resident bytes of weights and state on one GPU of ``group`` (deployed dtypes, as
    :func:`tessera.cost.model.memory_footprint` counts them for one device)."""
    readers, rules = _readers(graph), _rules(graph)
    kv_share = _head_share(kv_heads(graph), group.tp)
    weights = state = 0.0
    for b in graph.buffers.values():
        if b.kind == "weight":
            scale = options.weight_scale(b.dtype) if len(b.shape) >= 2 else 1.0
            weights += b.nbytes * scale * _weight_share(b.name, graph, group, readers, rules, kv_share)
        elif b.kind == "state":
            scale = options.kv_scale(b.dtype) if is_kv_buffer(b.name) else 1.0
            state += b.nbytes * scale * state_share(b.name, graph, group)
    return MemoryFootprint(weights, state)


def group_weight_bytes(graph: KernelGraph, options: CostOptions, group: DeviceGroup) -> float:
    """Bytes of weights one GPU of ``group`` holds, in the deployed weight dtype."""
    return group_footprint(graph, options, group).weight_bytes
