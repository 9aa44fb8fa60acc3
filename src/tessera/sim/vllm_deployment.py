"""A plan's engines as the vLLM simulator runs them (`tessera simulate --engine vllm`): one
:class:`~tessera.sim.vllm_engines.EngineSim` per engine of the plan's layout, with the layout's routes and
shares, each engine's ``max_num_seqs`` and KV blocks, and its step times: measured on a real engine (a
``tessera profile-engine`` file) or predicted by the cost model for the engine's device (the whole model on
one target, timed by the same step timer as Tessera's own engines, at prompt and decode shapes between
which the times are interpolated).
"""

from __future__ import annotations

from dataclasses import replace

from tessera.cost.engine_steps import EngineStepTimes
from tessera.plan.context import PlanContext
from tessera.plan.deployment import DECODE, DeploymentPlan, PlannedEngine, StepPlan
from tessera.plan.engines import engine_parts
from tessera.plan.shares import ShareSwitch
from tessera.plan.targets import Target, cluster_targets
from tessera.sim.step_timer import StepTimer
from tessera.sim.vllm_engines import EngineSim, SimRoute, VLLMSimResult, VLLMSimulationError, simulate_vllm
from tessera.workload import draw_requests

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM 0.32's OpenAI server on a CPU and on GPUs below 70 GB
PREDICTED_PROMPTS = (16, 128, 1024, 4096)
PREDICTED_ROWS = (1, 16, 128, 512)
PREDICTED_CONTEXTS = (128, 4096)


def vllm_engines(ctx: PlanContext, plan: DeploymentPlan, measured: EngineStepTimes | None = None,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, progress=None,
                 predicted: dict[tuple[str, int], EngineStepTimes] | None = None) -> tuple[list[EngineSim], list[SimRoute]]:
    """The plan's engines and routes for the vLLM simulator. ``measured``: every engine steps as this
    measured engine does (measure on what one engine of the plan gets); otherwise each engine's times are
    predicted for its device (kept in ``predicted``, by target and sequence cap, for the next plan)."""
    layout = plan.layout
    if not layout.engines:
        raise VLLMSimulationError(f"the {plan.policy} plan names no engines ({plan.reason or 'not feasible'}); "
                                  "plan again")
    split = [e.name for e in layout.engines if not e.runs_on_vllm]
    if split:
        raise VLLMSimulationError(f"the {plan.policy} plan splits kernels over devices ({', '.join(split)}); vLLM "
                                  "runs whole-model engines only: simulate it with --engine tessera")
    if measured is not None and measured.model != plan.model:
        raise VLLMSimulationError(f"the step times were measured for {measured.model}, the plan serves {plan.model}; "
                                  f"measure {plan.model} with `tessera profile-engine`")
    names = [e.name for e in layout.engines]
    predicted = {} if predicted is None else predicted
    engines = []
    for e in layout.engines:
        if measured is not None:
            times = measured
        else:
            target = _target(ctx, e.targets[0])
            key = (target.name, e.max_num_seqs)
            if key not in predicted:
                if progress is not None:
                    progress(f"predicting vLLM step times of {plan.model} on {target.name}")
                predicted[key] = predicted_step_times(ctx, target, e.max_num_seqs)
            times = predicted[key]
        blocks = e.kv_tokens // e.block_size if e.kv_tokens is not None and measured is None else times.kv_blocks
        engines.append(EngineSim(e.name, times, e.max_num_seqs, max_num_batched_tokens,
                                 e.block_size if measured is None else times.block_size, blocks,
                                 handoff_s=_handoff_s(plan, e), devices=frozenset(e.devices)))
    routes = [SimRoute(r.name, r.share, tuple(names.index(h) for h in r.hops)) for r in layout.routes]
    return engines, routes


def simulate_on_vllm(ctx: PlanContext, plan: DeploymentPlan, seed: int = 0, progress=None,
                     predicted: dict[tuple[str, int], EngineStepTimes] | None = None,
                     shares: str = "auto") -> VLLMSimResult:
    """``ctx``'s workload served by ``plan``'s engines on vLLM, every step predicted (`vllm_engines`), the
    router choosing route shares as ``shares`` says (`tessera.plan.shares`)."""
    engines, routes = vllm_engines(ctx, plan, progress=progress, predicted=predicted)
    return simulate_vllm(engines, routes, draw_requests(ctx.workload, seed), share_switch(plan, shares))


def share_switch(plan: DeploymentPlan, shares: str) -> ShareSwitch:
    """The router's share switch over ``plan``'s routes (``shares``: auto, throughput or latency)."""
    layout = plan.layout
    return ShareSwitch(list(layout.routes), {e.name: e for e in layout.engines}, shares)


def _handoff_s(plan: DeploymentPlan, engine: PlannedEngine) -> float:
    """The KV handoff into a decode engine per request: the plan's state moves at its mean prompt."""
    if DECODE not in engine.roles:
        return 0.0
    moves = next((p.state_moves for p in engine_parts(plan) if p.state_moves), [])
    return sum(m.seconds_per_request for m in moves)


def _target(ctx: PlanContext, name: str) -> Target:
    """The cluster target named ``name`` (of one device type's replicas, where the plan made replicas)."""
    for replicas in range(1, len(ctx.cluster.devices) + 1):
        for t in cluster_targets(ctx.cluster, replicas):
            if t.name == name:
                return t
    raise VLLMSimulationError(f"the plan's target {name} is not in cluster {ctx.cluster.describe()}; plan for "
                              "this cluster")


def predicted_step_times(ctx: PlanContext, target: Target, max_num_seqs: int) -> EngineStepTimes:
    """The cost model's step times of the whole model on ``target``: prefills at several prompt lengths,
    decodes at several rows and contexts (up to ``max_num_seqs`` rows)."""
    steps = [_whole_on_one(ctx, phase) for phase in ("prefill", "decode")]
    timer = StepTimer(ctx, steps, [target])
    longest = max(PREDICTED_CONTEXTS)
    prefill = tuple((n, timer.time("prefill", 1, n, n).first_s) for n in PREDICTED_PROMPTS if n <= longest)
    rows = [r for r in PREDICTED_ROWS if r <= max_num_seqs] or [1]
    decode = tuple((r, c, timer.time("decode", r, None, c).first_s) for r in rows for c in PREDICTED_CONTEXTS)
    return EngineStepTimes("vllm (predicted)", ctx.model, f"predicted: {target.name}", prefill, decode,
                           source="Tessera's cost model, the whole model on one device")


def _whole_on_one(ctx: PlanContext, phase: str) -> StepPlan:
    """A step plan running every kernel of ``phase`` on target 0 (no micro-batches)."""
    base = next((p for p in ctx.phases if p.phase == phase), None)
    if base is None:
        raise VLLMSimulationError(f"{ctx.model} has no {phase} phase; the vLLM simulator serves text models")
    graph = ctx.graph(replace(base, batch=1), 1)
    return StepPlan(phase, "throughput", 1, 1, 1.0, 1, graph.hash, [0] * len(graph.kernels), 0.0, 0.0,
                    [0.0], [[0.0]], 0, 0.0)
