"""Setting up a generation run on workers: the graphs at the run's shapes, where their kernels go (a plan
file, a policy planned with this host's measured profile, or a synthetic placement), the weight files,
and the text generation loop itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.graph.ir import KernelGraph
from tessera.plan.deployment import DeploymentPlan, PlanFileError
from tessera.program.placements import PLACEMENTS, synthetic_placement
from tessera.runtime.config import RunSetupError
from tessera.runtime.distributed import DistributedRunner
from tessera.runtime.target_map import plan_target_map, target_map

CTX_BUCKET = 64  # the KV cache is sized to prompt + new tokens rounded up to this
TEXT_FAMILIES = ("llm", "moe", "ssm")
# calls per kernel of a host profile: untimed, then timed (the median stands). One and three left a one-row
# decode step's profile 5-17% high, run to run (smollm2-135m: 15.5-17.2 ms against 14.7-15.3 at three and ten,
# 14.4 at five and twenty), about what a TPOT prediction may miss; three and ten cost 0.15 s more on that step.
PROFILE_WARMUP, PROFILE_REPEATS = 3, 10


def cache_context(prompt_tokens: int, max_tokens: int) -> int:
    """The cache context of a run: prompt plus new tokens, rounded up to CTX_BUCKET."""
    need = prompt_tokens + max_tokens
    return -(-need // CTX_BUCKET) * CTX_BUCKET


def runtime_graphs(model: str, prompt_tokens: int, ctx: int, batch: int = 1,
                   micro_batches: int = 1) -> dict[str, KernelGraph]:
    """The prefill (one request of ``prompt_tokens``) and decode (``batch`` / ``micro_batches`` rows) graphs of
    ``model`` over state instances of batch / micro_batches slots with cache ``ctx``, traced on meta exactly as
    the planner traces them for a run (so plan files match by graph hash)."""
    from tessera.capture.api import trace_model
    from tessera.capture.models import resolve_model

    spec = resolve_model(model)
    if spec.family not in TEXT_FAMILIES:
        raise RunSetupError(f"tessera run generates text; {spec.name} is a {spec.family} model (text models: "
                            f"{', '.join(TEXT_FAMILIES)} families)")
    if micro_batches < 1 or batch % micro_batches:
        raise RunSetupError(f"{micro_batches} micro-batches do not split a batch of {batch} evenly")
    slots = batch // micro_batches
    return {"prefill": trace_model(model, "prefill", batch=1, seq=prompt_tokens, ctx=ctx,
                                   slots=slots if slots > 1 else None),
            "decode": trace_model(model, "decode", batch=slots, ctx=ctx)}


def weight_files(model: str) -> list[str]:
    """The safetensors files holding ``model``'s real weights."""
    from tessera.capture.models import resolve_model
    from tessera.capture.pretrained import weights_dir

    folder = weights_dir(resolve_model(model))
    return [str(f) for f in sorted(folder.glob("*.safetensors"))]


@dataclass
class RunPlacement:
    """Where each phase's kernels run, with M per phase, how it was found and how to find it again on fewer
    workers (after a lost one)."""

    placements: dict[str, list[int]]
    micro_batches: dict[str, int]
    how: str
    replan: Callable[[int], dict[str, list[int]]]
    plan: DeploymentPlan | None = None


def placements_from_plan(plan: DeploymentPlan, graphs: dict[str, KernelGraph], workers: int,
                         source: str = "the plan", worker_of: dict[str, int] | None = None
                         ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Each phase's kernel -> worker from a deployment plan made for exactly these graphs: plan target i is
    worker i, or worker ``worker_of[name]`` of the plan's target of that name (a plan for another cluster)."""
    if not plan.applicable or not plan.feasible:
        raise PlanFileError(f"{source} ({plan.policy}) is not a runnable plan: {plan.reason}")
    if len(plan.extra.get("replicas", [])) > 1:
        raise PlanFileError(f"{source} ({plan.policy}) divides the batch among {len(plan.extra['replicas'])} "
                            "replicas, each with its own graphs; one runner runs one copy of the model (tessera "
                            "serve --policy request-dist starts one engine per replica)")
    if plan.extra.get("routes"):
        raise PlanFileError(f"{source} ({plan.policy}) is a route mix ({plan.reason}); the runtime runs one "
                            "placement of each phase, not several engines' (simulate it with tessera simulate "
                            "--plan, or plan one policy with --policy)")
    out, mbs = {}, {}
    for phase, g in graphs.items():
        step = plan.check_graph(phase, g.hash)
        offset = step.solver.get("target_offset", 0)  # request-dist: the replica's first worker
        if step.expert_parts:
            raise PlanFileError(f"{source} splits MoE expert GEMMs over devices ({len(step.expert_parts)} kernels), "
                                "which the runtime does not execute yet; plan with --no-expert-split")
        placed = [a + offset for a in step.assignment]
        if worker_of is not None:
            placed = [worker_of[plan.targets[a]] for a in placed]
        used = max(placed) + 1
        if used > workers:
            raise PlanFileError(f"{source} places kernels on {used} devices ({', '.join(plan.targets)}) but the "
                                f"cluster has {workers} workers; run it on a cluster with at least {used}")
        out[phase], mbs[phase] = placed, step.micro_batches
    return out, mbs


def host_profile(model: str, graphs: dict[str, KernelGraph], threads: int,
                 log: Callable[[str], None] = lambda s: None, decode_position: int | None = None):
    """This host's measured kernel times for the run's graphs at ``threads`` threads (cached per graph, threads
    and a digest of the timed code, `overhead_probe.code_digest`), with
    the host's costs of Tessera's engine beyond them (``overhead``: the executor's dispatch per kernel and
    weights read from memory, :mod:`tessera.runtime.overhead_probe`, cached per host and code).

    With ``decode_position`` (the planned workload's mean decode position, see `planned_decode_position`), a
    decode step is timed with every row at each of a few positions of its cache, up to the longest
    (`tessera.cost.positions.profiled_positions`; cached per position): the kernels whose time follows the
    position (decode attention) are fitted through them (the profile's ``positions``, which the simulator charges
    at each step's furthest position) and charged at ``decode_position`` to the planner (in this step, and in
    steps of other rows, which no profile times), the others as timed at the short position (an eighth into the
    cache). Without it, decode is timed with every row at position 0.

    Raises:
        PositionError: ``decode_position`` outside a decode step's cache.
    """
    from tessera.cost.positions import PositionModel, check_position, profiled_positions
    from tessera.runtime.overhead_probe import code_digest, gemm_weight_shapes, host_overhead

    code = code_digest()  # a faster kernel or executor is profiled again

    def at(phase: str, g: KernelGraph, position: int):
        return graph_profile(model, phase, phase, g, threads, code, log, position)

    merged = positions = None
    for phase, g in graphs.items():
        if decode_position is None or not phase.startswith("decode"):
            prof = at(phase, g, 0)
        else:
            check_position(decode_position, int(g.meta["ctx"]), f"the {phase} step's cache")
            span = profiled_positions(int(g.meta["ctx"]))
            profiles = [at(phase, g, p) for p in span]
            fitted = PositionModel.fit(g, profiles[0].device, span,
                                       [[k.median_s for k in pr.kernels] for pr in profiles], decode_position)
            positions = fitted if positions is None else positions.merged(fitted)
            prof = _positioned(g, profiles, span, decode_position)
        if merged is None:
            merged = prof
        else:
            merged.kernels = [*merged.kernels, *prof.kernels]
    if merged is not None:
        merged.overhead = host_overhead(threads, gemm_weight_shapes(graphs.values()), log)
        merged.positions = positions
    return merged


def graph_profile(model: str, phase: str, name: str, graph: KernelGraph, threads: int, code: str,
                  log: Callable[[str], None] = lambda s: None, position: int = 0):
    """This host's measured kernel times of ``graph`` (a ``phase`` step at the shapes its ``meta`` records; a
    decode step with every row at ``position``) at ``threads`` threads, cached under
    ``<cache>/profiles/<model>-<name>-<hash>-t<threads>-k<code>[-p<position>].json`` (``code``: the timed code's
    digest, `overhead_probe.code_digest`)."""
    from tessera.cost.profile import cached_profile
    from tessera.paths import default_cache_dir
    from tessera.runtime.profiler import profile_model

    suffix = f"-p{position}" if position else ""
    path = default_cache_dir() / "profiles" / f"{graph.model}-{name}-{graph.hash[:16]}-t{threads}-k{code}{suffix}.json"

    def measure(m=graph.meta):
        where = f" at position {position}" if position else ""
        log(f"measuring {name} kernels{where} on this CPU at {threads} thread(s) (cached in {path.parent})")
        return profile_model(model, phase, batch=m.get("batch"), seq=m.get("seq"), ctx=m.get("ctx"), device="cpu",
                             threads=threads, warmup=PROFILE_WARMUP, repeats=PROFILE_REPEATS, slots=m.get("slots"),
                             position=position)[0]

    return cached_profile(path, measure, graph.hash, log, PROFILE_REPEATS)


def _positioned(graph: KernelGraph, profiles: list, span: tuple[int, ...], position: int):
    """The decode profile timed at the short position (``profiles[-2]``, at ``span[-2]``; ``profiles[i]`` is timed
    at ``span[i]``) with each kernel whose time follows the cache position interpolated at ``position`` between its
    times in the profiles."""
    from dataclasses import replace

    from tessera.cost.positions import interpolate, positional_key

    short = profiles[-2]
    kernels = []
    for k, s, *timed in zip(graph.kernels, short.kernels, *(pr.kernels for pr in profiles), strict=True):
        if positional_key(k) is not None:
            s = replace(s, median_s=interpolate([t.median_s for t in timed], span, position),
                        min_s=interpolate([t.min_s for t in timed], span, position))
        kernels.append(s)
    return replace(short, kernels=kernels)


def planned_decode_position(prompt_tokens: int, max_tokens: int, ctx: int) -> int:
    """The mean cache position of the decode steps of requests of ``prompt_tokens`` generating ``max_tokens``
    (within a cache of ``ctx`` positions): where a profile times decode for that workload."""
    return max(0, min(ctx - 1, prompt_tokens + max_tokens // 2))


def runtime_context(model: str, workers: int, prompt_tokens: int, max_tokens: int, ctx: int, batch: int = 1,
                    micro_batches: int = 1, profile=None, log: Callable[[str], None] = lambda s: None,
                    image: str | None = None, cluster: str | None = None):
    """The planning context of a run: ``batch`` requests of ``prompt_tokens`` on ``cpu:workers`` (or on
    ``cluster``, whose plan the workers stand in for), every phase traced at the runtime's shapes (cache
    ``ctx``, ``micro_batches`` decode micro-batches sharing state instances with the prefill), no MoE expert
    splits."""
    from tessera.hardware.cluster import parse_cluster
    from tessera.plan.context import PlanContext
    from tessera.workload import parse_workload

    text = f"fixed:in={prompt_tokens},out={max_tokens},requests={batch}"
    return PlanContext(model, parse_cluster(cluster or f"cpu:{workers}"), parse_workload(text), text, max_batch=batch,
                       profile=profile, cache_ctx=ctx, split_experts=False, micro_batches=micro_batches,
                       progress=log, image=image, single_replica=True)


def measured_context(model: str, workers: int, threads: int, prompt_tokens: int, max_tokens: int, ctx: int,
                     slots: int, log: Callable[[str], None] = lambda s: None,
                     graphs: dict[str, KernelGraph] | None = None):
    """The planning context of a served run (`runtime_context` for ``slots`` requests of ``prompt_tokens``
    generating ``max_tokens`` on ``cpu:workers``) with this host's profile of its graphs (``graphs``, else traced
    at those shapes) at ``threads`` threads, decode timed at the workload's mean position
    (`planned_decode_position`)."""
    graphs = graphs if graphs is not None else runtime_graphs(model, prompt_tokens, ctx, slots)
    profile = host_profile(model, graphs, threads, log, planned_decode_position(prompt_tokens, max_tokens, ctx))
    return runtime_context(model, workers, prompt_tokens, max_tokens, ctx, slots, 1, profile, log)


def policy_placement(model: str, graphs: dict[str, KernelGraph], workers: int, policy: str, max_tokens: int,
                     profile=None, device: str | None = None, log: Callable[[str], None] = lambda s: None,
                     batch: int = 1, micro_batches: int = 1) -> RunPlacement:
    """Plan ``policy`` on ``cpu:workers`` for these graphs (``batch`` requests, the run's shapes)."""
    from tessera.plan.planner import plan_policy

    prefill = graphs["prefill"]
    prompt, ctx = prefill.meta["seq"], prefill.meta["ctx"]
    if policy == "homogeneous" and device is None:
        device = "cpu"

    def solve(n: int) -> DeploymentPlan:
        pctx = runtime_context(model, n, prompt, max_tokens, ctx, batch, micro_batches, profile, log)
        return plan_policy(pctx, policy, "throughput", device)

    plan = solve(workers)
    placements, mbs = placements_from_plan(plan, graphs, workers, f"the {policy} plan")
    how = f"{policy} plan" + (f" ({plan.reason})" if plan.reason else "")
    return RunPlacement(placements, mbs, how, lambda n: placements_from_plan(solve(n), graphs, n)[0], plan)


def synthetic(graphs: dict[str, KernelGraph], workers: int, kind: str, seed: int = 0) -> RunPlacement:
    """``alternate`` or ``random`` placement of every phase (see :mod:`tessera.program.placements`)."""
    if kind not in PLACEMENTS:
        raise RunSetupError(f"--placement must be one of {', '.join(PLACEMENTS)} (got {kind!r})")

    def place(n: int) -> dict[str, list[int]]:
        return {ph: synthetic_placement(g, n, kind, seed) for ph, g in graphs.items()}

    return RunPlacement(place(workers), {ph: 1 for ph in graphs}, f"{kind} placement" +
                     (f" (seed {seed})" if kind == "random" else ""), place)


def plan_file_placement(path: Path, graphs: dict[str, KernelGraph], workers: int, model: str, max_tokens: int,
                        profile=None, log: Callable[[str], None] = lambda s: None) -> RunPlacement:
    """The placement of a plan file (checked against the graphs; a plan for GPUs runs its target i on worker
    cpu:i; a route mix runs the route its shares send the first request to, see `mix_route_placement`);
    re-planning falls back to ``tessera`` for the workers."""
    plan = DeploymentPlan.load(path)
    mapping = plan_target_map(plan.targets, plan.cluster, workers, f"plan file {path} ({plan.policy})")
    if plan.extra.get("routes"):
        placements, mbs, route = mix_route_placement(plan, graphs, workers, model, f"plan file {path}",
                                                     mapping.worker_of if mapping else None)
    else:
        placements, mbs = placements_from_plan(plan, graphs, workers, f"plan file {path}",
                                               mapping.worker_of if mapping else None)
        route = ""

    def replan(n: int) -> dict[str, list[int]]:
        return policy_placement(model, graphs, n, "tessera", max_tokens, profile, log=log).placements

    how = (f"{plan.policy} plan from {path}{route}"
           + (f", run on stand-in workers {mapping.describe()}" if mapping else ""))
    return RunPlacement(placements, mbs, how, replan, plan)


def mix_route_placement(plan: DeploymentPlan, graphs: dict[str, KernelGraph], workers: int, model: str,
                        source: str, worker_of: dict[str, int] | None = None
                        ) -> tuple[dict[str, list[int]], dict[str, int], str]:
    """A route mix run as one request: the placement of the route its shares send the first request to (the
    largest share, by the router's smooth round robin), each phase's kernels placed by their index (a mix is
    planned at serving shapes, never at a run's: the route's graphs have the same kernels as the run's), with
    what was chosen (``: the request takes route ...``).

    Raises:
        PlanFileError: a plan for another model or kernel count, a route without a phase's step plan, or one
            that splits MoE experts or needs more workers than there are.
    """
    from tessera.plan.engines import engine_parts
    from tessera.plan.shares import SmoothRoundRobin

    if not plan.applicable or not plan.feasible:
        raise PlanFileError(f"{source} ({plan.policy}) is not a runnable plan: {plan.reason}")
    if plan.model != model:
        raise PlanFileError(f"{source} is a plan for {plan.model}, not for {model}: run {plan.model} with it, or plan "
                            f"{model}")
    parts = engine_parts(plan)
    part = parts[SmoothRoundRobin().pick({i: p.share for i, p in enumerate(parts)}, tie=lambda i: i)]
    out, mbs = {}, {}
    for phase, g in graphs.items():
        step = next((s for s in part.steps if s.phase == phase), None)
        if step is None:
            raise PlanFileError(f"{source}: route {part.name} has no {phase} step plan")
        if step.expert_parts:
            raise PlanFileError(f"{source} splits MoE expert GEMMs over devices ({len(step.expert_parts)} kernels), "
                                "which the runtime does not execute yet; plan with --no-expert-split")
        if len(step.assignment) != len(g.kernels):
            raise PlanFileError(f"{source}: route {part.name}'s {phase} step places {len(step.assignment)} kernels, "
                                f"but the run's {phase} graph has {len(g.kernels)}: plan again for this model")
        names = [part.targets[a] for a in step.assignment]
        placed = [worker_of[n] for n in names] if worker_of is not None else [int(n.split(":")[1]) for n in names]
        if max(placed) + 1 > workers:
            raise PlanFileError(f"{source} places kernels on {max(placed) + 1} devices but the cluster has {workers} "
                                f"workers; run it on a cluster with at least {max(placed) + 1}")
        out[phase], mbs[phase] = placed, 1  # one request: no micro-batches
    others = ", ".join(f"{p.name} {p.share:.0%}" for p in parts if p is not part)
    return out, mbs, (f": route mix, the one request takes route {part.name} ({part.share:.0%} of requests, the route "
                      f"its shares send a first request to; not run: {others})")


def placement_for(model: str, graphs: dict[str, KernelGraph], workers: int, cluster: str, policy: str,
                  max_tokens: int, device: str | None = None, fallback_profile=None,
                  log: Callable[[str], None] = lambda s: None) -> RunPlacement:
    """Plan ``policy`` on ``cluster`` (its cost model) for these graphs and map its targets onto the workers.
    Re-planning after a lost worker plans ``tessera`` for the surviving workers themselves (with
    ``fallback_profile``, this host's measured kernel times), as for a plan file.

    Raises:
        TargetMapError: see :func:`target_map`.
        PlanFileError: the plan cannot run on one runner (replicas, expert splits, not feasible).
    """
    from tessera.plan.planner import plan_policy

    mapping = target_map(cluster, workers)
    prefill = graphs["prefill"]
    pctx = runtime_context(model, workers, prefill.meta["seq"], max_tokens, prefill.meta["ctx"], log=log,
                           cluster=cluster)
    plan = plan_policy(pctx, policy, "throughput", device)
    placements, mbs = placements_from_plan(plan, graphs, workers, f"the {policy} plan for {mapping.cluster}",
                                           mapping.worker_of)
    per_token = f"{plan.latency_s * 1e3:.3g} ms" if plan.latency_s < 1 else f"{plan.latency_s:.3g} s"
    how = (f"{policy} plan for {mapping.cluster} (its cost model: {per_token} per token predicted"
           f"{'; ' + plan.reason if plan.reason else ''}), run on stand-in workers {mapping.describe()}")

    def replan(n: int) -> dict[str, list[int]]:
        return policy_placement(model, graphs, n, "tessera", max_tokens, fallback_profile, log=log).placements

    return RunPlacement(placements, mbs, how, replan, plan)


def distributed_runner_fn(runner: DistributedRunner
                          ) -> Callable[[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The (phase, inputs) -> outputs function of a DistributedRunner."""
    return runner.step


def describe_transfers(runner: DistributedRunner) -> str:
    """One line per phase: kernels per worker, transfers and bytes per step."""
    parts = []
    for ph, sp in runner.programs.items():
        counts = [sp.placement.count(d) for d in range(len(sp.devices))]
        split = ", ".join(f"{n} on {dev}" for n, dev in zip(counts, sp.devices, strict=True) if n)
        n = len(sp.transfers)
        parts.append(f"{ph}: {len(sp.placement)} kernels ({split}), {n} transfer{'s' if n != 1 else ''}, "
                     f"{sp.cut_bytes / 1e3:.1f} kB per step")
    return "; ".join(parts)


def describe_made(runner: DistributedRunner) -> str:
    """What the run's steps sent between workers: per phase the steps, messages and bytes, then the state
    moves (the state a phase needs from the worker another phase wrote it on)."""
    parts = []
    for ph, made in runner.made.items():
        steps = f"{made.steps} step{'s' if made.steps != 1 else ''}"
        if made.jobs:
            steps += f" + {made.jobs} streamed micro-batch steps"
        parts.append(f"{ph} {steps}, {made.messages} message{'s' if made.messages != 1 else ''}, "
                     f"{made.nbytes / 1e3:.1f} kB")
    moves = (f"{runner.moves_made} state move{'s' if runner.moves_made != 1 else ''}, {runner.moved_bytes / 1e3:.1f} kB"
             if runner.moves_made else "no state moves")
    return "transfers made: " + "; ".join(parts or ["no steps"]) + f"; {moves}"
