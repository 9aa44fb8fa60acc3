"""Serving under ``request-dist``: the planner divides the slots among replicas (one per worker, rows in
proportion to each worker's speed, summing to ``--slots``); each replica is an engine of its own on one
worker process with its own KV cache of its rows, and `ReplicatedEngine` routes every request to the
replica with the most room. The HTTP layer and `/metrics` see it as one engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tessera.serve.backend import ServeSetupError
from tessera.serve.config import ServeConfig
from tessera.serve.engine import Engine, EngineStats, EventSink, Generation, GenerationParams, Histogram

if TYPE_CHECKING:
    from tessera.plan.deployment import DeploymentPlan


@dataclass(frozen=True)
class Replica:
    """One replica of a request-dist plan: the worker (cluster target) it runs on and its rows."""

    target: str
    rows: int


def replica_rows(cfg: ServeConfig, workers: int, threads: int, plan_prompt: int, plan_output: int,
                 log: Callable[[str], None], plan: DeploymentPlan | None = None) -> tuple[list[Replica], str]:
    """The request-dist plan's replicas for ``cfg`` on ``cpu:workers`` (``plan``, the one already made for
    them, else planned now with this host's measured kernel times for requests of a ``plan_prompt``-token prompt
    generating ``plan_output`` tokens), and the plan's reason line."""
    if plan is None:
        plan = _plan_replicas(cfg, workers, threads, plan_prompt, plan_output, log)
    if not (plan.applicable and plan.feasible):
        raise ServeSetupError(f"the request-dist plan for {cfg.model} on {cfg.cluster} is not runnable: {plan.reason}")
    replicas = [Replica(plan.targets[s.solver.get("target_offset", 0)], s.batch) for s in plan.steps
                if s.phase == "decode" and s.objective == "throughput"]
    if sum(r.rows for r in replicas) != cfg.slots:
        raise ServeSetupError(f"the request-dist plan gives its replicas {[r.rows for r in replicas]} rows, not "
                              f"the {cfg.slots} slots asked for")
    return replicas, plan.reason


def _plan_replicas(cfg: ServeConfig, workers: int, threads: int, plan_prompt: int, plan_output: int,
                   log: Callable[[str], None]) -> DeploymentPlan:
    """request-dist planned for ``cfg`` on ``cpu:workers`` with this host's measured kernel times."""
    from tessera.plan.planner import plan_policy
    from tessera.runtime.session import measured_context

    ctx = measured_context(cfg.model, workers, threads, plan_prompt, plan_output, cfg.max_context, cfg.slots, log)
    return plan_policy(ctx, "request-dist", "throughput")


def start_replicas(cfg: ServeConfig, start_engine: Callable[..., tuple[Engine, str]], plan_prompt: int,
                   plan_output: int, log: Callable[[str], None] = lambda s: None,
                   plan: DeploymentPlan | None = None) -> tuple[ReplicatedEngine, str]:
    """Start one single-worker engine per replica of ``plan`` (request-dist for ``cfg``, planned now if not
    given), each by ``start_engine`` (`tessera.serve.launch.start_engine`) with a one-worker homogeneous
    config."""
    from tessera.hardware.cluster import parse_cluster

    if cfg.latency_policy is not None:
        raise ServeSetupError("--policy request-dist runs one engine per replica, each on one worker; "
                              "--latency-policy places kernels across workers: leave it out")
    cluster = parse_cluster(cfg.cluster)
    workers = len(cluster.devices)
    threads = cfg.threads or cluster.devices[0].spec.threads or 1
    replicas, reason = replica_rows(cfg, workers, threads, plan_prompt, plan_output, log, plan)
    engines: list[Engine] = []
    try:
        for r in replicas:
            log(f"replica on {r.target}: {r.rows} slot{'s' if r.rows != 1 else ''}")
            one = replace(cfg, cluster="cpu:1", slots=r.rows, policy="homogeneous", threads=threads,
                          latency_rows=min(cfg.latency_rows, r.rows),  # the queue's bound split between replicas
                          max_queue=None if cfg.max_queue is None else -(-cfg.max_queue // len(replicas)))
            engines.append(start_engine(one, log)[0])
    except BaseException:
        for e in engines:
            e.stop()
        raise
    how = f"request-dist plan ({reason}): " + ", ".join(f"{r.rows} slot{'s' if r.rows != 1 else ''} on {r.target}"
                                                          for r in replicas)
    return ReplicatedEngine(engines, [r.target for r in replicas]), how


class _Switches:
    def __init__(self, engines: list[Engine]):
        self._engines = engines

    @property
    def switch_count(self) -> int:
        return sum(e.monitor.switch_count for e in self._engines)


class _Busy:
    def __init__(self, engines: list[Engine], targets: list[str]):
        self._pairs = list(zip(engines, targets, strict=True))

    def busy_s(self) -> dict[str, float]:
        # each replica's pool calls its one worker cpu:0; report it as the cluster's worker it stands for
        return {target: sum(e.backend.busy_s().values()) for e, target in self._pairs}


class ReplicatedEngine:
    """Several engines behind the interface of one: requests go to the replica with the fewest requests per
    slot (queued and in flight); counters are the replicas' sums."""

    def __init__(self, engines: list[Engine], targets: list[str]):
        if not engines:
            raise ServeSetupError("request-dist needs at least one replica")
        self.engines = engines
        self.targets = targets
        self.tokenizer = engines[0].tokenizer
        self.max_context = engines[0].max_context
        self.monitor = _Switches(engines)
        self.backend = _Busy(engines, targets)

    @property
    def error(self) -> BaseException | None:
        return next((e.error for e in self.engines if e.error is not None), None)

    @property
    def status(self) -> str:
        """The worst replica's state: ``failed``, else ``recovering``, ``draining`` or ``degraded``, else
        ``ready`` / ``stopped``."""
        states = [e.status for e in self.engines]
        return next((s for s in ("failed", "recovering", "draining", "degraded", "ready") if s in states), states[0])

    @property
    def degraded(self) -> str:
        """What the replicas serving on fewer workers lost."""
        return "; ".join(e.degraded for e in self.engines if e.degraded)

    @property
    def on_fatal(self) -> Callable[[BaseException], None] | None:
        return self.engines[0].on_fatal

    @on_fatal.setter
    def on_fatal(self, callback: Callable[[BaseException], None] | None) -> None:
        for e in self.engines:  # any replica lost for good takes the server down for its supervisor
            e.on_fatal = callback

    @property
    def running(self) -> bool:
        """Whether every replica's engine thread runs."""
        return all(e.running for e in self.engines)

    def idle(self) -> bool:
        """Whether no replica has a request queued or in flight."""
        return all(e.idle() for e in self.engines)

    def close_admission(self) -> None:
        """Take no new requests on any replica."""
        for e in self.engines:
            e.close_admission()

    def abort(self, message: str) -> None:
        """End every replica's queued and running requests with ``message``."""
        for e in self.engines:
            e.abort(message)

    @property
    def objective(self) -> str:
        """``throughput`` while any replica runs its throughput plans, else ``latency``."""
        return "throughput" if any(e.objective == "throughput" for e in self.engines) else "latency"

    def _load(self, engine: Engine) -> float:
        queued, running = engine.queue_depth()
        return (queued + running) / engine.scheduler.slots

    def submit(self, prompt_ids: list[int], params: GenerationParams, sink: EventSink) -> Generation:
        """Queue a request on the least loaded replica (errors in it raise RequestError at once)."""
        engine = min(self.engines, key=self._load)
        gen = engine.submit(prompt_ids, params, sink)
        gen.replica = engine  # type: ignore[attr-defined]  # where cancel() must go
        return gen

    def cancel(self, gen: Generation) -> None:
        """Stop a request on its replica."""
        getattr(gen, "replica", self.engines[0]).cancel(gen)

    def queue_depth(self) -> tuple[int, int]:
        """(queued, in flight) requests over every replica."""
        depths = [e.queue_depth() for e in self.engines]
        return sum(q for q, _ in depths), sum(r for _, r in depths)

    @property
    def stats(self) -> EngineStats:
        """The replicas' counters summed (a snapshot)."""
        out = EngineStats()
        for e in self.engines:
            s = e.stats
            out.tokens += s.tokens
            out.completed += s.completed
            out.steps += s.steps
            out.prefill_steps += s.prefill_steps
            out.prefilled += s.prefilled
            out.failed += s.failed
            out.failed_steps += s.failed_steps
            out.recoveries += s.recoveries
            out.restores += s.restores
            out.refused += s.refused
            out.expired += s.expired
            for mine, theirs in ((out.ttft, s.ttft), (out.tpot, s.tpot)):
                _add(mine, theirs)
            for o, v in dict(s.step_s).items():
                out.step_s[o] = out.step_s.get(o, 0.0) + v
            for o, v in dict(s.tokens_by).items():
                out.tokens_by[o] = out.tokens_by.get(o, 0) + v
        return out

    def stop(self) -> None:
        """Stop every replica's engine and workers."""
        for e in self.engines:
            e.stop()


def _add(total: Histogram, part: Histogram) -> None:
    counts = list(part.counts)
    total.counts = [a + b for a, b in zip(total.counts, counts, strict=True)]
    total.sum += part.sum
