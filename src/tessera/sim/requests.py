"""Request level of the cluster simulator: arrivals, admission, continuous batching and state slots,
decided by the same :class:`~tessera.sched.scheduler.Scheduler` the serving engine uses, with every step
timed at the kernel level (:class:`~tessera.sim.step_timer.StepTimer`).

A deployment runs as replicas (engines). Each engine has its own scheduler and lanes. The scheduler
admits as the plan's engine admission says (``EngineAdmission``: at most ``max_seqs`` sequences, and,
for a cache that grows with the context, while its ``kv_tokens`` in blocks of ``block_size`` last,
preempting by recompute when they run out); a plan without one (an old plan file) admits up to its step
plan's batch. On lanes, phases whose step plans use disjoint targets run concurrently (prefill-decode
disaggregation); phases sharing a target take turns. A step occupies its lane for the step's time at its
bucket: alone (``first_s``) after a pause or a change of bucket, or the streamed period when the same
bucket runs again back to back. An explicit state move between phases (KV after a prefill on another
device) holds the request back by the move's time. At static buckets an LLM's prompts are batched into prefill steps
as `tessera serve` batches them (up to every slot and the longest prompt bucket's tokens a step). Arrivals go to the engine with the least outstanding
work for its speed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tessera.errors import TesseraError
from tessera.hardware.cluster import Link
from tessera.plan.context import PlanContext
from tessera.plan.deployment import DeploymentPlan, EngineAdmission, StateMove, StepPlan
from tessera.plan.deployment import lanes as plan_lanes
from tessera.plan.engines import EnginePart, engine_parts
from tessera.plan.targets import Target, cluster_targets, link_between
from tessera.sched.monitor import Monitor
from tessera.sched.scheduler import (
    DEFAULT_MAX_CONTEXT,
    Buckets,
    KVBudget,
    Request,
    ScheduledStep,
    Scheduler,
    stages_for,
)
from tessera.sim.contention import HostSharing
from tessera.sim.objectives import EngineMode, Switching, close_window, hold_back, use_mode
from tessera.sim.step_timer import StepTimer
from tessera.workload import ImagesWorkload, Workload, draw_requests


class SimulationSetupError(TesseraError):
    """A plan the simulator cannot run (not applicable, does not fit, unknown targets)."""


@dataclass
class Lane:
    """Phases that share targets, so their steps take turns."""

    phases: set[str]
    devices: frozenset[str] = frozenset()  # cluster targets it shares with other engines' lanes (route mixes)
    timer: StepTimer | None = None  # its own step plans' timer (one engine of two routes), else the engine's
    delays: dict[str, float] | None = None  # the state moves after its steps, else the engine's
    workers: frozenset[int] = frozenset()  # its engine's targets its steps use (an objective switch's lanes wait)
    share: float | None = None  # planned share of its time on prompt steps (a lane that also decodes)
    prompts: int = 0  # requests it admitted (their prompt steps run on it)
    prompt_s: float = 0.0  # its time on prompt steps
    busy_until: float = 0.0
    step: ScheduledStep | None = None
    start_s: float = 0.0
    last_bucket: tuple | None = None
    busy_s: float = 0.0


@dataclass
class Engine:
    """One replica: its scheduler, step timer, lanes and delays between phases (state moves)."""

    name: str
    scheduler: Scheduler
    timer: StepTimer
    lanes: list[Lane]
    speed: float
    delays: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    engine_shapes: bool = False  # steps at their own shapes, timed between grid shapes (no padding)
    min_prompt: int = 1
    max_rows: int | None = None  # requests in flight under the current objective (None: every slot)
    switching: Switching | None = None  # the monitor's objectives, where the engine switches between them

    def all_lanes(self) -> list[Lane]:
        """Its lanes, and the previous objective's lanes still running a step."""
        return self.lanes + (self.switching.retired if self.switching is not None else [])


def arrivals(workload: Workload, seed: int = 0) -> list[Request]:
    """The workload's requests with arrival times and lengths (deterministic for a seed)."""
    return [Request(i, t, a, b) for i, (t, a, b) in enumerate(draw_requests(workload, seed))]


def _match_targets(ctx: PlanContext, names: list[str], replicas: int, types: list[str] | None) -> list[Target]:
    offered = {t.name: t for t in cluster_targets(ctx.cluster, replicas, types)}
    missing = [n for n in names if n not in offered]
    if missing:
        raise SimulationSetupError(f"the plan's targets {', '.join(missing)} are not in cluster "
                                   f"{ctx.cluster.describe()} (it offers {', '.join(offered)}); plan for this cluster")
    return [offered[n] for n in names]


def _lanes(steps: list[StepPlan], shared: list[Target] | None = None) -> list[Lane]:
    """The engine's lanes (the plan's :func:`~tessera.plan.deployment.lanes`: phases sharing a target take
    turns); ``shared``: the engine's targets, which other engines' lanes also use: a lane then waits while
    another engine's lane on one of its devices runs a step."""
    out = []
    for lane in plan_lanes(steps):
        used = set().union(*(s.used_targets for s in lane))
        out.append(Lane({s.phase for s in lane}, frozenset(shared[t].name for t in used) if shared else frozenset(),
                        workers=frozenset(used)))
    return out


def _delays(moves: list[StateMove], steps: list[StepPlan]) -> dict[str, float]:
    """Per phase, the state moves a request waits for before its first step of that phase."""
    out: dict[str, float] = {}
    for s in steps:
        used = set(s.assignment)
        out[s.phase] = sum(mv.seconds_per_request for mv in moves if mv.dst in used and mv.src not in used)
    return out


def _timer(ctx: PlanContext, steps: list[StepPlan], targets: list[Target], feedback_s: float,
           link: Link | None) -> StepTimer:
    """The step timer of these step plans on these targets, shared by every simulation in ``ctx`` (a rate
    sweep times each bucket once)."""
    timers = ctx.cache.step_timers
    key = (tuple(t.members for t in targets), feedback_s, link,
           tuple((s.phase, s.graph_hash, s.micro_batches, tuple(s.assignment), str(sorted(s.expert_parts.items())))
                 for s in steps))
    if key not in timers:
        timers[key] = StepTimer(ctx, steps, targets, feedback_s, link)
    return timers[key]


def engines_for(ctx: PlanContext, plan: DeploymentPlan, objective: str = "throughput",
                max_context: int | None = DEFAULT_MAX_CONTEXT, feedback_s: float = 0.0, min_prompt: int = 128,
                link: Link | None = None, engine_shapes: bool = False,
                monitor: Monitor | Sequence[Monitor] | None = None, latency_rows: int | None = None) -> list[Engine]:
    """The replicas that serve ``plan``, each with its scheduler (prompt buckets from ``min_prompt`` tokens)
    and step timer (``link``: every pair of targets talks over this link instead of the cluster's).
    ``engine_shapes``: steps run at their own rows, prompt and context (16-token granules), as a serving
    engine runs them, instead of padded to the static power-of-two buckets Tessera's own server uses.
    ``monitor``: each engine switches between the plan's throughput and latency step plans as this monitor's
    settings say (a copy each, starting at its objective; `tessera.sim.objectives`), the latency plans holding
    at most ``latency_rows`` requests; one monitor per engine, in the plan's order, starts each engine on its own
    monitor's objective (replicas a served deployment left on different objectives); without it every engine runs
    ``objective``'s step plans.

    Raises:
        SimulationSetupError: the plan does not apply or fit; monitors given for routes that are one engine, or
            not one per engine."""
    if not plan.applicable:
        raise SimulationSetupError(f"{plan.policy} does not apply to {plan.model}: {plan.reason}")
    if not plan.feasible:
        raise SimulationSetupError(f"the {plan.policy} plan is not feasible: {plan.reason}")
    parts = engine_parts(plan, objective)
    if any(p.one_engine for p in parts):  # routes that are one engine
        if monitor is not None:
            raise SimulationSetupError("the simulator switches objectives per engine; routes that are one engine "
                                       "run one objective's step plans: simulate without the monitor")
        return [_one_engine(ctx, plan, objective, parts, max_context, feedback_s, min_prompt, link, engine_shapes)]
    shared = any(p.kind == "route" for p in parts)  # a route mix: engines of their own placements sharing devices
    min_prompt = _min_prompt(ctx, min_prompt)
    engines = []
    count = sum(p.replicas for p in parts)
    monitors = [monitor] * count if monitor is None or isinstance(monitor, Monitor) else list(monitor)
    if len(monitors) != count:
        raise SimulationSetupError(f"{len(monitors)} monitors for the {count} engines of the {plan.policy} plan: give "
                                   "one, or one per engine")
    for part in parts:
        name = part.device if part.kind == "replica" else part.name if part.kind == "route" else plan.policy
        types = None if part.kind == "route" or part.device is None else [part.device]
        targets = _match_targets(ctx, part.targets, part.replicas, types)
        if not part.steps:
            raise SimulationSetupError(f"the {plan.policy} plan has no {objective} step plans")
        timer = _timer(ctx, part.steps, targets, feedback_s, link)
        main = max(part.steps, key=lambda s: s.repeats)
        slots, kv = _admission(plan, name, part.admission, ctx.spec.family, main.batch)
        for r in range(part.replicas):
            engine = Engine(f"{name}#{r}" if part.replicas > 1 else name,
                            _scheduler(ctx, slots, kv, max_context, min_prompt, engine_shapes), timer,
                            _lanes(part.steps, targets if shared else None), part.throughput / part.replicas,
                            _delays(part.state_moves, part.steps), engine_shapes=engine_shapes,
                            min_prompt=min_prompt)
            mine = monitors[len(engines)]
            if mine is not None:
                engine.switching = _switching(ctx, plan, part, targets if shared else None, targets, mine,
                                              slots, latency_rows, feedback_s, link)
                use_mode(engine, engine.switching.mode)
            engines.append(engine)
    return engines


def _switching(ctx: PlanContext, plan: DeploymentPlan, part: EnginePart, shared: list[Target] | None,
               targets: list[Target], monitor: Monitor, slots: int, latency_rows: int | None, feedback_s: float,
               link: Link | None) -> Switching:
    """An engine's two objectives (`tessera.sim.objectives`): each objective's step plans for ``part`` (the
    throughput ones where the plan has none for latency, as for request-dist's replicas, whose serving engines
    switch only the rows they hold), and a fresh copy of ``monitor``."""
    modes = {}
    for objective in ("throughput", "latency"):
        mine = next((p for p in engine_parts(plan, objective) if p.index == part.index and p.kind == part.kind), None)
        steps = mine.steps if mine is not None and mine.steps else part.steps
        rows = slots if objective == "throughput" else min(slots, latency_rows or slots)
        main = max(steps, key=lambda s: s.repeats)
        modes[objective] = EngineMode(_timer(ctx, steps, targets, feedback_s, link), _lanes(steps, shared),
                                      _delays(part.state_moves, steps), rows, frozenset(main.used_targets))
    return Switching(monitor.fresh(), modes, _state_move_s(ctx, part, targets, link))


def _state_move_s(ctx: PlanContext, part: EnginePart, targets: list[Target], link: Link | None) -> float:
    """One request's state moved between two targets: the plan's state moves of a request where it has them,
    else its share of the repeated phase's state over the link between the first two targets."""
    if part.state_moves:
        return sum(mv.seconds_per_request for mv in part.state_moves)
    if len(targets) < 2:
        return 0.0
    main = ctx.main_phase
    graph = ctx.graph(main)
    per_request = sum(graph.buffers[n].nbytes for n in graph.state) / max(main.batch, 1)
    return (link or link_between(ctx.cluster, targets[0], targets[1])).transfer_time(int(per_request))


def _min_prompt(ctx: PlanContext, min_prompt: int) -> int:
    """The shortest prompt bucket: a VLM's prompt holds its image's tokens, so no bucket may be shorter."""
    if ctx.spec.family != "vlm":
        return min_prompt
    meta = ctx.graph(next(p for p in ctx.phases if p.phase == "prefill")).meta
    return max(min_prompt, int(meta["image_start"]) + int(meta["image_tokens"]))


def _scheduler(ctx: PlanContext, slots: int, kv: KVBudget | None, max_context: int | None, min_prompt: int,
               engine_shapes: bool) -> Scheduler:
    """One engine's scheduler: its family's stages, its admission and its shape buckets."""
    family = ctx.spec.family
    context = None if family == "diffusion" else max_context
    buckets = (Buckets.fine(slots, context, min_seq=min_prompt) if engine_shapes and context else
               Buckets(tuple(range(1, slots + 1))) if engine_shapes else
               Buckets.default(slots, context, min_prompt))
    if family == "ssm":  # an SSM's state does not grow with the context: one decode shape
        buckets = Buckets(buckets.batch, buckets.seq)
    denoise = ctx.workload.steps if isinstance(ctx.workload, ImagesWorkload) else 28
    # Tessera's server batches prompts (`tessera.serve.engine.serving_scheduler`): every slot, at most the
    # longest prompt bucket's tokens a prefill step; a KV cache only (padding after an SSM's prompt would
    # enter its state), and not at engine shapes, whose prompt steps stay one request each
    batched = family in ("llm", "moe") and not engine_shapes and context is not None
    return Scheduler(stages_for(family, denoise), slots, buckets, context, kv=kv,
                     prompt_rows=slots if batched else 1, prompt_tokens=buckets.seq[-1] if batched else None)


def _one_engine(ctx: PlanContext, plan: DeploymentPlan, objective: str, routes: list[EnginePart],
                max_context: int | None, feedback_s: float, min_prompt: int, link: Link | None,
                engine_shapes: bool) -> Engine:
    """Routes that are one engine (`tessera.plan.mixes.one_engine`): one scheduler (the tighter of the
    routes' admissions), and per device one lane running the phases any route places there, each with its
    route's step timer and state moves. A lane that runs the repeated phase and prompts too admits new
    requests while its time on prompt steps is within its planned share of the time so far (its routes'
    rates x their prompt cycles there), so it fills the share of its device the plan gave prompts even when
    the prompt-only lanes run slower than planned; the prompt-only lanes go first and admit the rest."""
    min_prompt = _min_prompt(ctx, min_prompt)
    lanes: dict[frozenset[int], Lane] = {}
    shares: dict[frozenset[int], float] = {}
    batched = next(st.phase for st in stages_for(ctx.spec.family) if st.batched)
    admissions = []
    for k, route in enumerate(routes):
        steps = route.steps
        if not steps:
            raise SimulationSetupError(f"the {plan.policy} plan has no {objective} step plans for route {k}")
        targets = _match_targets(ctx, route.targets, 1, None)
        timer = _timer(ctx, steps, targets, feedback_s, link)
        delays = _delays(route.state_moves, steps)
        admissions.append(route.admission)
        for lane in plan_lanes(steps):
            used = frozenset(plan.targets.index(targets[t].name) for s in lane for t in s.used_targets)
            phases = {s.phase for s in lane}
            known = lanes.get(used)
            if known is None or len(phases) > len(known.phases):  # the lane running the most phases times them
                lanes[used] = Lane(phases | (known.phases if known else set()), timer=timer, delays=delays)
            else:
                known.phases |= phases
            shares[used] = shares.get(used, 0.0) + float(route.rate or 0.0) * sum(
                s.per_request * s.cycle_s for s in lane if s.phase != batched)
    if any(a & b for a, b in itertools.combinations(lanes, 2)):
        raise SimulationSetupError(f"the {plan.policy} plan's routes share devices in different ways; one engine "
                                   "runs each device's phases on one lane (plan again)")
    main = max((s for s in plan.steps if s.objective == objective), key=lambda s: s.repeats)
    admitted = [a for a in admissions if a is not None]
    admission = min(admitted, key=lambda a: (a.max_seqs, a.kv_tokens or 0)) if admitted else None
    slots, kv = _admission(plan, "tessera", admission, ctx.spec.family, main.batch)
    for used, ln in lanes.items():
        if batched in ln.phases and len(ln.phases) > 1:
            ln.share = shares.get(used, 0.0)
    ordered = sorted(lanes.values(), key=lambda ln: batched in ln.phases)  # prompt lanes first
    first = ordered[0]
    return Engine(plan.policy, _scheduler(ctx, slots, kv, max_context, min_prompt, engine_shapes),
                  first.timer, ordered, 1.0, first.delays or {}, engine_shapes=engine_shapes, min_prompt=min_prompt)


def _admission(plan: DeploymentPlan, name: str, admission: EngineAdmission | None, family: str,
               batch: int) -> tuple[int, KVBudget | None]:
    """An engine's slots (sequences in flight) and KV budget from its admission (none: its step plan's batch)."""
    if admission is None:
        return batch, None
    if admission.max_seqs < 1:
        raise SimulationSetupError(f"the {plan.policy} plan's engine {name} admits {admission.max_seqs} sequences; "
                                   "it needs at least 1 (plan again)")
    if admission.kv_tokens is None or family in ("ssm", "diffusion"):  # a state that does not grow
        return admission.max_seqs, None
    if admission.kv_blocks is None or admission.kv_blocks < 1:
        raise SimulationSetupError(f"the {plan.policy} plan's engine {name} has room for {admission.kv_tokens} KV "
                                   f"tokens, less than one block of {admission.block_size}: it cannot serve a "
                                   "request (give it more memory or plan again)")
    return admission.max_seqs, KVBudget(admission.kv_blocks, admission.block_size)


@dataclass
class SimResult:
    """What a simulated run achieved, and every request's times."""

    model: str
    policy: str
    workload: str
    unit: str
    throughput: float
    makespan_s: float
    completed: int
    rejected: int
    ttft_s: list[float]
    tpot_s: list[float]
    latency_s: list[float]  # end to end per request
    norm_latency_s: float  # mean of end-to-end latency / outputs
    steps: int
    lane_busy_s: dict[str, float]
    rejections: list[str] = field(default_factory=list)
    preemptions: int = 0  # requests preempted (by recompute) for lack of KV blocks, counted per preemption
    switches: int = 0  # the engines' monitors' switches between objectives

    @staticmethod
    def _pct(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None

    def summary(self) -> dict[str, Any]:
        """The JSON of ``tessera simulate --json``."""
        return {"model": self.model, "policy": self.policy, "workload": self.workload, "unit": self.unit,
                "throughput": self.throughput, "makespan_s": self.makespan_s,
                "ttft_p50_s": self._pct(self.ttft_s, 50), "ttft_p99_s": self._pct(self.ttft_s, 99),
                "tpot_p50_s": self._pct(self.tpot_s, 50), "tpot_p99_s": self._pct(self.tpot_s, 99),
                "latency_p50_s": self._pct(self.latency_s, 50), "norm_latency_s": self.norm_latency_s,
                "completed": self.completed, "rejected": self.rejected, "steps": self.steps,
                "preemptions": self.preemptions, "switches": self.switches, "lane_busy_s": self.lane_busy_s,
                "rejections": self.rejections[:5]}


def _route(engines: list[Engine], req: Request) -> Engine:
    return min(engines, key=lambda e: ((e.scheduler.pending() + 1) / max(e.speed, 1e-12), e.name))


def _prompts_only(engine: Engine, lane: Lane) -> bool:
    """Whether the lane runs only single-request stages (prefill, encode): in a route mix it feeds another
    device's batched stage, so it takes a shared device first."""
    return not any(s.batched for s in engine.scheduler.stages if s.phase in lane.phases)


def _furthest(step: ScheduledStep) -> int | None:
    """The furthest cache position a decode step's rows read (its longest context's newest token), which a CPU's
    decode attention's time follows (`tessera.sim.step_timer`); None for other steps."""
    if step.phase != "decode" or step.ctx is None or not step.requests:
        return None
    return max(r.context for r in step.requests) - 1


def _duration(engine: Engine, lane: Lane, step: ScheduledStep, now: float) -> float:
    timer = lane.timer or engine.timer
    if engine.engine_shapes:  # the same phase and rows stream on even as the context grows
        t = timer.interpolated(step.phase, step.rows, step.seq, step.ctx, engine.min_prompt)
        streaming = lane.last_bucket is not None and lane.last_bucket[:2] == step.bucket[:2]
    else:
        t = timer.time(step.phase, step.rows, step.seq, step.ctx, _furthest(step))
        streaming = lane.last_bucket == step.bucket
    return t.period_s if streaming and lane.busy_until >= now else t.first_s


def run_requests(engines: list[Engine], requests: list[Request], progress=None) -> list[Request]:
    """Serve ``requests`` on ``engines`` to the end; returns them with their times filled in."""
    pending = sorted(requests, key=lambda r: (r.arrival_s, str(r.id)))
    nxt = 0
    now = 0.0
    total = len(pending)
    reported = 0
    mixed = any(lane.devices for e in engines for lane in e.lanes)
    sharing = HostSharing.for_engines(engines)  # steps beside each other on the host's CPU slow each other
    while True:
        # finish steps that end now
        for e in engines:
            for lane in e.all_lanes():
                if lane.step is not None and lane.busy_until <= now:
                    e.scheduler.complete(lane.step, lane.start_s, lane.busy_until,
                                         e.delays if lane.delays is None else lane.delays)
                    if e.switching is not None:
                        hold_back(e, lane.step.requests)
                    lane.step = None
            if e.switching is not None:
                e.switching.retired = [ln for ln in e.switching.retired if ln.step is not None]
        while nxt < total and pending[nxt].arrival_s <= now:
            _route(engines, pending[nxt]).scheduler.submit(pending[nxt])
            nxt += 1
        for e in engines:
            if e.switching is not None:
                close_window(e, now)
        order = [(e, lane) for e in engines for lane in e.lanes]
        if mixed:  # on a shared device prompt lanes (feeding another device's batch) go first, then the lane
            order.sort(key=lambda el: (not _prompts_only(*el), el[1].start_s))  # that waited longest
        for e, lane in order:
            if lane.step is not None:
                continue
            if lane.devices and any(other.step is not None and other.devices & lane.devices
                                    for f in engines for other in f.lanes):
                continue  # another engine's step holds one of its devices: steps take turns
            if e.switching is not None and any(old.workers & lane.workers for old in e.switching.retired):
                continue  # the previous objective's step holds one of its targets: it finishes first
            admit = lane.share is None or lane.prompt_s <= lane.share * now
            step = e.scheduler.next_step(now, lane.phases, max_rows=e.max_rows, admit=admit, owner=lane)
            if step is None:
                continue
            dur = _duration(e, lane, step, now)
            if not any(st.batched and st.phase == step.phase for st in e.scheduler.stages):  # a prompt step
                lane.prompt_s += dur
                if step.phase == e.scheduler.stages[0].phase:  # its first stage: admissions
                    lane.prompts += len(step.requests)
            lane.step, lane.start_s, lane.busy_until, lane.last_bucket = step, now, now + dur, step.bucket
            lane.busy_s += dur
            e.steps += 1
        if sharing is not None:
            sharing.update(engines, now)
        candidates = [lane.busy_until for e in engines for lane in e.all_lanes() if lane.step is not None]
        if nxt < total:
            candidates.append(pending[nxt].arrival_s)
        candidates += [r.ready_s for e in engines for r in e.scheduler.running if r.ready_s > now]
        if not candidates:
            break
        # a monitor's window ends while requests wait or run, or finished ones are still to be shown to it (a
        # serving engine closes its windows idle too; the empty ones change nothing)
        candidates += [w for e in engines if e.switching is not None and e.switching.watching(e.scheduler)
                       for w in [e.switching.monitor.window_end_s()] if w is not None and w > now]
        now = max(now, min(candidates))
        done = sum(len(e.scheduler.done) + len(e.scheduler.rejected) for e in engines)
        if progress is not None and done >= reported + max(1, total // 20):
            reported = done
            progress(done, total)
    stuck = [r for e in engines for r in [*e.scheduler.waiting, *e.scheduler.running]]
    if stuck:
        raise SimulationSetupError(f"{len(stuck)} requests never finished (first: {stuck[0].id}); the deployment "
                                   "cannot serve them")
    return requests


def simulate(ctx: PlanContext, plan: DeploymentPlan, seed: int = 0, objective: str = "throughput",
             max_context: int | None = DEFAULT_MAX_CONTEXT, feedback_s: float = 0.0, progress=None,
             workload: Workload | None = None, min_prompt: int = 128, link: Link | None = None,
             draws: list[tuple[float, int, int]] | None = None, engine_shapes: bool = False,
             monitor: Monitor | Sequence[Monitor] | None = None, latency_rows: int | None = None) -> SimResult:
    """Serve ``workload`` (default: ``ctx``'s; or explicit ``draws`` of (arrival, input, output)) with ``plan``:
    every arrival completes or is rejected. ``progress(done, total)`` is called as requests finish.
    ``engine_shapes``: steps at their own shapes as a serving engine runs them; ``monitor``, ``latency_rows``:
    engines that switch objectives as `tessera serve`'s do (see `engines_for`)."""
    engines = engines_for(ctx, plan, objective, max_context, feedback_s, min_prompt, link, engine_shapes, monitor,
                          latency_rows)
    requests = ([Request(i, t, a, b) for i, (t, a, b) in enumerate(draws)] if draws is not None
                else arrivals(workload or ctx.workload, seed))
    requests = run_requests(engines, requests, progress)
    served = [r for r in requests if r.rejected is None]
    rejected = [r for r in requests if r.rejected is not None]
    start = min((r.arrival_s for r in requests), default=0.0)
    end = max((r.finish_s for r in served), default=start)
    makespan = end - start
    outputs = sum(r.generated if ctx.unit == "tokens/s" else 1 for r in served)
    tpot = [(r.finish_s - r.first_output_s) / (r.output - 1) for r in served if r.output > 1]
    lanes: dict[str, float] = {}
    for e in engines:  # a switching engine's lanes of both objectives, summed where they run the same phases
        modes = e.switching.modes.values() if e.switching is not None else ()
        every = list({id(ln): ln for ln in [*e.lanes, *(ln for m in modes for ln in m.lanes if ln.busy_s > 0)]
                      }.values())
        for lane in every:
            key = f"{e.name}:{'+'.join(sorted(lane.phases))}"
            lanes[key] = lanes.get(key, 0.0) + lane.busy_s
    return SimResult(plan.model, plan.policy, plan.workload, ctx.unit, outputs / makespan if makespan > 0 else 0.0,
                     makespan, len(served), len(rejected), [r.first_output_s - r.arrival_s for r in served], tpot,
                     [r.finish_s - r.arrival_s for r in served],
                     float(np.mean([(r.finish_s - r.arrival_s) / r.output for r in served])) if served else 0.0,
                     sum(e.steps for e in engines), lanes, [f"request {r.id}: {r.rejected}" for r in rejected],
                     sum(e.scheduler.preemptions for e in engines),
                     sum(e.switching.switches for e in engines if e.switching is not None))
