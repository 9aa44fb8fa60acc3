"""What one planning run works from: the model's phases for a workload, how its engines size their batch
(`BatchMode`), their traced graphs and step problems (memoised in one `PlanCache` per run), and how a set of
per-phase assignments becomes a DeploymentPlan (exact re-evaluation, memory on the union of phases, state
moves, the per-request throughput model of :mod:`tessera.plan.deployment`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property
from typing import Any

import numpy as np

from tessera.capture.models import resolve_model
from tessera.capture.trace_facts import graph_layers
from tessera.cost.features import is_kv_buffer
from tessera.cost.options import CostOptions
from tessera.cost.profile import Profile
from tessera.errors import TesseraError
from tessera.graph.ir import KernelGraph
from tessera.graph.layers import LayerStructureError
from tessera.hardware.cluster import Cluster, parse_cluster
from tessera.plan.admission import MemoryShape, admit
from tessera.plan.build import (
    GraphFacts,
    StepProblem,
    build_step_problem,
    cached_target_times,
    target_key,
    transfer_assignment,
)
from tessera.plan.config import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BATCH_LLM,
    DEFAULT_MIX_MIN_GAIN,
    AdmissionConfig,
    PlanConfig,
)
from tessera.plan.deployment import DeploymentPlan, StateMove, StepPlan, busiest_lane
from tessera.plan.fold import Merged, fold_groups, merge
from tessera.plan.problem import MICRO_BATCHES
from tessera.plan.step_evaluation import evaluate
from tessera.plan.targets import Target, link_between
from tessera.workload import (
    DEFAULT_IMAGE_WORKLOAD,
    DEFAULT_TEXT_WORKLOAD,
    FixedWorkload,
    ImagesWorkload,
    OfflineWorkload,
    PoissonWorkload,
    Workload,
    parse_workload,
)

Chosen = list[tuple["PhaseSpec", int, tuple[int, ...], dict]]  # per phase: (phase, M, assignment, solver info)
PROMPT_BINS = 4  # representative prompt lengths a prompt phase is costed at (equal shares of the requests)


class PlanningError(TesseraError):
    """A workload that does not fit the model, or a planning request that cannot be met."""


class BatchMode(Enum):
    """How the engines of a deployment size their batch; one per planning run (`PlanContext.mode`)."""

    ADMIT = "admit"  # each engine admits the sequences its memory holds, as vLLM does (text models by default)
    OWN = "own"  # each engine keeps its own fixed batch in flight (diffusion's default images)
    SHARED = "shared"  # one fixed batch for the deployment, divided between its replicas (--max-batch, runtime)


def batch_mode(family: str, max_batch: int | None, runtime: bool) -> BatchMode:
    """The batch mode of a planning run: diffusion without a fixed ``--max-batch`` keeps every engine's own
    images in flight; a fixed batch or a runtime plan (one copy of the model over the workers, at the
    runtime's shapes) shares one batch; everything else admits from memory."""
    if family == "diffusion" and max_batch is None:
        return BatchMode.OWN
    return BatchMode.SHARED if max_batch is not None or runtime else BatchMode.ADMIT


def prompt_length(workload: Workload) -> int:
    """The one prompt length a text workload's phases are traced at: the fixed length, the mean of an
    ``offline:`` distribution (prefill work and cache grow with it), or the median of Poisson arrivals."""
    if isinstance(workload, FixedWorkload):
        return workload.input
    if isinstance(workload, OfflineWorkload):
        return max(1, round(workload.mean_input))
    assert isinstance(workload, PoissonWorkload)
    return max(1, round(workload.lengths.median[0]))


def representative_prompts(workload: Workload, bins: int = 4) -> list[int]:
    """The prompt lengths an ``offline:`` workload's prompt phase is costed at: the means of ``bins``
    equal-count bins of its prompts (each standing for that share of the requests); empty for other
    workloads, whose phases are traced at :func:`prompt_length` alone."""
    if not isinstance(workload, OfflineWorkload):
        return []
    lengths = np.sort(np.asarray(workload.lengths.inputs, dtype=float))
    return [max(1, round(float(b.mean()))) for b in np.array_split(lengths, bins) if len(b)]


@dataclass
class PlanCache:
    """What one planning run memoises, shared by its context and every context split from it
    (`PlanContext.for_batch`): everything derived from the run's cluster, options and solver settings. (Traced
    graphs depend only on their step shape: they live in `PlanContext.graphs`, which contexts of one model may
    share.)"""

    facts: dict[tuple, GraphFacts] = field(default_factory=dict)  # by graph key: edges, features, co-location
    times: dict[tuple, dict[tuple, np.ndarray]] = field(default_factory=dict)  # graph key -> target key -> [K] s
    problems: dict[tuple, StepProblem] = field(default_factory=dict)  # by (phase, M, targets, expert parts)
    folded: dict[tuple, Merged] = field(default_factory=dict)  # the same keys, folded
    solved: dict[tuple, tuple[tuple[int, ...], dict]] = field(default_factory=dict)  # folded solves' answers
    over_prompts: dict[tuple, tuple] = field(default_factory=dict)  # prompt phases costed over prompt lengths
    bounds: dict[int, Any] = field(default_factory=dict)  # the case's ThroughputBound by batch (plan.bound)
    step_timers: dict[tuple, Any] = field(default_factory=dict)  # the simulator's step timers by engine
    cycle_floors: dict[tuple, float] = field(default_factory=dict)  # main steps' least cycles (plan.ceiling)


@dataclass(frozen=True)
class PhaseSpec:
    """One phase of serving a request: its step shape and how often a request needs it."""

    phase: str
    batch: int  # rows per step (requests or images)
    seq: int | None
    ctx: int | None
    resolution: str | None
    repeats: float  # steps per request
    micro_batched: bool  # may run as M > 1 micro-batches
    state_scale: float = 1.0  # state bytes resident per traced state byte (cache capacity / traced ctx)
    slots: int | None = None  # rows of the traced state when they differ from the batch (runtime plans)

    @property
    def rows(self) -> int:
        return self.batch


def workload_phases(family: str, workload: Workload, max_batch: int | None) -> tuple[list[PhaseSpec], float, str]:
    """The phases a request goes through, the outputs per request and their unit."""
    if family == "diffusion":
        if not isinstance(workload, ImagesWorkload):
            raise PlanningError(f"a diffusion model serves image requests; use a workload such as "
                                f"{DEFAULT_IMAGE_WORKLOAD}")
        b = max_batch or DEFAULT_MAX_BATCH["diffusion"]
        res = f"{workload.resolution[0]}x{workload.resolution[1]}"
        return ([PhaseSpec("encode", 1, None, None, None, 1.0, False),
                 PhaseSpec("step", b, None, None, res, float(workload.steps), True),
                 PhaseSpec("decode", 1, None, None, res, 1.0, False)], 1.0, "images/s")
    if isinstance(workload, ImagesWorkload):
        raise PlanningError(f"a {family} model serves text requests; use a workload such as "
                            f"{DEFAULT_TEXT_WORKLOAD} or poisson:rate=4,lengths=azure-conv")
    n_in = prompt_length(workload)
    if isinstance(workload, FixedWorkload | OfflineWorkload):
        n_out = workload.output
    else:
        n_out = max(1, round(workload.lengths.median[1]))
    b = max_batch or DEFAULT_MAX_BATCH_LLM
    if isinstance(workload, FixedWorkload | OfflineWorkload) and max_batch is None:
        b = min(b, workload.requests)
    ctx_avg = n_in + n_out // 2  # decode reads the cache at the mean context of a request's life
    phases = [PhaseSpec("prefill", 1, n_in, n_in, None, 1.0, False),
              PhaseSpec("decode", b, None, ctx_avg, None, float(n_out), True, (n_in + n_out) / ctx_avg)]
    if family == "vlm":
        phases.insert(0, PhaseSpec("encode", 1, None, None, None, 1.0, False))
    return phases, float(n_out), "tokens/s"


@dataclass
class PlanContext:
    """One planning run: model, cluster, workload and every setting of the request (the fields), its batch
    mode (`mode`, decided once from the settings) and its memo (`cache`, shared with the contexts
    `for_batch` splits off, which differ only in the batch)."""

    model: str
    cluster: Cluster
    workload: Workload
    workload_text: str
    max_batch: int | None = None
    options: CostOptions = field(default_factory=CostOptions)
    profile: Profile | None = None
    routing_skew: float = 0.0
    price_scenario: str = "relative"
    fold_chunks: int = 4
    gap: float = 0.01
    time_limit_s: float = 0.9  # per step solve: the best placement found and its proven gap by then
    search_time_s: float = 8.0  # solver seconds after which Tessera's search tries no further candidates
    progress: Any = None  # callable(str) for progress lines, or None
    cache_ctx: int | None = None  # trace every phase with this cache context (the runtime's), not the workload's
    split_experts: bool = True  # Tessera may split MoE expert GEMMs over targets (the runtime cannot run that yet)
    micro_batches: int | None = None  # the main phase's M, fixed (the runtime's): other phases share its state
    image: str | None = None  # vision-language models: the image size "WxH" (default: the catalog's)
    single_replica: bool = False  # plans for the runtime: one copy of the model over the cluster, no replicas
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    mode: BatchMode | None = None  # None: `batch_mode` of the request (a context split off keeps its parent's)
    # traced graphs by step shape; contexts of one model may share one dict (a graph depends only on its shape)
    graphs: dict[tuple, KernelGraph] = field(default_factory=dict, repr=False)
    mix_min_gain: float = DEFAULT_MIX_MIN_GAIN  # Tessera adopts a route mix only past this planned gain
    cache: PlanCache = field(init=False, repr=False, compare=False)
    parent: PlanContext | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.spec = resolve_model(self.model)
        if self.mode is None:
            runtime = self.cache_ctx is not None or self.single_replica or self.micro_batches is not None
            self.mode = batch_mode(self.spec.family, self.max_batch, runtime)
        self.cache = PlanCache()
        batch = self.max_batch
        if self.admits and batch is None:  # probe at the most an engine may admit; memory then decides
            batch = self.engine_cap(1)[0]
        self.phases, self.outputs_per_request, self.unit = workload_phases(self.spec.family, self.workload, batch)
        if self.admits:  # paged state: a sequence holds its tokens so far, on average the mean context
            self.phases = [replace(p, state_scale=1.0) for p in self.phases]
        if self.cache_ctx is not None:
            self.phases = [replace(p, ctx=self.cache_ctx, state_scale=1.0) if p.ctx is not None else p
                           for p in self.phases]
        if self.micro_batches is not None:  # one state instance per micro-batch, shared by every phase
            m, main = self.micro_batches, self.main_phase
            if m < 1:
                raise PlanningError(f"micro-batches must be at least 1 (got {m})")
            if main.batch % m == 0:  # else this batch (a replica's share) has no plan at this M
                self.phases = [replace(p, slots=main.batch // m) if p.ctx is not None and not p.micro_batched
                               else p for p in self.phases]
        self.solve_seconds = 0.0  # spent in the placement solver so far (shared with for_batch children)

    @property
    def admits(self) -> bool:
        """Whether every engine admits the sequences its memory holds (`BatchMode.ADMIT`)."""
        return self.mode is BatchMode.ADMIT

    @property
    def batch(self) -> int:
        """Sequences (images) in flight in the whole deployment."""
        return self.main_phase.batch

    @property
    def shared_batch(self) -> bool:
        """Whether the batch is the deployment's, shared by its replicas (a fixed ``--max-batch``, runtime
        plans); not where engines admit from memory, nor for diffusion's default images in flight, which
        every engine has of its own."""
        return self.mode is BatchMode.SHARED

    def for_batch(self, batch: int) -> PlanContext:
        """The same run (every setting and the mode) with ``batch`` in flight, sharing this run's cache."""
        if batch == self.batch:
            return self
        child = replace(self, max_batch=batch)
        child.cache, child.parent = self.cache, self
        return child

    @classmethod
    def from_config(cls, config: PlanConfig, progress: Callable[[str], None] | None = None) -> PlanContext:
        """The context of a planning request (checked first; progress lines go to ``progress``)."""
        config.check()
        text = config.workload_text()
        return cls(config.model, parse_cluster(config.cluster), parse_workload(text), text, config.max_batch,
                   config.cost, routing_skew=config.routing_skew, price_scenario=config.prices, progress=progress,
                   cache_ctx=config.cache_ctx, split_experts=config.split_experts, admission=config.admission,
                   mix_min_gain=config.mix_min_gain)

    def add_solve_time(self, seconds: float) -> None:
        """Count solver time here and in the context this one was split from."""
        self.solve_seconds += seconds
        if self.parent is not None:
            self.parent.add_solve_time(seconds)

    def engine_cap(self, replicas: int) -> tuple[int, str]:
        """The most sequences one of ``replicas`` engines may admit, and why: ``max_num_seqs``, or its share of
        a workload that arrives at once when that is fewer."""
        cap, why = self.admission.max_num_seqs, f"--max-num-seqs {self.admission.max_num_seqs}"
        n = getattr(self.workload, "requests", None)
        if n is not None and not isinstance(self.workload, PoissonWorkload) and -(-n // replicas) < cap:
            cap = -(-n // replicas)
            why = f"the workload's {n} requests" + (f" over {replicas} replicas" if replicas > 1 else "")
        return cap, why

    def can_hold(self, targets: list[Target]) -> bool:
        """Whether the targets together have room for the main phase's weights and state at all (with
        engines admitting from memory: for one sequence)."""
        mem = self.step_problem(self.main_phase, targets, 1).problem.memory
        if mem is None:
            return True
        need = float(mem.item_bytes.sum())
        if self.admits:
            buffers = self.step_problem(self.main_phase, targets, 1).graph.buffers
            state = sum(float(size) for size, name in zip(mem.item_bytes, mem.item_names or [], strict=False)
                        if getattr(buffers.get(name.split("[")[0]), "kind", None) == "state")
            need -= state * (1 - 1 / max(self.batch, 1))
        return need <= float(mem.capacity.sum())

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)

    @property
    def main_phase(self) -> PhaseSpec:
        """The phase a request repeats most (decode; denoising steps)."""
        return max(self.phases, key=lambda p: p.repeats)

    def replica_counts(self, types: list[str] | None = None) -> list[int]:
        """Replica counts a plan may use (all that split the selected types evenly; 1 for runtime plans)."""
        from tessera.plan.targets import replica_counts

        counts = replica_counts(self.cluster, types)
        return [1] if self.single_replica else counts

    def fixed_m(self, phase: PhaseSpec) -> int:
        """M of a phase whose placement is fixed (not searched): the context's M for the micro-batched phase."""
        return (self.micro_batches or 1) if phase.micro_batched else 1

    def micro_batch_options(self, phase: PhaseSpec, minimum: int = 1) -> list[int]:
        """M values this phase can use: the batch splits evenly into M micro-batches."""
        if not phase.micro_batched:
            return [1] if minimum <= 1 else []
        allowed = MICRO_BATCHES if self.micro_batches is None else (self.micro_batches,)
        return [m for m in allowed if m >= minimum and phase.batch % m == 0]

    def graph_key(self, phase: PhaseSpec, micro_batches: int = 1) -> tuple:
        """The step shape the phase's graph at ``micro_batches`` is traced at (its cache key)."""
        image = self.image if self.spec.family == "vlm" else None
        return phase.phase, phase.batch // micro_batches, phase.seq, phase.ctx, phase.resolution, phase.slots, image

    def graph(self, phase: PhaseSpec, micro_batches: int = 1) -> KernelGraph:
        """The phase's graph traced at the micro-batch size (cached)."""
        from tessera.capture.trace_cache import trace_model_cached

        key = self.graph_key(phase, micro_batches)
        graphs = self.graphs
        if key not in graphs:
            graphs[key] = trace_model_cached(
                self.model, phase.phase, batch=key[1], seq=phase.seq, ctx=phase.ctx, resolution=phase.resolution,
                slots=phase.slots, image=key[-1],
                on_trace=lambda: self.say(f"tracing {self.model} {phase.phase} (batch {key[1]})"))
        return graphs[key]

    def graph_facts(self, phase: PhaseSpec, micro_batches: int = 1) -> GraphFacts:
        """What every step problem of the phase's graph at ``micro_batches`` shares (cached)."""
        key = self.graph_key(phase, micro_batches)
        if key not in self.cache.facts:
            self.cache.facts[key] = GraphFacts.of(self.graph(phase, micro_batches), self.options, self.routing_skew)
        return self.cache.facts[key]

    def kernel_times(self, phase: PhaseSpec, target: Target, micro_batches: int = 1) -> np.ndarray:
        """[K] seconds of each kernel of the phase's graph at ``micro_batches`` on ``target`` (cached)."""
        times = self.cache.times.setdefault(self.graph_key(phase, micro_batches), {})
        if target_key(target) not in times:
            facts = self.graph_facts(phase, micro_batches)
            cached_target_times(self.graph(phase, micro_batches), facts, target, self.options, self.profile, times)
        return times[target_key(target)]

    def step_problem(self, phase: PhaseSpec, targets: list[Target], micro_batches: int = 1,
                     expert_parts: int = 1) -> StepProblem:
        """The phase's unfolded placement problem over ``targets`` (cached; ``expert_parts`` > 1 splits
        every grouped expert GEMM into expert groups plus a combine)."""
        key = (phase, micro_batches, tuple(t.members for t in targets), expert_parts)
        if key not in self.cache.problems:
            gkey = self.graph_key(phase, micro_batches)
            self.cache.problems[key] = build_step_problem(
                self.graph(phase, micro_batches), targets, self.cluster, micro_batches=micro_batches,
                options=self.options, profile=self.profile, routing_skew=self.routing_skew,
                state_scale=phase.state_scale, expert_parts=expert_parts,
                utilization=self.admission.memory_utilization, facts=self.graph_facts(phase, micro_batches),
                times_cache=self.cache.times.setdefault(gkey, {}))
        return self.cache.problems[key]

    def folded(self, phase: PhaseSpec, targets: list[Target], micro_batches: int = 1, expert_parts: int = 1) -> Merged:
        """The phase's problem with identical layers folded into ``fold_chunks`` runs per class (cached)."""
        key = (phase, micro_batches, tuple(t.members for t in targets), expert_parts)
        if key not in self.cache.folded:
            sp = self.step_problem(phase, targets, micro_batches, expert_parts)
            try:
                graph_groups = fold_groups(graph_layers(sp.graph), len(sp.graph.kernels), self.fold_chunks)
            except LayerStructureError:  # layers of several stacks interleave (e.g. text encoders): no folding
                graph_groups = [[k] for k in range(len(sp.graph.kernels))]
            own = sp.problem_kernels()  # a split kernel's parts fold with the same parts of the other layers
            groups = [[own[k][j] for k in g] for g in graph_groups for j in range(len(own[g[0]]))]
            self.cache.folded[key] = merge(sp.problem, groups)
        return self.cache.folded[key]

    # -----------------------------------------------------------------------------------------------------
    # From per-phase assignments to a DeploymentPlan

    def assemble(self, policy: str, targets: list[Target], replicas: int,
                 chosen: list[tuple[PhaseSpec, int, tuple[int, ...], dict]], objective: str = "throughput",
                 device: str | None = None, reason: str = "") -> DeploymentPlan:
        """The deployment of per-phase (phase, M, unfolded assignment, solver info), re-evaluated exactly."""
        steps, evaluations, problems = [], [], []
        for phase, m, assignment, info in chosen:
            sp = self.step_problem(phase, targets, m, info.get("expert_parts", 1))
            ev = evaluate(sp.problem, assignment)
            problems.append((phase, sp, assignment))
            evaluations.append(ev)
            cycle, busy, link = self._over_prompts(phase, targets, m, info.get("expert_parts", 1), sp, assignment, ev)
            steps.append(StepPlan(phase.phase, objective, phase.batch, m, phase.repeats, phase.rows, sp.graph.hash,
                                  sp.graph_assignment(assignment), cycle, ev.critical_path_s, busy,
                                  link, ev.cut_edges, ev.cut_bytes, dict(info),
                                  {str(k): v for k, v in sp.expert_parts(assignment).items()}))
        residency, _ = self.residency(problems)
        moves = self._state_moves(problems, targets)
        d = len(targets)
        shape = self.memory_shape(problems, targets)
        memory = shape.fixed + shape.per_sequence * self.batch
        capacity = [t.usable_bytes(self.admission.memory_utilization) for t in targets]
        usable = np.array(capacity)
        loads = np.zeros(d)
        links = np.zeros((d, d))
        for step in steps:
            loads += np.array(step.busy_s) * step.per_request
            links += np.array(step.link_s) * step.per_request
        for mv in moves:
            links[mv.src, mv.dst] += mv.seconds_per_request
        lane_bound, lane = busiest_lane(steps)
        t_req = max(loads.max(), links.max(), lane_bound)
        bound = ("compute on " + targets[int(loads.argmax())].name if t_req == loads.max() else
                 "link" if t_req == links.max() else
                 "phases taking turns on shared devices" if len(set().union(*(s.used_targets for s in lane))) > 1
                 and len(lane) > 1 else "dependencies")
        main = next(s for s in steps if s.phase == self.main_phase.phase)
        used = sorted({t for s in steps for t in s.assignment})
        plan = DeploymentPlan(
            model=self.model, cluster=self.cluster.describe(), workload=self.workload_text, policy=policy,
            applicable=True, reason=reason, feasible=bool((memory <= usable * (1 + 1e-9)).all()),
            targets=[t.name for t in targets], replicas=replicas, device=device,
            residency={k: sorted(v) for k, v in residency.items()}, memory_bytes=memory.tolist(),
            memory_capacity=capacity, steps=steps, state_moves=moves, unit=self.unit, request_time_s=float(t_req),
            price_scenario=self.price_scenario, bottleneck=bound,
            admission=admit(shape, self.admission, self.batch, main.micro_batches,
                            self.engine_cap(replicas)[1]) if self.admits else None)
        plan.throughput = replicas * self.outputs_per_request / t_req if t_req > 0 else 0.0
        plan.cost_per_hour = replicas * sum(targets[t].price(self.price_scenario) for t in used)
        plan.extra["memory_parts"] = {"weights": shape.weights.tolist(), "reserve": shape.reserve}
        before_main = [s for s in steps if self._order(s.phase) < self._order(main.phase)]
        after_main = [s for s in steps if self._order(s.phase) > self._order(main.phase)]
        move_s = sum(mv.seconds_per_request for mv in moves)
        if self.unit == "images/s":
            plan.latency_s = (sum(s.critical_path_s for s in before_main + after_main) + main.repeats * main.cycle_s)
            plan.ttft_s = plan.latency_s
        else:
            plan.latency_s = main.cycle_s if objective == "throughput" else main.critical_path_s
            plan.ttft_s = sum(s.critical_path_s for s in before_main) + move_s
        self._finite_throughput(plan, main, replicas)
        if not plan.feasible:
            over = [f"{targets[i].name} needs {(memory[i] - capacity[i]) / 1e9:.1f} GB more "
                    f"({memory[i] / 1e9:.1f} of {capacity[i] / 1e9:.1f} GB)" for i in range(d) if memory[i] > capacity[i]]
            plan.reason = (plan.reason + "; " if plan.reason else "") + "does not fit: " + ", ".join(over)
        return plan

    def assemble_admitted(self, policy: str, targets: list[Target], replicas: int, chosen: Chosen,
                          objective: str = "throughput", device: str | None = None, reason: str = "") -> DeploymentPlan:
        """``assemble``, then, where engines admit from memory, the same placement again at the batch its
        memory admits (each phase's graph traced at that batch). A plan that cannot hold its weights and one
        sequence is returned infeasible with the reason."""
        plan = self.assemble(policy, targets, replicas, chosen, objective, device, reason)
        adm = plan.admission
        if adm is None or adm.max_seqs == self.batch:
            return plan
        if adm.max_seqs < 1:
            plan.feasible = False
            plan.reason = (reason + "; " if reason else "") + adm.limited_by
            return plan
        child = self.for_batch(adm.max_seqs)
        phases = {p.phase: p for p in child.phases}
        again = child.assemble(policy, targets, replicas, [(phases[ph.phase], m, a, info) for ph, m, a, info in chosen],
                               objective, device, reason)
        again.admission = adm
        return again

    @cached_property
    def prompt_lengths(self) -> list[int]:
        """The prompt lengths a prompt phase is costed at (:func:`representative_prompts`); empty where the
        phases are traced at one prompt length that stands for every request (fixed lengths, the runtime's
        shapes, a median for Poisson arrivals; a VLM's prompt, which holds the image's tokens)."""
        if self.cache_ctx is not None or self.spec.family == "vlm":
            return []
        return representative_prompts(self.workload, PROMPT_BINS)

    def _over_prompts(self, phase: PhaseSpec, targets: list[Target], m: int, parts: int, sp: StepProblem,
                      assignment, ev) -> tuple[float, list[float], list[list[float]]]:
        """A prompt phase's cycle, busy and link seconds as the mean over the workload's representative prompt
        lengths (its time grows faster than linearly with the prompt where a fixed weight read gives way to
        FLOPs and attention, so the time at the mean prompt is short of the mean time), the same placement
        applied at each; other phases (and a single prompt length) as evaluated."""
        as_evaluated = ev.cycle_s, list(ev.busy_s), [list(r) for r in ev.link_s]
        lengths = self.prompt_lengths if phase.phase == "prefill" and phase.seq is not None else []
        if not lengths:
            return as_evaluated
        key = (phase, tuple(t.members for t in targets), m, parts, tuple(int(a) for a in assignment))
        done = self.cache.over_prompts  # the search assembles one prefill many times
        if key in done:
            return done[key]
        cycle, busy, link = 0.0, np.zeros(len(ev.busy_s)), np.zeros_like(np.asarray(ev.link_s, dtype=float))
        graph_assignment = sp.graph_assignment(assignment)
        for n in lengths:
            at = replace(phase, seq=n, ctx=n)
            other = self.step_problem(at, targets, m, parts)
            if other.problem.kernels == sp.problem.kernels:
                moved = assignment
            elif parts == 1:  # a prompt of other length repeats some kernels (an SSM's chunked scan)
                moved = transfer_assignment(sp.graph, other.graph, graph_assignment)
            else:
                done[key] = as_evaluated
                return as_evaluated
            e = evaluate(other.problem, moved)
            cycle += e.cycle_s / len(lengths)
            busy += np.asarray(e.busy_s) / len(lengths)
            link += np.asarray(e.link_s, dtype=float) / len(lengths)
        done[key] = (cycle, busy.tolist(), link.tolist())
        return done[key]

    def memory_shape(self, problems, targets: list[Target]) -> MemoryShape:
        """The engine's memory per target as fixed bytes plus bytes per sequence in flight, over the (phase,
        step problem, assignment) triples: each item counted once per target holding it, at the size the
        phases placed there give it (a prefill target holds one prompt's state, not the decode batch's);
        the repeated phase's state scales with the sequences, everything else is fixed."""
        main = self.main_phase.phase
        held: dict[tuple[str, int], tuple[float, bool, bool]] = {}
        for phase, sp, assignment in problems:
            mem = sp.problem.memory
            if mem is None:
                continue
            state = {name for name, b in sp.graph.buffers.items() if b.kind == "state"}
            for w, t in mem.held(assignment):
                name = mem.item_names[w]
                is_state = name.split("[")[0] in state
                size, scales = float(mem.item_bytes[w]), phase.phase == main and is_state
                old = held.get((name, t))
                if old is None or size > old[0]:
                    held[(name, t)] = (size, scales, is_state)
        d = len(targets)
        fixed, per_seq, weights = np.zeros(d), np.zeros(d), np.zeros(d)
        for (_, t), (size, scales, is_state) in held.items():
            if scales:
                per_seq[t] += size / max(self.batch, 1)
            else:
                fixed[t] += size
            if not is_state:
                weights[t] += size
        reserve = max((sp.activation_reserve for _, sp, _ in problems), default=0.0)
        return MemoryShape([t.name for t in targets], np.array([t.device_bytes for t in targets], dtype=float),
                           fixed + reserve, per_seq, self.tokens_per_sequence, weights, reserve)

    @property
    def tokens_per_sequence(self) -> float:
        """Cache tokens a sequence holds on average (its mean context); 0 where the state does not grow with
        the context (an SSM's)."""
        return 0.0 if self.spec.family == "ssm" else float(self.main_phase.ctx or 0)

    def _finite_throughput(self, plan: DeploymentPlan, main: StepPlan, replicas: int) -> None:
        """For a finite workload arriving at once (``fixed:``, ``images:``; not ``offline:``, which is
        planned for its steady state), throughput is outputs over the
        makespan: the per-request work of all requests, or the waves of at most a batch in flight each
        taking a request's whole latency, whichever is longer. The steady state stays in ``extra``."""
        n = getattr(self.workload, "requests", None)
        if n is None or isinstance(self.workload, PoissonWorkload | OfflineWorkload) or plan.request_time_s <= 0:
            return  # offline: enough requests to fill every engine, measured in the steady state
        waves = -(-n // (main.rows * replicas))
        one = plan.latency_s if self.unit == "images/s" else plan.ttft_s + main.repeats * plan.latency_s
        makespan = max(n * plan.request_time_s / replicas, waves * one)
        plan.extra["steady_state_throughput"] = plan.throughput
        plan.extra["makespan_s"] = makespan
        plan.throughput = n * self.outputs_per_request / makespan

    def _order(self, phase: str) -> int:
        return [p.phase for p in self.phases].index(phase)

    @staticmethod
    def residency(problems) -> tuple[dict[str, set[int]], dict[str, float]]:
        """Items (by buffer name) and the targets holding them, over the (phase, step problem, assignment)
        triples; each item's bytes the largest seen."""
        where: dict[str, set[int]] = {}
        size: dict[str, float] = {}
        for _, sp, assignment in problems:
            mem = sp.problem.memory
            if mem is None:
                continue
            for w, t in mem.held(assignment):
                name = mem.item_names[w]
                where.setdefault(name, set()).add(t)
                size[name] = max(size.get(name, 0.0), float(mem.item_bytes[w]))
        return where, size

    def _state_moves(self, problems, targets: list[Target]) -> list[StateMove]:
        """State written by an earlier phase on one target and used by a later phase on another."""
        holder: dict[str, tuple[int, float]] = {}
        moves = []
        for phase, sp, assignment in problems:
            graph = sp.graph
            on = sp.graph_assignment(assignment)
            for name, first in self.graph_facts(phase, sp.micro_batches).state_first:
                t = on[first]
                if name in holder and holder[name][0] != t:
                    src, nbytes = holder[name]
                    link = link_between(self.cluster, targets[src], targets[t])
                    moves.append(StateMove(name, src, t, nbytes, link.transfer_time(int(nbytes))))
                if name not in holder:
                    b = graph.buffers[name]
                    scale = self.options.kv_scale(b.dtype) if is_kv_buffer(name) else 1.0
                    holder[name] = (t, b.nbytes * scale / max(phase.batch, 1))  # one request's share
        return moves
