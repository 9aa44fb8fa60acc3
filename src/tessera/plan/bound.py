"""An upper bound on the throughput of any placement of a case: kernels split fractionally, transfers at
their least.

Every phase's kernels may be divided across the cluster's device types in any fractions; each type's
per-request load is the GPU-seconds of its share of the work, divided by its GPU count. Transfers: for
every read-after-write edge u -> v of a step and every type a, the share of requests whose producer runs
on a and consumer does not is at least ``x[u, a] - x[v, a]``, and that share of the edge's bytes leaves a
over its GPUs' links to the other types (their bandwidths summed); each type's outbound link seconds per
request are at most ``T`` too. Any mix of integral placements moves at least that much (the triangle
inequality), so the bound stays above every plan; a uniform split (request-dist's, every kernel at the
same share) moves nothing. No dependencies, critical paths, message latencies or memory placement are
charged. The LP (HiGHS) minimises the largest per-GPU load ``T``; the bound is ``outputs per request /
T``, in the plan's unit.

Batch. A plan's per-request work depends on the rows a step serves: a decode step of ``b`` sequences
costs ``t(b)`` and serves ``b`` requests one token each, so a kernel costs ``repeats x t(b) / b`` per
request, which falls as ``b`` grows (weights are read once per step). The bound lets the repeated
phase run at any candidate batch (``B // M`` for every micro-batch count M the planner uses: 1, 2, 4,
8), choosing per request which (an LP mode per batch; the other phases likewise take any of the shapes
the candidates' contexts give them, e.g. prefill's state rows under a fixed M), where ``B`` is the most
rows one engine can admit (per engine, not over the cluster: a step's cost depends on its own rows
only, and more engines only add GPUs, which the LP counts already):

* at most ``AdmissionConfig.max_num_seqs`` (an engine admits no more), or the fixed ``--max-batch``
  when one is given (a plan then runs at most that many rows per engine);
* at most what the whole cluster's memory holds once each weight is stored once: the sum of every
  GPU's memory at the larger of the memory-utilisation setting and the planner's usable share, minus
  the weights of every phase (each once), minus the largest activation reserve of the phases that run
  at a fixed shape, divided by one sequence's state at the mean context (paged blocks and the full
  context that plans reserve are only larger);
* at most the workload's requests (``fixed:``, ``offline:``: no more can be in flight).

Why no plan beats it. Take any feasible plan of any policy (replicas, request-dist's replicas with
their own batches, prefill-decode's state moves, micro-batches M, device groups, split expert GEMMs).
Its per-request time is at least each target's summed per-request load; its throughput is
``replicas x outputs / T_plan`` (request-dist: the sum over its types; a finite workload reports
outputs over a makespan that is at least the steady state's). Read the plan as LP fractions: the
share of a kernel's per-request work each type does (request-dist: the share of requests each type
serves). A kernel run on one GPU of type t costs the LP's single-GPU time; run on a group of ``s``
GPUs it costs ``s x`` the group's time, which the LP also offers (the smaller of the two is used, so
a group that shards better than linearly is covered); split experts are an LP mode of their own
(each part and the combine fractionally placed). An engine's step serves ``b / M`` rows with ``b`` at
most ``B`` (its own memory is part of the cluster's and holds every weight at least once; it admits at
most ``max_num_seqs`` and the workload's requests), so its per-row cost is at least the LP's at a
candidate batch provided the per-row cost does not fall below the candidates' anywhere under ``B``:
it falls with the rows in the cost model (weights and launch floors amortised over more rows) except
for wave quantisation of compute-bound kernels, which the candidates sample but do not exhaust; this
is the one assumption, checked on every test case (tests/plan/test_bound.py) and at every batch
1..B by ``tools/bound_batches.py`` (none beats the candidates for llama-3.1-8b, gpt-oss-20b and
mamba-codestral-7b at 128-192 sequences). So every plan's
GPU-seconds per request on each type are at least the LP's for its own fractions, the LP's optimum
``T`` is at most ``T_plan / replicas``, and no plan's throughput exceeds the bound. The bound is
reached only by a placement with no transfer, dependency or memory-placement cost at all, so a plan
close to it leaves little to find, and a gap between the best plan and the bound is room a search
could still win (or the price of transfers and dependencies it cannot avoid).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import highspy
import numpy as np

from tessera.cost.features import is_kv_buffer
from tessera.errors import TesseraError
from tessera.hardware.cluster import SAME_DEVICE
from tessera.plan.build import activation_peak, memory_items
from tessera.plan.context import PhaseSpec, PlanContext
from tessera.plan.problem import MICRO_BATCHES
from tessera.plan.targets import Target, cluster_targets, usable_memory
from tessera.workload import FixedWorkload, OfflineWorkload

NO_HEADROOM = 0.01  # a bound within 1% of the best baseline leaves no headroom to share


class BoundError(TesseraError):
    """The bound's LP could not be solved (the message says why)."""


@dataclass(frozen=True)
class ThroughputBound:
    """The best throughput any placement of the case could reach (fractional kernels, least transfers)."""

    throughput: float  # in ``unit``
    unit: str
    request_time_s: float  # the LP's T: the busiest type's per-GPU seconds per request
    batch: int  # the most rows one engine's repeated-phase step may serve (B)
    batch_limited_by: str  # "max_num_seqs", "fixed batch", "memory" or "the workload's requests"
    candidates: tuple[int, ...]  # batches the repeated phase may run at in the LP
    batch_share: dict[int, float]  # share of requests the LP ran at each candidate batch (non-zero ones)
    work_share: dict[str, float]  # share of a request's work each device type does (work in fastest-type seconds)
    phase_share: dict[str, dict[str, float]]  # phase -> device type -> share of that phase's work
    compute_types: tuple[str, ...]  # device types whose per-GPU load is T
    seconds: float  # to compute the bound (tracing, cost model, LP)
    memory: dict[str, float] = field(default_factory=dict)  # the batch's memory arithmetic, in bytes
    link_types: tuple[str, ...] = ()  # device types whose outbound links are busy all the time
    link_share: dict[str, float] = field(default_factory=dict)  # type -> its links' busy share of the request time

    @property
    def limited_by(self) -> str:
        """What limits the bound: compute on which types, the links out of which, at a batch set by what."""
        parts = ([f"compute on {' and '.join(self.compute_types)}"] if self.compute_types else []) + \
            ([f"the links out of {' and '.join(self.link_types)}"] if self.link_types else [])
        return f"{' and '.join(parts) or 'compute'} at a batch of {self.batch} ({self.batch_limited_by})"

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``--json``, benchmark reports)."""
        return {"throughput": self.throughput, "unit": self.unit, "request_time_s": self.request_time_s,
                "batch": self.batch, "batch_limited_by": self.batch_limited_by, "candidates": list(self.candidates),
                "batch_share": {str(k): v for k, v in self.batch_share.items()}, "work_share": self.work_share,
                "phase_share": self.phase_share,
                "compute_types": list(self.compute_types), "limited_by": self.limited_by, "seconds": self.seconds,
                "memory": self.memory, "link_types": list(self.link_types), "link_share": self.link_share}


def headroom_share(throughput: float, baseline: float, bound: float) -> float | None:
    """The share of the headroom above the best baseline that a plan takes: (plan - baseline) / (bound -
    baseline); None when the bound is within 1% of the baseline (no headroom to take)."""
    if not bound > baseline * (1 + NO_HEADROOM):
        return None
    return (throughput - baseline) / (bound - baseline)


def single_targets(ctx: PlanContext) -> tuple[list[str], list[int], list[Target]]:
    """Device types, their GPU counts and one single-GPU target of each (in cluster order)."""
    types = ctx.cluster.placement_types()
    names = list(types)
    return names, [len(types[n]) for n in names], [Target(types[n][0].spec, (types[n][0].id,), SAME_DEVICE)
                                                    for n in names]


def outbound_bandwidth(ctx: PlanContext, names: list[str]) -> np.ndarray:
    """Per device type, the bytes/s its GPUs can send to GPUs of the other types together: every GPU's link
    to every GPU of another type, each at its own bandwidth (a generous total, so the bound stays above
    any plan, which sends over those links)."""
    types = ctx.cluster.placement_types()
    out = np.zeros(len(names))
    for i, name in enumerate(names):
        for g in types[name]:
            for other, members in types.items():
                if other != name:
                    out[i] += sum(ctx.cluster.link(g.id, h.id).bandwidth for h in members)
    return out


def _fixed_phases(ctx: PlanContext) -> list[PhaseSpec]:
    main = ctx.main_phase
    return [p for p in ctx.phases if p is not main]


def admissible_batch(ctx: PlanContext) -> tuple[int, str, dict[str, float]]:
    """The most rows one engine's repeated-phase step can serve (B), what sets it, and the memory
    arithmetic behind it (bytes)."""
    _, counts, singles = single_targets(ctx)
    capacity = usable_memory(sum(t.device_bytes * n for t, n in zip(singles, counts, strict=True)),
                             ctx.admission.memory_utilization)
    weights: dict[str, float] = {}
    for ph in ctx.phases:
        graph = ctx.graph(ph)
        items = memory_items(graph, ctx.options, 1)
        for name, nbytes in zip(items.item_names, items.item_bytes, strict=True):
            if graph.buffers[name].kind == "weight":
                weights[name] = max(weights.get(name, 0.0), float(nbytes))
    activations = max((activation_peak(ctx.graph(ph)) for ph in _fixed_phases(ctx)), default=0.0)
    main = ctx.main_phase
    graph = ctx.graph(main)  # the state of one sequence at the mean context (no ``state_scale``)
    state = sum(b.nbytes * (ctx.options.kv_scale(b.dtype) if is_kv_buffer(name) else 1.0)
                for name, b in graph.buffers.items() if b.kind == "state") / (main.slots or main.batch)
    free = capacity - sum(weights.values()) - activations
    memory = {"capacity": capacity, "weights": sum(weights.values()), "activations": activations,
              "state_per_sequence": state, "free": free}
    limits: list[tuple[int, str]] = []
    if not ctx.admits:  # a fixed batch (diffusion's images, --max-batch, runtime plans)
        limits.append((ctx.batch, "fixed batch"))
    else:
        limits.append((ctx.admission.max_num_seqs, "max_num_seqs"))
        if isinstance(ctx.workload, FixedWorkload | OfflineWorkload):
            limits.append((ctx.workload.requests, "the workload's requests"))
    if state > 0:
        limits.append((max(1, int(free // state)), "memory"))
    batch, why = min(limits, key=lambda x: x[0])
    return max(1, batch), why, memory


def candidate_batches(batch: int) -> tuple[int, ...]:
    """The rows of one micro-batch of an engine at ``batch`` split into each M the planner uses (``batch``,
    ``batch // 2`` ... ``batch // 8``): the graphs the planner traces for a plan at that batch."""
    return tuple(sorted({max(1, batch // m) for m in MICRO_BATCHES}))


@dataclass
class PhaseCosts:
    """One phase at one batch: ``weight`` = steps per request / rows per step, ``whole[k, t]`` the
    GPU-seconds of kernel k per step on type t (inf: it cannot run there), ``split[k]`` [J, D] the
    parts and combine of a grouped expert GEMM that may be split instead of run whole, and ``edges`` the
    bytes each read-after-write dependency carries per step (moved where producer and consumer differ)."""

    phase: str
    batch: int
    weight: float
    whole: np.ndarray
    split: dict[int, np.ndarray] = field(default_factory=dict)
    edges: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))  # [E, 3]: producer, consumer, bytes per step


@dataclass(frozen=True)
class FractionalSolution:
    """The LP's optimum: the busiest type's per-GPU seconds per request, each type's GPU-seconds per
    request, and the share of requests in each mode of each phase."""

    request_time_s: float
    loads: np.ndarray
    mode_share: list[np.ndarray]  # per phase, the share of requests run in each of its modes
    work: dict[str, np.ndarray]  # phase -> [D] its work per request on each type (fastest-type seconds)
    link_s: np.ndarray | None = None  # [D] seconds per request of each type's outbound links (transfers charged)


def phase_costs(ctx: PlanContext, phase: PhaseSpec, singles: list[Target], counts: list[int],
                names: list[str]) -> PhaseCosts:
    """A phase's kernel costs on one GPU of each type of :func:`single_targets` (a group's GPU-seconds where
    they are smaller), and the parts of its expert GEMMs when Tessera may split them (``cache``: kernel
    times by graph and target, shared between calls). A prompt phase costs the mean over the workload's
    representative prompt lengths, as plans cost it (where every length has the same kernels; else the
    mean prompt's, which is cheaper, so the bound stays above the plans)."""
    lengths = ctx.prompt_lengths if phase.phase == "prefill" and phase.seq is not None else []
    if lengths:
        each = [_phase_costs(ctx, replace(phase, seq=n, ctx=n), singles, counts, names) for n in lengths]
        if all(c.whole.shape == each[0].whole.shape and c.split.keys() == each[0].split.keys() for c in each):
            same = all(c.edges.shape == each[0].edges.shape and (c.edges[:, :2] == each[0].edges[:, :2]).all()
                       for c in each)
            edges = np.mean([c.edges for c in each], axis=0) if same else np.zeros((0, 3))
            return PhaseCosts(phase.phase, phase.batch, each[0].weight, np.mean([c.whole for c in each], axis=0),
                              {k: np.mean([c.split[k] for c in each], axis=0) for k in each[0].split}, edges)
    return _phase_costs(ctx, phase, singles, counts, names)


def _phase_costs(ctx: PlanContext, phase: PhaseSpec, singles: list[Target], counts: list[int],
                 names: list[str]) -> PhaseCosts:
    key = (phase, 1, tuple(t.members for t in singles), 1)
    sp = ctx.cache.problems.get(key)
    facts = ctx.graph_facts(phase)
    features, routing = facts.features, facts.routing
    if sp is not None:
        whole = sp.problem.times.copy()
    else:
        whole = np.stack([ctx.kernel_times(phase, t) for t in singles], axis=1)
    for d, (name, n) in enumerate(zip(names, counts, strict=True)):
        for s in range(2, n + 1):
            if n % s == 0:
                group = cluster_targets(ctx.cluster, n // s, [name])[0]
                whole[:, d] = np.minimum(whole[:, d], s * ctx.kernel_times(phase, group))
    split: dict[int, np.ndarray] = {}
    if ctx.spec.family == "moe" and ctx.split_experts and routing is not None:
        split = _expert_splits(ctx, features, singles, routing)
    edges = np.array([(u, v, b) for u, v, b in facts.edges if b > 0], dtype=float).reshape(-1, 3)
    return PhaseCosts(phase.phase, phase.batch, phase.repeats / phase.rows, whole, split, edges)


def _expert_splits(ctx: PlanContext, features, singles: list[Target], routing) -> dict[int, np.ndarray]:
    """Graph kernel -> [parts + combine, D] seconds on one GPU of each type, for every grouped expert GEMM
    that Tessera's expert split cuts (as :func:`tessera.plan.build.build_step_problem` cuts them)."""
    from tessera.cost.model import CostModel
    from tessera.plan.experts import combine_times, expert_part_times
    from tessera.plan.policies import EXPERT_PARTS

    models = [CostModel(t.spec, ctx.options, ctx.profile if ctx.profile is not None and
                        ctx.profile.device == t.spec.id else None) for t in singles]
    out = {}
    for f in features:
        if f.cost_class == "grouped_gemm" and f.gemm is not None and f.gemm[1] >= EXPERT_PARTS:
            n = min(EXPERT_PARTS, routing.experts)
            out[f.index] = np.vstack([expert_part_times(f, models, n, routing), combine_times(f, models)[None, :]])
    return out


def upper_bound(ctx: PlanContext) -> ThroughputBound:
    """The case's upper bound on throughput (computed once per context; graphs and problems cached in it)."""
    if ctx.batch in ctx.cache.bounds:
        return ctx.cache.bounds[ctx.batch]
    t0 = time.perf_counter()
    names, counts, singles = single_targets(ctx)
    batch, why, memory = admissible_batch(ctx)
    candidates = candidate_batches(batch)
    children = [ctx.for_batch(b) for b in candidates]
    repeated = [phase_costs(c, c.main_phase, singles, counts, names) for c in children]
    phases = []
    for i, ph in enumerate(ctx.phases):
        if ph is ctx.main_phase:
            phases.append(repeated)
            continue
        # the other phases as the children have them (their state rows follow the batch under a fixed M)
        variants = list(dict.fromkeys([ph, *(c.phases[i] for c in children)]))
        phases.append([phase_costs(ctx, v, singles, counts, names) for v in variants])
    lp = fractional_request_time(phases, counts, outbound_bandwidth(ctx, names))
    t_req, loads = lp.request_time_s, lp.loads
    shares = lp.mode_share[ctx.phases.index(ctx.main_phase)]
    bound = ThroughputBound(
        throughput=ctx.outputs_per_request / t_req if t_req > 0 else float("inf"), unit=ctx.unit,
        request_time_s=t_req, batch=batch, batch_limited_by=why, candidates=candidates,
        batch_share={m.batch: float(s) for m, s in zip(repeated, shares, strict=True) if s > 1e-9},
        work_share=_shares(names, sum(lp.work.values())),
        phase_share={phase: _shares(names, w) for phase, w in lp.work.items()},
        compute_types=tuple(n for n, v, c in zip(names, loads, counts, strict=True) if v / c >= t_req * (1 - 1e-6)),
        seconds=time.perf_counter() - t0, memory=memory,
        link_types=tuple(n for n, v in zip(names, lp.link_s, strict=True) if t_req > 0 and v >= t_req * (1 - 1e-6)),
        link_share={n: float(v) / t_req for n, v in zip(names, lp.link_s, strict=True) if t_req > 0 and v > 0})
    ctx.cache.bounds[ctx.batch] = bound
    return bound


def _shares(names: list[str], amounts: np.ndarray) -> dict[str, float]:
    total = float(np.sum(amounts))
    return {n: float(a) / total for n, a in zip(names, amounts, strict=True)} if total > 0 else {}


class _Columns:
    """LP columns and sparse rows (CSR, built in one pass)."""

    def __init__(self) -> None:
        self.n = 0
        self.rows: list[tuple[np.ndarray, np.ndarray, float, float]] = []
        self.blocks: list[tuple[np.ndarray, np.ndarray, float, float]] = []

    def new(self, count: int) -> np.ndarray:
        out = np.arange(self.n, self.n + count)
        self.n += count
        return out

    def row(self, cols, coefs, lower: float, upper: float) -> None:
        self.rows.append((np.asarray(cols, dtype=np.int32), np.asarray(coefs, dtype=float), lower, upper))

    def block(self, cols: np.ndarray, coefs: np.ndarray, lower: float, upper: float) -> None:
        """Rows of one shape at once: ``cols`` [R, W] (-1: no entry; no column twice in a row), ``coefs``
        [R, W], each row between ``lower`` and ``upper``."""
        self.blocks.append((np.asarray(cols, dtype=np.int64), np.asarray(coefs, dtype=float), lower, upper))


def _place(lp: _Columns, cost: np.ndarray, weight: float, load: list[list[tuple[np.ndarray, np.ndarray]]],
           extra: list[list[tuple[int, float]]], rhs: float, work: list[tuple[int, np.ndarray, np.ndarray]]) -> np.ndarray:
    """Columns x[k, t] >= 0 for the finite entries of ``cost`` [K, D], one row per kernel ``sum_t x[k, t] +
    extra[k] = rhs``; their GPU-seconds (``weight`` x cost) added to each type's load, and their work
    (``weight`` x the kernel's time on its fastest type, a unit common to the types) to ``work``. Returns the
    columns [K, D] (-1 where the kernel cannot run)."""
    finite = np.isfinite(cost)
    cols = np.full(cost.shape, -1)
    cols[finite] = lp.new(int(finite.sum()))
    for k in range(cost.shape[0]):
        ks = cols[k][finite[k]]
        lp.row(np.concatenate([ks, [c for c, _ in extra[k]]]),
               np.concatenate([np.ones(len(ks)), [v for _, v in extra[k]]]), rhs, rhs)
    fastest = np.where(finite, cost, np.inf).min(axis=1)
    for d in range(cost.shape[1]):
        load[d].append((cols[finite[:, d], d], weight * cost[finite[:, d], d]))
        work.append((d, cols[finite[:, d], d], weight * fastest[finite[:, d]]))
    return cols


def _transfers(lp: _Columns, cols: np.ndarray, mode: PhaseCosts, weight: float, out_bandwidth: np.ndarray,
               links: list[list[tuple]]) -> None:
    """The bytes a mode's placement must move, charged to the sending type's links: for every edge (u -> v)
    and type a, a column f >= x[u, a] - x[v, a] (the share of requests whose producer runs on a and consumer
    does not), its bytes x ``weight`` / a's outbound bandwidth added to a's link seconds. A mix of integral
    placements moves at least this (the triangle inequality); split expert GEMMs' edges are left out."""
    keep = [i for i, (u, v, _) in enumerate(mode.edges) if int(u) not in mode.split and int(v) not in mode.split]
    if not keep:
        return
    edges = mode.edges[keep]
    ones = np.ones(len(edges))
    for a in range(cols.shape[1]):
        f = lp.new(len(edges))
        cu, cv = cols[edges[:, 0].astype(int), a], cols[edges[:, 1].astype(int), a]
        lp.block(np.stack([f, cu, cv], axis=1), np.stack([ones, -ones, ones], axis=1), 0.0, highspy.kHighsInf)
        links[a].append((f, weight * edges[:, 2] / out_bandwidth[a], cu, cv))


def fractional_request_time(phases: list[list[PhaseCosts]], gpus: np.ndarray | list[int],
                            out_bandwidth: np.ndarray | list[float] | None = None) -> FractionalSolution:
    """The LP over kernel fractions: the least per-GPU seconds per request of the busiest device type
    (``gpus[t]`` GPUs of type t). Each entry of ``phases`` is one phase's modes (the same phase at several
    batches or state sizes); a request runs each phase in any mix of its modes. Every kernel of a mode is
    placed in full at the mode's share: whole on the types, or (split expert GEMMs) at a split share u
    with each part and the combine placed at u. ``out_bandwidth[t]``: the bytes/s type t's GPUs can send
    to the other types together; given, every edge a placement cuts is charged to the sender's links, whose
    seconds per request are also at most the request time (:func:`_transfers`)."""
    counts = np.asarray(gpus, dtype=float)
    d = len(counts)
    scale = sum(modes[-1].weight * float(np.where(np.isfinite(modes[-1].whole), modes[-1].whole, np.inf).min(axis=1).sum())
                for modes in phases) or 1.0
    lp = _Columns()
    t_col = int(lp.new(1)[0])
    load: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(d)]
    links: list[list[tuple]] = [[] for _ in range(d)]  # per type: (f columns, seconds per unit, x[u], x[v] columns)
    work: dict[str, list[tuple[int, np.ndarray, np.ndarray]]] = {}
    shares = []
    for modes in phases:
        z = lp.new(len(modes))
        lp.row(z, np.ones(len(z)), 1.0, 1.0)
        shares.append(z)
        for zc, m in zip(z.tolist(), modes, strict=True):
            u = dict(zip(m.split, lp.new(len(m.split)).tolist(), strict=True))
            extra = [([(u[k], 1.0)] if k in u else []) + [(zc, -1.0)] for k in range(m.whole.shape[0])]
            mine = work.setdefault(m.phase, [])
            cols = _place(lp, m.whole, m.weight / scale, load, extra, 0.0, mine)
            if out_bandwidth is not None and d > 1:
                _transfers(lp, cols, m, m.weight / scale, np.asarray(out_bandwidth, dtype=float), links)
            for k, parts in m.split.items():
                _place(lp, parts, m.weight / scale, load, [[(u[k], -1.0)]] * parts.shape[0], 0.0, mine)
    for dd in range(d):
        lp.row(np.concatenate([c for c, _ in load[dd]] + [[t_col]]),
               np.concatenate([v for _, v in load[dd]] + [[-counts[dd]]]), -highspy.kHighsInf, 0.0)
    for dd in range(d):
        if links[dd]:
            lp.row(np.concatenate([c[0] for c in links[dd]] + [[t_col]]),
                   np.concatenate([c[1] for c in links[dd]] + [[-1.0]]), -highspy.kHighsInf, 0.0)
    value = _run(lp, t_col)
    loads = np.array([sum(float(np.dot(value[c], v)) for c, v in load[dd]) for dd in range(d)])

    def share(c: np.ndarray) -> np.ndarray:
        return np.where(c >= 0, value[np.maximum(c, 0)], 0.0)

    # the flows the placement needs (the f columns may sit above them where a link has room)
    link_s = np.array([sum(float(np.dot(np.maximum(share(cu) - share(cv), 0.0), v)) for _, v, cu, cv in links[dd])
                       for dd in range(d)]) * scale
    per_phase = {}
    for phase, entries in work.items():
        per_phase[phase] = np.zeros(d)
        for dd, c, v in entries:
            per_phase[phase][dd] += float(np.dot(value[c], v)) * scale
    return FractionalSolution(float(value[t_col]) * scale, loads * scale, [value[z] for z in shares], per_phase,
                              link_s)


def _run(lp: _Columns, t_col: int) -> np.ndarray:
    """Solve min T over the columns (all >= 0) and rows; the column values."""
    from tessera.plan.milp import _quiet_stdout

    with _quiet_stdout():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.addVars(lp.n, np.zeros(lp.n), np.full(lp.n, highspy.kHighsInf))
    h.changeColsCost(1, np.array([t_col], dtype=np.int32), np.array([1.0]))
    starts, index, value, lower, upper = [0], [], [], [], []
    for cols, coefs, lo, up in lp.rows:
        order = np.argsort(cols, kind="stable")
        cols, coefs = cols[order], coefs[order]
        uniq, inv = np.unique(cols, return_inverse=True)
        summed = np.bincount(inv, weights=coefs, minlength=len(uniq))
        keep = summed != 0
        index.append(uniq[keep])
        value.append(summed[keep])
        starts.append(starts[-1] + int(keep.sum()))
        lower.append(lo)
        upper.append(up)
    for cols, coefs, lo, up in lp.blocks:
        keep = (cols >= 0) & (coefs != 0)
        index.append(cols[keep])
        value.append(coefs[keep])
        starts.extend((starts[-1] + np.cumsum(keep.sum(axis=1))).tolist())
        lower.extend([lo] * len(cols))
        upper.extend([up] * len(cols))
    h.addRows(len(lower), np.array(lower), np.array(upper), starts[-1], np.array(starts[:-1], dtype=np.int32),
              np.concatenate(index).astype(np.int32), np.concatenate(value))
    h.run()
    status = h.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:
        raise BoundError(f"the upper bound's LP did not solve to optimality ({h.modelStatusToString(status)})")
    return np.array(h.getSolution().col_value)
