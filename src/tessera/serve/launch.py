"""Starting a served deployment from a `ServeConfig` on local cpu workers: the tokenizer, the bucket
graphs, each objective's placements (from a policy planned with this host's measured kernel times, a
synthetic placement, or a plan file's routes: `tessera.serve.plan_routes`), the worker pool and the
engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tessera.sched.monitor import Monitor
from tessera.sched.scheduler import Buckets
from tessera.serve.backend import (
    LocalBackend,
    ObjectivePlacements,
    ServeSetupError,
    WorkerBackend,
    bucket_graphs,
    bucket_of,
    objective_placements,
    phase_name,
    prefill_name,
    route_placements,
)
from tessera.serve.config import ServeConfig
from tessera.serve.engine import Engine, RouteSpec, route_prefix, serving_scheduler

if TYPE_CHECKING:
    from tessera.plan.context import PlanContext
    from tessera.plan.deployment import DeploymentPlan

PLAN_PROMPT = 64  # prompt length the placements are planned for (every prompt bucket has the same kernels)
PLAN_OUTPUT = 64  # tokens generated per request in the planned workload
# Within this planned throughput gain of one copy over a replica per worker, the two tie and the lower predicted
# time per output token serves (Tessera's other tie rule, a route mix's least gain over one engine, has the same
# default)
REPLICA_TIE_GAIN = 0.05


def _tokenizer(model: str):
    from tessera.capture.models import resolve_model
    from tessera.capture.pretrained import load_tokenizer
    from tessera.errors import TesseraError

    spec = resolve_model(model)
    if spec.family not in ("llm", "moe"):
        raise ServeSetupError(f"tessera serve serves text models with a KV cache (llm, moe); {spec.name} is a "
                              f"{spec.family} model")
    try:
        return load_tokenizer(spec)
    except TesseraError as e:  # no real weights here, or a tokenizer file named in the message is damaged
        raise ServeSetupError(f"{model}: {e}") from None


@dataclass(frozen=True)
class ServedPolicy:
    """The policy a start serves and, where choosing it planned it (`runtime_policy`), that plan with the
    planning context it was made in, so that the start takes it instead of planning it again."""

    policy: str
    plan: DeploymentPlan | None = None
    context: PlanContext | None = None


def plan_assignments(cfg: ServeConfig, workers: int, threads: int, log: Callable[[str], None],
                     chosen: ServedPolicy | None = None) -> tuple[dict[str, dict[str, list[int]]], str]:
    """Each objective's prefill and decode placement (kernel -> worker), and how they were found: a synthetic
    ``placement`` or the ``policy``'s plan for the throughput objective; ``latency_policy``'s plan, or else the
    same plan's latency-objective step plans (or the same synthetic placement), for the latency objective.
    ``homogeneous`` on cpu workers is every kernel on the first worker (nothing to plan). ``chosen``: the plan
    `runtime_policy` made for these workers, taken for its policy instead of planning it again."""
    from tessera.plan.objective_steps import add_objective_steps
    from tessera.plan.planner import plan_policy
    from tessera.program.placements import synthetic_placement
    from tessera.runtime.session import measured_context, placements_from_plan, runtime_graphs

    base = runtime_graphs(cfg.model, PLAN_PROMPT, cfg.max_context, cfg.slots)
    context = None

    def planned(policy: str):
        nonlocal context
        if chosen is not None and chosen.plan is not None and policy == chosen.policy:
            context = context or chosen.context
            return chosen.plan
        if context is None:
            context = measured_context(cfg.model, workers, threads, PLAN_PROMPT, PLAN_OUTPUT, cfg.max_context,
                                       cfg.slots, log, base)
        return plan_policy(context, policy, "throughput", "cpu" if policy == "homogeneous" else None)

    def single() -> dict[str, list[int]]:
        return {p: [0] * len(g.kernels) for p, g in base.items()}

    if cfg.placement is not None:
        through = {p: synthetic_placement(g, workers, cfg.placement, cfg.seed) for p, g in base.items()}
        how, plan = f"{cfg.placement} placement (seed {cfg.seed})", None
    elif cfg.policy == "homogeneous":
        through, how, plan = single(), "homogeneous (every kernel on the first worker)", None
    else:
        plan = planned(cfg.policy)
        through, _ = placements_from_plan(plan, base, workers, f"the {cfg.policy} plan")
        how = f"{cfg.policy} plan"
    if cfg.latency_policy == "homogeneous":
        latency = single()
        how = f"throughput: {how}; latency: homogeneous (first worker)"
    elif cfg.latency_policy is not None:
        latency, _ = placements_from_plan(planned(cfg.latency_policy), base, workers, f"the {cfg.latency_policy} plan")
        how = f"throughput: {how}; latency: {cfg.latency_policy} plan"
    elif plan is not None:
        add_objective_steps(context, plan, "latency")
        latency = {p: list(plan.step(p, "latency").assignment) for p in base}
        how += " (throughput and latency objectives)"
    else:
        latency = through
    return {"latency": latency, "throughput": through}, how


def runtime_policy(cfg: ServeConfig, workers: int, threads: int, log: Callable[[str], None]) -> ServedPolicy:
    """The policy served for ``cfg``: ``cfg.policy``, except that the default ``tessera`` (the best plan for one
    copy of the model over the workers) gives way to ``request-dist`` (a copy per worker) where `prefer_replicas`
    says so, on this host's measured kernels: the planner's best among what this engine runs. Where it planned
    both, the chosen plan comes with it (its context too), for the start to serve."""
    if (cfg.policy != "tessera" or workers < 2 or cfg.local or cfg.placement is not None or cfg.plan_file is not None
            or cfg.latency_policy is not None):
        return ServedPolicy(cfg.policy)
    from tessera.plan.planner import plan_policy
    from tessera.runtime.session import measured_context

    context = measured_context(cfg.model, workers, threads, PLAN_PROMPT, PLAN_OUTPUT, cfg.max_context, cfg.slots, log)
    one_copy, copies = (plan_policy(context, p, "throughput") for p in ("tessera", "request-dist"))
    burst = None
    if runnable(one_copy) and runnable(copies) and copies.throughput <= one_copy.throughput:
        burst = tuple(burst_throughput(context, p, cfg) for p in (one_copy, copies))
    if prefer_replicas(one_copy, copies, burst):
        on_burst = (f"; on a burst of {cfg.slots} requests {burst[1]:.1f} against {burst[0]:.1f}"
                    if burst is not None else "")
        log(f"request-dist (a replica per worker) planned at {copies.throughput:.1f} tokens/s and "
            f"{copies.latency_s * 1e3:.0f} ms a token against the tessera plan's {one_copy.throughput:.1f} and "
            f"{one_copy.latency_s * 1e3:.0f}{on_burst}: serving request-dist")
        return ServedPolicy("request-dist", copies, context)
    return ServedPolicy(cfg.policy, one_copy, context)


def runnable(plan) -> bool:
    """Whether ``plan`` applies to the cluster and fits its memory."""
    return bool(plan.applicable and plan.feasible)


def burst_throughput(context: PlanContext, plan: DeploymentPlan, cfg: ServeConfig) -> float:
    """Tokens/s the simulator gives ``plan`` serving a burst that fills every slot at once (``cfg.slots``
    requests of the planned shape, arriving together) until it drains."""
    from tessera.sim.requests import simulate

    draws = [(0.0, PLAN_PROMPT, PLAN_OUTPUT)] * cfg.slots
    return simulate(context, plan, max_context=cfg.max_context, min_prompt=cfg.min_prompt_bucket, draws=draws,
                    engine_shapes=True).throughput


def prefer_replicas(one_copy, copies, burst: tuple[float, float] | None = None) -> bool:
    """Whether request-dist's plan ``copies`` is served rather than the one-copy plan: it is runnable and
    predicted faster; or the one-copy plan's lead is a steady state's only (``burst``: the two plans'
    simulated tokens/s on a burst that fills every slot, one copy's first, and the replicas' is higher by more
    than `REPLICA_TIE_GAIN`: a split leaves a worker idle while its phase has no work, which a plan's queue that
    never empties does not show; within it, the burst ties and the steady state decides); or they tie (within
    `REPLICA_TIE_GAIN`) and the replicas' time per output token is lower."""
    if not runnable(copies):
        return False
    if not runnable(one_copy) or copies.throughput > one_copy.throughput:
        return True
    if burst is not None and burst[1] > burst[0] * (1 + REPLICA_TIE_GAIN):
        return True
    ties = one_copy.throughput <= copies.throughput * (1 + REPLICA_TIE_GAIN)
    return ties and copies.latency_s < one_copy.latency_s


def replanner(cfg: ServeConfig, threads: int, phases: list[str], log: Callable[[str], None]
              ) -> Callable[[int], dict[str, list[int]]]:
    """The placements of these runtime phases on ``n`` workers (after a lost one): each objective planned
    again as at start-up, a shared phase taking the throughput plan's placement."""

    def replan(n: int) -> dict[str, list[int]]:
        assignments, how = plan_assignments(cfg, n, threads, log)
        log(f"re-planned for {n} worker{'s' if n != 1 else ''}: {how}")
        out = {}
        for name in phases:
            bucket, _, objective = name.partition(":")
            out[name] = list(assignments[objective or "throughput"][bucket.split("@")[0]])
        return out

    return replan


def planned_routes(cfg: ServeConfig, workers: int, log: Callable[[str], None]
                   ) -> tuple[dict, ObjectivePlacements, list[RouteSpec], str]:
    """A plan file's routes served on ``workers`` cpu workers: the bucket graphs every route needs, their
    placements, each route's slots (``cfg.slots`` divided by the routes' shares) and buckets, and what is
    served."""
    from tessera.serve.plan_routes import load_served_plan, split_slots

    served = load_served_plan(cfg.plan_file, cfg.model, workers)
    slots = split_slots([r.share for r in served.routes], cfg.slots)
    specs = [RouteSpec(r.name, n, Buckets.default(n, cfg.max_context, cfg.min_prompt_bucket), r.share, r.latency_s)
             for r, n in zip(served.routes, slots, strict=True)]
    names: list[list[str]] = []
    prompts: set[tuple[int, int]] = set()
    rows: set[int] = set()
    for spec in specs:
        shapes = serving_scheduler(spec.slots, spec.buckets, cfg.max_context).prompt_shapes()
        prompts.update(shapes)
        rows.update(spec.buckets.batch)
        names.append([prefill_name(r, s) for r, s in shapes] + [phase_name("decode", b) for b in spec.buckets.batch])
    graphs = bucket_graphs(cfg.model, cfg.slots, cfg.max_context, sorted(prompts), tuple(sorted(rows)), log)
    placements = route_placements(graphs, [(route_prefix(i, len(specs)), names[i], r.assignments)
                                           for i, r in enumerate(served.routes)])
    how = served.how
    if len(specs) > 1:
        how += "; " + ", ".join(f"{s.name}: {s.slots} slot{'s' if s.slots != 1 else ''}" for s in specs)
    return graphs, placements, specs, how


def start_engine(cfg: ServeConfig, log: Callable[[str], None] = lambda s: None) -> tuple[Engine, str]:
    """Trace, place, start the workers and the engine; returns the running engine and a description."""
    from tessera.hardware.cluster import parse_cluster
    from tessera.runtime.distributed import DistributedRunner
    from tessera.runtime.pool import WorkerPool
    from tessera.runtime.session import weight_files

    if cfg.slots < 1 or cfg.max_context < 2:
        raise ServeSetupError(f"slots must be at least 1 and the context at least 2 (got {cfg.slots}, "
                              f"{cfg.max_context})")
    cluster = parse_cluster(cfg.cluster)
    if any(d.spec.id != "cpu" for d in cluster.devices):
        raise ServeSetupError(f"tessera serve starts local cpu workers (--cluster cpu:N); {cluster.describe()} has "
                              "GPUs, which are planned and simulated (tessera plan / simulate), not run here")
    workers = len(cluster.devices)
    threads = cfg.threads or cluster.devices[0].spec.threads or 1
    chosen = runtime_policy(cfg, workers, threads, log)
    cfg = replace(cfg, policy=chosen.policy)
    if cfg.policy == "request-dist" and not cfg.local and cfg.placement is None and cfg.plan_file is None:
        # one engine per replica
        from tessera.serve.replicas import start_replicas

        return start_replicas(cfg, start_engine, PLAN_PROMPT, PLAN_OUTPUT, log, chosen.plan)
    tokenizer = _tokenizer(cfg.model)
    buckets = Buckets.default(cfg.slots, cfg.max_context, cfg.min_prompt_bucket)
    routes = None
    if cfg.plan_file is not None:
        graphs, placements, routes, how = planned_routes(cfg, workers, log)
    else:
        prompts = serving_scheduler(cfg.slots, buckets, cfg.max_context).prompt_shapes()
        graphs = bucket_graphs(cfg.model, cfg.slots, cfg.max_context, prompts, buckets.batch, log)
    files = weight_files(cfg.model)
    if cfg.local:
        if cfg.threads is not None:  # this process is the one worker
            import torch

            torch.set_num_threads(cfg.threads)
        placements = ObjectivePlacements({n: [0] * len(g.kernels) for n, g in graphs.items()},
                                         {o: {n: n for n in graphs} for o in ("latency", "throughput")}, False)
        backend = LocalBackend(graphs, files, cfg.batch_invariant)
        how = "one process (reference)"
    else:
        if cfg.plan_file is None:
            assignments, how = plan_assignments(cfg, workers, threads, log, chosen)
            placements = objective_placements(graphs, assignments)
        log(f"starting {workers} workers ({threads} thread{'s' if threads != 1 else ''} each)")
        replan = cfg.on_failure in ("replan", "respawn")
        pool = WorkerPool.local(workers, threads, transfer_timeout_s=cfg.transfer_timeout_s, allow_lost=replan)
        try:
            phases = {name: graphs[bucket_of(name)] for name in placements.placements}
            runner = DistributedRunner(pool, phases, placements.placements, weights_path=files, log=log,
                                       batch_invariant=cfg.batch_invariant,
                                       on_failure="replan" if replan else "fail",
                                       replan=replanner(cfg, threads, list(placements.placements), log))
        except BaseException:
            pool.close()
            raise
        backend = WorkerBackend(runner)
    if cfg.batch_invariant:
        how += "; batch-invariant (GEMMs row by row)"
    monitor = Monitor(cfg.beta, cfg.window_s, cfg.cooldown_s,
                      enabled=placements.differ or cfg.latency_rows < cfg.slots)
    engine = Engine(backend, placements, tokenizer, cfg.slots, buckets, cfg.max_context, monitor, log,
                    latency_rows=cfg.latency_rows, max_queued=cfg.max_queue, queue_timeout_s=cfg.queue_timeout_s,
                    respawn=cfg.on_failure == "respawn", routes=routes, shares=cfg.shares,
                    share_cooldown_s=cfg.cooldown_s)
    lost = [] if cfg.local else [pool.devices[w] for w in sorted(pool.lost)]
    if lost:  # serving on the workers that started: /health says so
        engine.status, engine.degraded = "degraded", f"lost {', '.join(lost)} while starting"
    return engine.start(), how


__all__ = ["ObjectivePlacements", "ServeConfig", "start_engine"]
