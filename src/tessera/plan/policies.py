"""The deployment policies, each a constrained instance of the same placement problem and evaluator.

* ``homogeneous``: one device type alone (its GPUs as replicas or one sharded group, whichever is best).
* ``request-dist``: every device type serves its own replicas; requests are routed in proportion to
  speed, so throughputs add.
* ``prefill-decode``: the prompt phases on one target, the repeated phase on another, the state (KV
  cache) copied between them per request.
* ``attention-ffn``: attention kernels on one target, MLP/expert kernels on the other, M >= 2
  micro-batches ping-ponging; the remaining kernels (norms, embeddings, head) placed by the solver.
* ``layer-pipeline``: contiguous layer ranges per target in a device order, sized by exhaustive search
  over every split point.
* ``tessera``: kernel placement by the MILP over folded layers (with per-run differences), over
  replica counts and M, each phase restricted to where the main phase keeps its weights; its search
  space contains every baseline above (they are offered as candidates and warm starts), so it never
  loses on the model, and its plan names the baseline it ties when one is as good.

Every policy optimises its own knobs (device choice, replicas, M, orientation, split points).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import numpy as np

from tessera.capture.trace_facts import graph_layers
from tessera.errors import TesseraError
from tessera.plan.admission import round_batch
from tessera.plan.ceiling import cannot_beat, throughput_ceiling
from tessera.plan.config import DEFAULT_MIX_MIN_GAIN, PolicyError
from tessera.plan.context import Chosen, PhaseSpec, PlanContext, PlanningError
from tessera.plan.deployment import DeploymentPlan
from tessera.plan.fold import layer_groups, merge
from tessera.plan.milp import SolverError, solve_placement
from tessera.plan.mixes import best_mix
from tessera.plan.pipeline_search import (
    Scorer,
    admitted_scorer,
    best_pipelines,
    fixed_scorer,
    layer_devices,
    pipelines,
)
from tessera.plan.problem import PlacementProblem
from tessera.plan.step_evaluation import evaluate
from tessera.plan.symmetry import canonical, device_classes
from tessera.plan.targets import Target, cluster_targets
from tessera.workload import PoissonWorkload

NOT_APPLICABLE = {
    ("prefill-decode", "diffusion"): "a diffusion model has no prefill and decode phases",
    ("attention-ffn", "ssm"): "an SSM has no attention kernels to separate from its MLP",
    ("attention-ffn", "diffusion"): "a diffusion transformer's blocks are not split into attention and FFN "
                                    "halves that ping-pong between devices",
}
EXPERT_PARTS = 2  # expert groups per grouped GEMM when Tessera splits an MoE layer's experts
OTHER_PHASE_TIME_SHARE = 0.3  # of a step solve's time limit for the phases a request needs once (prefill)
MIN_ROUTE_BATCH = 16  # the fewest sequences a smaller engine of a route mix admits
ROUTE_BATCH_SHARES = tuple(k / 16 for k in range(8, 1, -1))  # smaller engines: 8/16 .. 2/16 of the full engine
MIX_MIN_GAIN = DEFAULT_MIX_MIN_GAIN  # the default of --mix-min-gain (see tessera.plan.config)



def applicability(ctx: PlanContext, policy: str) -> str | None:
    """Why ``policy`` does not apply to this model and cluster (None when it applies)."""
    reason = NOT_APPLICABLE.get((policy, ctx.spec.family))
    if reason:
        return reason
    types = ctx.cluster.placement_types()
    if policy in ("prefill-decode", "attention-ffn", "layer-pipeline") and len(types) < 2:
        return f"it splits a model over two device types and the cluster has one ({ctx.cluster.describe()})"
    if policy == "request-dist" and len(types) < 2:
        return f"the cluster has one device type: request distribution is the homogeneous plan ({ctx.cluster.describe()})"
    return None


def _better(a: DeploymentPlan | None, b: DeploymentPlan | None, objective: str) -> DeploymentPlan | None:
    """The better of two plans: feasible first, then throughput (or latency, then throughput)."""
    if a is None or b is None:
        return a or b
    if a.feasible != b.feasible:
        return a if a.feasible else b
    if objective == "latency":
        ka, kb = (a.latency_s, -a.throughput), (b.latency_s, -b.throughput)
        return a if ka <= kb else b
    return a if a.throughput >= b.throughput * (1 - 1e-12) else b


def _best(plans, objective: str) -> DeploymentPlan | None:
    best = None
    for p in plans:
        best = _better(best, p, objective)
    return best


def _everywhere(ctx: PlanContext, targets: list[Target], target: int) -> Chosen:
    """Every phase's kernels on one target (M = 1, or the context's fixed M)."""
    out = []
    for ph in ctx.phases:
        m = ctx.fixed_m(ph)
        out.append((ph, m, (target,) * ctx.step_problem(ph, targets, m).problem.kernels, {"method": "fixed"}))
    return out


# ---------------------------------------------------------------------------------------------------------
# Baselines

def homogeneous(ctx: PlanContext, objective: str, device: str | None = None) -> DeploymentPlan:
    """One device type alone: all its GPUs, as replicas or one sharded group, whichever is best."""
    types = ctx.cluster.placement_types()
    if device is None:
        if len(types) > 1:
            raise PolicyError(f"homogeneous needs --device: the cluster has {', '.join(types)}")
        device = next(iter(types))
    from tessera.hardware.catalog import canonical_id

    rid = canonical_id(device) if device not in types else device
    if rid not in types:  # "cpu" names the first local worker when every worker is a target of its own
        rid = next((t for t in types if t.startswith(f"{rid}:")), rid)
    if rid not in types:
        raise PolicyError(f"--device {device}: the cluster has no {rid}; it has {', '.join(types)}")
    plans = []
    for r in ctx.replica_counts([rid]):
        rctx = _replica(ctx, r)
        if not rctx.micro_batch_options(rctx.main_phase):  # a fixed M that does not split this replica's batch
            continue
        targets = cluster_targets(ctx.cluster, r, [rid])
        plans.append(rctx.assemble_admitted("homogeneous", targets, r, _everywhere(rctx, targets, 0), objective,
                                            device=rid))
    if not plans:
        return DeploymentPlan(model=ctx.model, cluster=ctx.cluster.describe(), workload=ctx.workload_text,
                              policy="homogeneous", applicable=True, feasible=False, device=rid, unit=ctx.unit,
                              reason=f"{ctx.micro_batches} micro-batches do not split any replica's batch")
    return _best(plans, objective)


def _replica(ctx: PlanContext, replicas: int) -> PlanContext:
    """The context of one of ``replicas`` replicas: the deployment's batch split evenly between them, or,
    where engines admit from memory, the most one engine may admit (its memory then decides), or, where
    every engine has its own batch (diffusion's default images in flight), the same context."""
    if ctx.admits:
        return ctx.for_batch(ctx.engine_cap(replicas)[0])
    if not ctx.shared_batch:
        return ctx
    return ctx.for_batch(max(1, ctx.batch // replicas))


def request_dist(ctx: PlanContext, objective: str) -> DeploymentPlan:
    """Each device type runs its own best homogeneous replicas; throughputs add, requests split by speed."""
    types = list(ctx.cluster.placement_types())
    parts = [homogeneous(ctx, "throughput", rid) for rid in types]
    fitting = [p for p in parts if p.feasible]
    idle = []
    if len(fitting) > 1 and ctx.shared_batch:  # a fixed batch is shared: each type gets rows in proportion to speed
        shares = split_rows(ctx.batch, [p.throughput for p in fitting])
        rows = {p.device: n for p, n in zip(fitting, shares, strict=True)}
        idle = [p.device for p in fitting if rows[p.device] == 0]
        parts = [homogeneous(ctx.for_batch(rows[p.device]), "throughput", p.device) if p.feasible and rows[p.device]
                 else p for p in parts if p.device not in idle]
        fitting = [p for p in parts if p.feasible]
    if not fitting:
        reason = "no device type holds a replica: " + "; ".join(f"{p.device}: {p.reason}" for p in parts)
        plan = parts[0]
        plan.policy, plan.device, plan.reason = "request-dist", None, reason
        return plan
    plan = DeploymentPlan(
        model=ctx.model, cluster=ctx.cluster.describe(), workload=ctx.workload_text, policy="request-dist",
        applicable=True, feasible=True, targets=[t for p in fitting for t in p.targets],
        replicas=sum(p.replicas for p in fitting), memory_bytes=[b for p in fitting for b in p.memory_bytes],
        memory_capacity=[b for p in fitting for b in p.memory_capacity], unit=ctx.unit,
        throughput=sum(p.throughput for p in fitting), cost_per_hour=sum(p.cost_per_hour for p in fitting),
        price_scenario=ctx.price_scenario, latency_s=max(p.latency_s for p in fitting),
        ttft_s=max(p.ttft_s for p in fitting), bottleneck="compute on every replica",
        reason=", ".join(f"{p.device}: {p.throughput / sum(q.throughput for q in fitting):.0%} of requests"
                         for p in fitting) + ("" if len(fitting) == len(parts) else "; left out (no fit): " +
                                              ", ".join(p.device for p in parts if not p.feasible)) +
        (f"; idle (no rows of a batch of {ctx.batch}): {', '.join(idle)}" if idle else ""))
    offset = 0
    for p in fitting:
        for s in p.steps:
            s.solver = dict(s.solver, replica_of=p.device, target_offset=offset)
            plan.steps.append(s)
        offset += len(p.targets)
    plan.extra["replicas"] = [p.summary() for p in fitting]
    return plan


def split_rows(batch: int, speeds: list[float]) -> list[int]:
    """``batch`` rows divided in proportion to ``speeds``, exactly (largest remainders; they sum to
    ``batch``, and a replica may get none when there are fewer rows than replicas)."""
    total = sum(speeds)
    if batch < 0 or not speeds or not total > 0:
        raise PlanningError(f"cannot split {batch} rows by speeds {speeds}")
    exact = [batch * s / total for s in speeds]
    rows = [int(x) for x in exact]
    by_remainder = sorted(range(len(speeds)), key=lambda i: (-(exact[i] - rows[i]), -speeds[i], i))
    for i in by_remainder[:batch - sum(rows)]:
        rows[i] += 1
    return rows


def prefill_decode(ctx: PlanContext, objective: str) -> DeploymentPlan:
    """The prompt phases on one target, the repeated phase on another; state copied per request."""
    return _best(prefill_decode_plans(ctx, objective), objective)


def prefill_decode_plans(ctx: PlanContext, objective: str) -> list[DeploymentPlan]:
    """Prefill-decode in every orientation (prompt target, decode target) and replica count."""
    plans = []
    for r in ctx.replica_counts():
        rctx = _replica(ctx, r)
        main = rctx.main_phase
        if not rctx.micro_batch_options(main):
            continue
        targets = cluster_targets(ctx.cluster, r)
        for a, b in itertools.permutations(range(len(targets)), 2):
            chosen = []
            for ph in rctx.phases:
                m = rctx.fixed_m(ph)
                k = rctx.step_problem(ph, targets, m).problem.kernels
                chosen.append((ph, m, ((b if ph is main else a),) * k, {"method": "fixed"}))
            plans.append(rctx.assemble_admitted("prefill-decode", targets, r, chosen, objective,
                                                reason=f"prefill on {targets[a].name}, decode on {targets[b].name}"))
    return plans


def _restricted(problem: PlacementProblem, allowed: np.ndarray) -> PlacementProblem:
    """The problem with kernel i kept off device d wherever ``allowed[i, d]`` is False."""
    times = np.where(allowed, problem.times, np.inf)
    bad = ~np.isfinite(times).any(axis=1)
    if bad.any():
        raise PlanningError(f"kernel {int(np.flatnonzero(bad)[0])} has no device left to run on")
    return PlacementProblem(problem.devices, times, problem.edges, problem.bandwidth, problem.latency,
                            problem.pinned, problem.together, problem.micro_batches, problem.messages,
                            problem.memory, problem.loop_edges)


def _with_offsets(problem: PlacementProblem, offsets: np.ndarray | None) -> PlacementProblem:
    """The problem plus one kernel pinned on each device whose time is that device's load from the other
    phases (per micro-batch): the solver then balances this phase against work it does not place."""
    if offsets is None or not (offsets > 0).any():
        return problem
    d = len(problem.devices)
    extra = np.full((d, d), np.inf)
    np.fill_diagonal(extra, np.maximum(offsets, 0.0))
    k = problem.kernels
    return PlacementProblem(problem.devices, np.vstack([problem.times, extra]), problem.edges, problem.bandwidth,
                            problem.latency, {**problem.pinned, **{k + i: i for i in range(d)}}, problem.together,
                            problem.micro_batches, problem.messages, problem.memory, problem.loop_edges)


def _split_by(group: list[int], allowed: np.ndarray) -> list[list[int]]:
    """A folded group cut into runs of kernels with the same allowed targets."""
    parts: dict[bytes, list[int]] = {}
    for k in group:
        parts.setdefault(allowed[k].tobytes(), []).append(k)
    return list(parts.values())


def _solve_folded(ctx: PlanContext, phase: PhaseSpec, targets: list[Target], m: int, objective: str,
                  allowed: np.ndarray | None = None, start: tuple[int, ...] | None = None,
                  memory: bool = True, offsets: np.ndarray | None = None,
                  expert_parts: int = 1, time_share: float = 1.0) -> tuple[tuple[int, ...], dict]:
    """Solve a phase on its folded problem (optionally restricted, and balanced against ``offsets``: other
    phases' seconds per micro-batch on each target); the unfolded assignment and solver info."""
    folded = ctx.folded(phase, targets, m, expert_parts)
    if allowed is not None:  # fold only kernels allowed on the same targets
        groups = [sub for g in folded.groups for sub in _split_by(g, allowed)]
        if len(groups) != len(folded.groups):
            folded = merge(ctx.step_problem(phase, targets, m, expert_parts).problem, groups)
        problem = _restricted(folded.problem, np.stack([allowed[g[0]] for g in folded.groups]))
    else:
        problem = folded.problem
    if not memory:
        problem = PlacementProblem(problem.devices, problem.times, problem.edges, problem.bandwidth, problem.latency,
                                   problem.pinned, problem.together, problem.micro_batches, problem.messages,
                                   None, problem.loop_edges)
    k = problem.kernels
    folded_start = None
    if start is not None:
        try:
            folded_start = folded.fold(start)
            if not np.isfinite(problem.times[np.arange(k), list(folded_start)]).all():
                folded_start = None
        except TesseraError:
            folded_start = None
    problem = _with_offsets(problem, offsets if objective == "throughput" else None)
    if folded_start is not None and problem.kernels > k:
        folded_start = (*folded_start, *range(problem.kernels - k))
    key = (phase.phase, phase.batch, m, tuple(t.members for t in targets), expert_parts, objective, memory,
           None if allowed is None else allowed.tobytes(), None if offsets is None else np.round(offsets, 12).tobytes(),
           folded_start)
    memo = ctx.cache.solved
    if key in memo:  # the same problem again (another variant or round reached it): reuse the answer
        assignment, info = memo[key]
        return assignment, dict(info, reused=True)
    t0 = time.perf_counter()
    placement = solve_placement(problem, objective, gap=ctx.gap, time_limit_s=ctx.time_limit_s * time_share,
                                start=folded_start)
    solve_s = time.perf_counter() - t0
    ctx.add_solve_time(solve_s)
    info = {"method": "milp (folded)", "kernels": k, "gap": placement.gap, "bound_s": placement.bound,
            "value_s": placement.value, "optimal": placement.optimal, "solve_s": solve_s,
            "expert_parts": expert_parts}
    memo[key] = (folded.unfold(placement.assignment[:k]), info)
    return memo[key][0], info


def _block_allowed(sp, att: int, ffn: int) -> np.ndarray:
    """Attention kernels only on ``att``, FFN kernels only on ``ffn``, others anywhere."""
    allowed = np.ones(sp.problem.times.shape, dtype=bool)
    for blk, target in (("attention", att), ("ffn", ffn)):
        rows = sp.block_kernels[blk]
        allowed[rows] = False
        allowed[rows, target] = True
    return allowed


def _follow_residency(ctx: PlanContext, phase: PhaseSpec, targets, m: int, main_sp, main_assignment,
                      pin_state: bool, expert_parts: int = 1) -> np.ndarray:
    """Kernels of ``phase`` may run only where the main phase keeps the weights they read (and, with
    ``pin_state``, where it keeps the state they touch)."""
    where, _ = ctx.residency([(ctx.main_phase, main_sp, main_assignment)])
    sp = ctx.step_problem(phase, targets, m, expert_parts)
    state = set(sp.graph.state)
    return residency_allowed(sp, {name: sorted(ts) for name, ts in where.items()
                                  if pin_state or name.split("[")[0] not in state})


def residency_allowed(sp, residency: dict[str, list[int]]) -> np.ndarray:
    """[K, D]: kernel i may run on target d when d holds every resident item (by name) that i reads; a
    kernel whose items are spread over targets with none holding them all may run anywhere."""
    mem = sp.problem.memory
    allowed = np.ones(sp.problem.times.shape, dtype=bool)
    for k, w in mem.reads:
        where = residency.get(mem.item_names[w])
        if where is not None:
            row = np.zeros(allowed.shape[1], dtype=bool)
            row[where] = True
            allowed[k] &= row
    allowed[~allowed.any(axis=1)] = True
    return allowed


def attention_ffn(ctx: PlanContext, objective: str) -> DeploymentPlan:
    """Attention on one target, FFN on another, M >= 2 micro-batches (M = 1 when the batch cannot be
    split); the rest placed by the solver."""
    plans = []
    for r in ctx.replica_counts():
        rctx = _replica(ctx, r)
        targets = cluster_targets(ctx.cluster, r)
        if r > 1 and not rctx.can_hold(targets):
            continue
        classes = device_classes(*(rctx.step_problem(ph, targets, rctx.fixed_m(ph)).problem for ph in rctx.phases))
        for att, ffn in itertools.permutations(range(len(targets)), 2):
            if not canonical((att, ffn), classes):  # the same split on interchangeable devices
                continue
            # M >= 2 lets the halves ping-pong; where the batch cannot be split (one sequence, or the
            # runtime's fixed M = 1) the split still runs, its halves taking turns on one micro-batch
            ms = (rctx.micro_batch_options(rctx.main_phase, minimum=1 if objective == "latency" else 2)
                  or rctx.micro_batch_options(rctx.main_phase))
            for m in ms:
                try:  # engines that admit from memory take the split at the batch it holds
                    results = _phase_chain(rctx, targets, m, objective, blocks=(att, ffn), memory=not rctx.admits)
                except (SolverError, PlanningError):
                    continue
                plans += [rctx.assemble_admitted("attention-ffn", targets, r, chosen, objective,
                                                 reason=f"attention on {targets[att].name}, FFN on {targets[ffn].name}")
                          for chosen in results]
    if not plans:
        raise PlanningError("no attention/FFN split satisfies the memory and co-location constraints")
    return _best(plans, objective)


def _phase_loads(ctx: PlanContext, targets, chosen: Chosen) -> dict[str, np.ndarray]:
    """Each phase's seconds per request on each target (its cycle's busy time x repeats / rows)."""
    out = {}
    for ph, m, a, info in chosen:
        ev = evaluate(ctx.step_problem(ph, targets, m, info.get("expert_parts", 1)).problem, a)
        out[ph.phase] = np.array(ev.busy_s) * ph.repeats / ph.rows
    return out


def _phase_chain(ctx: PlanContext, targets, m: int, objective: str, blocks: tuple[int, int] | None = None,
                 start=None, follow: bool = True, pin_state: bool = True, rounds: int = 1,
                 expert_parts: int = 1, memory: bool = True) -> list[Chosen]:
    """Solve the main phase (at M = m), then every other phase (where the main phase keeps its weights when
    ``follow``; with ``blocks`` = (attention target, FFN target), those kernels only there); then
    ``rounds`` times re-solve each phase balanced against the others' load (``expert_parts`` > 1: expert
    GEMMs split into that many expert groups in every phase; ``memory`` False: the main phase is solved
    without memory limits, for engines that then admit what their memory holds). Every round's result."""
    main = ctx.main_phase
    e = expert_parts

    def allowed_for(ph: PhaseSpec, mm: int) -> np.ndarray | None:
        return None if blocks is None else _block_allowed(ctx.step_problem(ph, targets, mm, e), *blocks)

    def others(main_a, loads) -> dict:
        out = {}
        main_sp = ctx.step_problem(main, targets, m, e)
        for ph in ctx.phases:
            if ph is main:
                continue
            allowed = _follow_residency(ctx, ph, targets, 1, main_sp, main_a, pin_state, e) if follow else None
            extra = allowed_for(ph, 1)
            if extra is not None:
                allowed = extra if allowed is None else allowed & extra
            offsets = None
            if loads is not None:  # the rest of a request's work, in this phase's per-step seconds
                offsets = sum(v for k, v in loads.items() if k != ph.phase) * ph.rows / ph.repeats
            obj = "latency" if objective == "latency" else "throughput"
            a, inf = _solve_folded(ctx, ph, targets, 1, obj, allowed, memory=not follow, offsets=offsets,
                                   expert_parts=e, time_share=OTHER_PHASE_TIME_SHARE)
            out[ph.phase] = (ph, 1, a, inf)
        return out

    main_a, info = _solve_folded(ctx, main, targets, m, objective, allowed_for(main, m), start, memory=memory,
                                 expert_parts=e)
    chosen = {main.phase: (main, m, main_a, info), **others(main_a, None)}
    results = [[chosen[ph.phase] for ph in ctx.phases]]
    for _ in range(rounds if objective == "throughput" and len(ctx.phases) > 1 else 0):
        loads = _phase_loads(ctx, targets, results[-1])
        offsets = sum(v for k, v in loads.items() if k != main.phase) * main.rows / main.repeats / m
        main_a, info = _solve_folded(ctx, main, targets, m, objective, allowed_for(main, m), main_a,
                                     memory=memory, offsets=offsets, expert_parts=e)
        chosen = {main.phase: (main, m, main_a, info)}
        loads[main.phase] = _phase_loads(ctx, targets, [chosen[main.phase]])[main.phase]
        chosen.update(others(main_a, loads))
        results.append([chosen[ph.phase] for ph in ctx.phases])
    return results


def layer_pipeline(outer: PlanContext, objective: str) -> DeploymentPlan:
    """Contiguous layers per target in a device order; every split point and order searched exhaustively."""
    best = None
    searched: dict[tuple, tuple[list, np.ndarray]] = {}
    for r in outer.replica_counts():
        ctx = _replica(outer, r)
        main = ctx.main_phase
        targets = cluster_targets(ctx.cluster, r)
        if r > 1 and not ctx.can_hold(targets):
            continue
        ms = ctx.micro_batch_options(main) if objective == "throughput" else [1]
        for m in ms:
            sp = ctx.step_problem(main, targets, m)
            structure = graph_layers(sp.graph)
            merged = merge(sp.problem, layer_groups(structure, sp.problem.kernels))
            layers = sorted(structure.spans)
            classes = device_classes(sp.problem, *(ctx.step_problem(ph, targets).problem for ph in ctx.phases
                                                   if ph is not main))
            key = (len(layers), len(targets), tuple(classes))
            if key not in searched:  # the same candidates at every M
                candidates = list(pipelines(len(layers), len(targets), classes))
                searched[key] = candidates, layer_devices(candidates, len(layers))
            for _, a, order, cuts in best_pipelines(*searched[key], _pipeline_scorer(ctx, targets, m, merged,
                                                                                     objective)):
                layer_device = dict(zip(layers, a, strict=True))
                chosen = [(ph, m if ph is main else 1, _by_layer(ctx, ph, targets, m if ph is main else 1,
                                                                   layer_device, order),
                           {"method": "exhaustive split search", "stages": [targets[o].name for o in order],
                            "split_after_layer": [layers[c - 1] for c in cuts]}) for ph in ctx.phases]
                plan = ctx.assemble_admitted("layer-pipeline", targets, r, chosen, objective,
                                             reason="layers " + _ranges(layers, cuts, [targets[o].name for o in order]))
                best = _better(best, plan, objective)
    if best is None:
        raise PlanningError("no layer split fits the devices' memory")
    return best


def _pipeline_scorer(ctx: PlanContext, targets, m: int, merged, objective: str) -> Scorer:
    """Per-layer assignment -> the main phase's seconds per request (latency: its critical path), None where
    it does not fit. Where engines admit from memory, each split admits what its memory holds: its resident
    bytes and cycle are interpolated between the batch of ``ctx`` and half of it (both traced), at the batch
    the split admits; the best splits are then assembled exactly."""
    main = ctx.main_phase
    half = round_batch(ctx.batch // 2, m)
    if not ctx.admits or objective != "throughput" or half < m or half >= ctx.batch:
        return fixed_scorer(merged.problem, main.repeats, main.rows, objective)
    small = ctx.for_batch(half)
    sp_small = small.step_problem(small.main_phase, targets, m)
    merged_small = merge(sp_small.problem, merged.groups)
    reserve = ctx.step_problem(main, targets, m).activation_reserve
    capacity = np.array([t.device_bytes for t in targets], dtype=float)
    return admitted_scorer(merged.problem, merged_small.problem, ctx.batch, half, m, main.repeats, capacity, reserve,
                           ctx.tokens_per_sequence, [t.name for t in targets], ctx.admission)


def _ranges(layers: list[int], cuts: list[int], names: list[str]) -> str:
    bounds = [0, *cuts, len(layers)]
    return ", ".join(f"{layers[bounds[i]]}-{layers[bounds[i + 1] - 1]} on {n}" for i, n in enumerate(names))


def _by_layer(ctx: PlanContext, phase: PhaseSpec, targets, m: int, layer_device: dict[int, int],
              order: tuple[int, ...]) -> tuple[int, ...]:
    """A phase's assignment from a layer -> target map: kernels outside layers go with the nearest layer
    before them (the first stage when none); phases without the main phase's layers on the first stage."""
    sp = ctx.step_problem(phase, targets, m)
    out, current = [], order[0]
    for k in sp.graph.kernels:
        if k.layer is not None and k.layer in layer_device and _same_stack(ctx, phase):
            current = layer_device[k.layer]
        out.append(current)
    return tuple(out)


def _same_stack(ctx: PlanContext, phase: PhaseSpec) -> bool:
    """Whether the phase's numbered layers are the main phase's (prefill and decode share their layers;
    an image encoder or a VAE does not)."""
    return phase is ctx.main_phase or phase.phase == "prefill"


# ---------------------------------------------------------------------------------------------------------
# Tessera

def _promising_m(ctx: PlanContext, targets, objective: str, options: list[int], keep: int = 2) -> list[int]:
    """The M values of ``options`` worth the full search: the main phase alone is solved at each and the
    ``keep`` with the shortest cycles go on (the baselines' plans, which Tessera also weighs, cover the other
    M)."""
    if len(options) <= keep:
        return options
    main = ctx.main_phase
    scored = []
    for m in options:
        try:
            a, _ = _solve_folded(ctx, main, targets, m, objective)
        except (SolverError, PlanningError):
            continue
        scored.append((evaluate(ctx.step_problem(main, targets, m).problem, a).cycle_s, m))
    return [m for _, m in sorted(scored)[:keep]]  # the most promising first


def route_mix(ctx: PlanContext, objective: str, plans: list[DeploymentPlan]) -> DeploymentPlan | None:
    """The best mix of two single-engine plans sharing the cluster (`tessera.plan.mixes`; :func:`tessera`
    adopts it only past ``MIX_MIN_GAIN``), for the steady-state throughput of engines admitting from memory
    (not a fixed batch, not runtime plans, not finite workloads arriving at once)."""
    if (objective != "throughput" or not ctx.admits or ctx.single_replica
            or any("makespan_s" in p.extra for p in plans)):
        return None  # a fixed batch is the deployment's: two engines would hold twice as many sequences
    prices = {t.name: t.price(ctx.price_scenario) for t in cluster_targets(ctx.cluster, 1)}
    candidates = [p for p in plans if p.applicable and p.feasible and "tie_with" not in p.extra]
    if applicability(ctx, "prefill-decode") is None:  # every orientation: the weaker one may fill the other's
        seen = {(p.policy, p.reason) for p in candidates}  # spare time
        candidates += [p for p in prefill_decode_plans(ctx, objective)
                       if p.feasible and (p.policy, p.reason) not in seen]
    candidates += [v for p in candidates for v in smaller_engines(ctx, p, objective)]
    requests = None if isinstance(ctx.workload, PoissonWorkload) else getattr(ctx.workload, "requests", None)
    return best_mix(candidates, ctx.outputs_per_request, prices, objective, ctx.price_scenario, requests)


def smaller_engines(ctx: PlanContext, plan: DeploymentPlan, objective: str) -> list[DeploymentPlan]:
    """A single-engine plan's placement again at smaller engines (``ROUTE_BATCH_SHARES`` of the sequences it
    admits, at least ``MIN_ROUTE_BATCH``): in a mix a route that takes a small share of the requests, or
    the spare time of a device another route keeps busy, runs at the batch its share fills (each one
    costs more per request than the full engine, and holds less state where it shares a device)."""
    if plan.replicas != 1 or plan.admission is None or "replicas" in plan.extra or "routes" in plan.extra:
        return []
    steps = [s for s in plan.steps if s.objective == objective]
    offered = {t.name: t for t in cluster_targets(ctx.cluster, 1, [plan.device] if plan.device else None)}
    if not steps or any(n not in offered for n in plan.targets):
        return []
    targets = [offered[n] for n in plan.targets]
    full, out, tried = plan.admission.max_seqs, [], set()
    for share in ROUTE_BATCH_SHARES:
        batch = round_batch(int(full * share), max(s.micro_batches for s in steps))
        if batch < MIN_ROUTE_BATCH or batch >= full or batch in tried:
            continue
        tried.add(batch)
        child = ctx.for_batch(batch)
        phases = {p.phase: p for p in child.phases}
        chosen = []
        for s in steps:
            sp = child.step_problem(phases[s.phase], targets, s.micro_batches, s.solver.get("expert_parts", 1))
            if len(s.assignment) != len(sp.graph.kernels):
                break
            chosen.append((phases[s.phase], s.micro_batches, tuple(sp.problem_assignment(s.assignment, s.expert_parts)),
                           dict(s.solver)))
        else:
            small = child.assemble(plan.policy, targets, 1, chosen, objective, plan.device, plan.reason)
            if small.feasible and small.admission is not None and small.admission.max_seqs == batch:
                small.admission = replace(small.admission, limited_by=f"a smaller engine of {batch} sequences")
                small.extra["smaller_engine_of"] = full
                out.append(small)
    return out


def _tessera_batches(outer: PlanContext, seeds: list[DeploymentPlan]):
    """(replicas, context, memory-limited solve) for every batch Tessera's search tries: each replica count
    at the most an engine may admit; where engines admit from memory that batch is solved without memory
    limits (admission then takes what the placement holds), and the batches the baselines' engines admitted
    are solved again with the placement made to hold them."""
    for r in outer.replica_counts():
        ctx = _replica(outer, r)
        yield r, ctx, not ctx.admits
        if not ctx.admits:
            continue
        tried = {ctx.batch}
        for b in seeds:
            step = b.step(ctx.main_phase.phase)
            if b.replicas == r and step is not None and step.batch not in tried:
                tried.add(step.batch)
                yield r, outer.for_batch(step.batch), True


def adopt_mix(ctx: PlanContext, best: DeploymentPlan, mix: DeploymentPlan | None) -> DeploymentPlan:
    """Tessera's plan: the route ``mix`` where it plans at least ``ctx.mix_min_gain`` above the best single-engine
    plan ``best`` (and above it at all), else ``best``, naming a better mix it declined."""
    if mix is None or mix.throughput <= best.throughput:
        return best
    if mix.throughput >= best.throughput * (1 + ctx.mix_min_gain):
        return mix
    best.extra["mix_declined"] = (f"{mix.reason} planned {mix.throughput / best.throughput - 1:+.1%}, below the "
                                  f"{ctx.mix_min_gain:.0%} a mix must gain over one engine (--mix-min-gain)")
    return best


def _incumbent(ctx: PlanContext, objective: str, baselines: list[DeploymentPlan]) -> float | None:
    """The throughput Tessera's plan reaches at least, from the baselines it weighs (those it may tie with):
    a candidate whose ceiling is below it cannot change the plan (None: no such baseline, or the latency
    objective, where nothing is skipped)."""
    if objective != "throughput":
        return None
    usable = [b.throughput for b in baselines if b.applicable and b.feasible
              and not (b.policy == "request-dist" and ctx.single_replica)]
    return max(usable, default=None)


def _hopeless(outer: PlanContext, r: int, targets: list[Target], parts: tuple[int, ...], incumbent: float | None,
              m: int) -> bool:
    """Whether no plan of ``r`` replicas over ``targets`` at M = ``m`` (with any of these expert splits) can
    beat a feasible plan of ``incumbent`` throughput (`tessera.plan.ceiling`)."""
    if incumbent is None:
        return False
    widest = _replica(outer, r)  # engines at the most they may admit
    return all(cannot_beat(throughput_ceiling(widest, targets, r, m, p), incumbent) for p in parts)


def tessera(ctx: PlanContext, objective: str, baselines: list[DeploymentPlan] | None = None) -> DeploymentPlan:
    """Kernel placement over folded layers, replicas and M; never worse than the baselines it contains."""
    best = None
    outer = ctx
    seeds = [b for b in (baselines or []) if b.applicable and b.feasible and b.policy != "request-dist"]
    incumbent = _incumbent(outer, objective, baselines or [])
    variant_parts = (1, EXPERT_PARTS) if ctx.spec.family == "moe" and ctx.split_experts else (1,)
    began = outer.solve_seconds
    stopped = ""
    pruned = 0
    for r, ctx, memory in _tessera_batches(outer, seeds):
        main = ctx.main_phase
        targets = cluster_targets(ctx.cluster, r)
        if r > 1 and not ctx.can_hold(targets):
            ctx.say(f"tessera: {r} replicas cannot hold the model's weights and state; skipped")
            continue
        options = ctx.micro_batch_options(main) if objective == "throughput" else [1]
        hopeful = [m for m in options if not _hopeless(outer, r, targets, variant_parts, incumbent, m)]
        pruned += len(options) - len(hopeful)
        for m in _promising_m(ctx, targets, objective, hopeful):
            start = None
            for b in seeds:
                step = b.step(main.phase, objective) or b.step(main.phase)
                if b.replicas == r and step is not None and step.micro_batches == m and len(b.targets) == len(targets):
                    start = tuple(step.assignment)
                    break
            variants = [(True, True, 1), (False, False, 1)]
            if ctx.spec.family == "moe" and ctx.split_experts:  # experts may also be split over the targets
                variants.append((True, True, EXPERT_PARTS))
            for follow, pin_state, parts in variants:
                if _hopeless(outer, r, targets, (parts,), incumbent, m):
                    pruned += 1
                    continue
                if best is not None and outer.solve_seconds - began > outer.search_time_s:
                    stopped = (f"the search stopped at its {outer.search_time_s:g} s solver budget before replicas {r}, "
                               f"M={m}")
                    break
                try:
                    results = _phase_chain(ctx, targets, m, objective, None, start if parts == 1 else None,
                                           follow, pin_state, expert_parts=parts, memory=memory)
                except (SolverError, PlanningError) as e:
                    ctx.say(f"tessera: replicas {r}, M={m}: {e}")
                    continue
                for chosen in results:
                    plan = ctx.assemble_admitted("tessera", targets, r, chosen, objective)
                    best = _better(best, plan, objective)
                    if incumbent is not None and plan.feasible:
                        incumbent = max(incumbent, plan.throughput)
            ctx.say(f"tessera: replicas {r}, M={m}: best so far {best.throughput:,.1f} {ctx.unit}"
                    f"{'' if best.feasible else ' (does not fit memory)'}" if best else
                    f"tessera: replicas {r}, M={m}: no plan")
    ctx = outer
    if pruned:
        ctx.say(f"tessera: {pruned} candidates (replicas and M, or a variant of them) skipped: no plan of theirs "
                "can beat a feasible plan in hand (tessera.plan.ceiling)")
    if stopped:
        ctx.say(f"tessera: {stopped}")
    for b in baselines or []:
        if not (b.applicable and b.feasible):
            continue
        if b.policy == "request-dist" and ctx.single_replica:  # a runtime plan is one copy of the model over
            continue  # the workers; request-dist runs only as itself (its replicas, each with its own rows)
        if _better(best, b, objective) is b and b is not best:
            tie = DeploymentPlan(**{**b.__dict__, "policy": "tessera", "steps": b.steps, "extra": dict(b.extra)})
            tie.reason = f"ties {b.policy}" + (f" ({b.device})" if b.device else "") + ": kernel placement found " \
                         "nothing better than that baseline, which is in its search space" + \
                         (f"; {b.reason}" if b.reason else "")
            tie.extra["tie_with"] = b.policy
            best = tie
    if best is None:
        raise PlanningError("Tessera found no plan that fits the devices' memory")
    best = adopt_mix(ctx, best, route_mix(ctx, objective, [*(baselines or []), best]))
    if stopped:
        best.extra["search"] = stopped
    return best
