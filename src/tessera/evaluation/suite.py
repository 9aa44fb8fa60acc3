"""The evaluation suite behind ``tessera evaluate``: every policy planned and simulated on the evaluation
models, GPU pairs, clusters and networks. Every GPU figure here is a **prediction**: plans come from the
cost model (:mod:`tessera.plan`), and each plan is served by the request-level simulator
(:mod:`tessera.sim.requests`), whose steps are the deployment's device programs timed by the cost model.
The planner's own estimate is kept beside the simulated figure.

Sections (``SECTIONS``):

* ``offline``: every policy's throughput on each (model, GPU pair) for a finite workload that arrives at
  once, and its throughput per cost normalised to the expensive GPU of the pair alone;
* ``online``: Poisson arrivals with request lengths from a published trace: the highest rate each policy
  sustains with a mean normalised latency (end-to-end latency / output tokens) within a target, found by
  bisection on the rate, and P99 TTFT / TPOT at one fixed rate;
* ``clusters``: larger clusters (several GPUs per type);
* ``network``: the inter-node bandwidth swept, every policy re-planned and simulated at each point;
* ``two-gpus``: per model and pair, whether the heterogeneous pair beats two of the pair's expensive GPU,
  and at what cost.

The work is cut into tasks (``plan_tasks``): per model, its offline cases on every pair with the
two-gpus and network items that reuse them; each online model; each cluster. Tasks run in this process or
in worker processes (``jobs``), longest first. Traced graphs depend only on the model and the step's shape,
so every context of one model in a process shares one graph cache. No item starts after the time budget
(``budget_s``); items left out are reported as skipped, so the suite ends in bounded time.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from tessera.errors import TesseraError
from tessera.evaluation.config import SECTIONS, SuiteConfig, SuiteError, check_sections, split_pair
from tessera.evaluation.records import (
    Case,
    NetworkCase,
    OnlineCase,
    OnlineRun,
    PairVsTwo,
    PolicyRun,
    SuiteResult,
    machine_info,
)


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


# ---------------------------------------------------------------------------------------------------------
# The suite

class Suite:
    """Runs tasks of a SuiteConfig in one process, sharing traced graphs and offline cases between them."""

    def __init__(self, config: SuiteConfig, progress=None, detail=None):
        self.config = config
        self.progress = progress  # callable(str) for progress lines
        self.detail = detail  # callable(str) for the planner's own progress lines, or None
        self._graphs: dict[str, dict] = {}
        self._offline: dict[tuple[str, str], Case] = {}
        self._t0 = time.time()
        self._deadline = math.inf
        self.skipped: list[str] = []
        self.section_seconds: dict[str, float] = {}
        self.pid: int | None = None

    # -- helpers -------------------------------------------------------------------------------------------

    def set_clock(self, deadline: float, t0: float) -> None:
        """The suite's start and the time after which no item starts (``time.time()`` seconds)."""
        self._deadline, self._t0 = deadline, t0

    def say(self, text: str) -> None:
        if self.progress is not None:
            who = f" pid {self.pid}" if self.pid else ""
            self.progress(f"[{time.time() - self._t0:5.0f} s{who}] {text}")

    def out_of_time(self, what: str) -> bool:
        if time.time() < self._deadline:
            return False
        self.skipped.append(what)
        self.say(f"skipped (time budget): {what}")
        return True

    def workload_for(self, model: str) -> str:
        from tessera.capture.models import resolve_model
        from tessera.workload import default_workload

        family = resolve_model(model).family
        if family == "diffusion":
            return self.config.image_workload
        return self.config.llm_workload or default_workload(family)

    def context(self, model: str, cluster, workload_text: str):
        """A PlanContext sharing this model's traced graphs with every other context of the suite."""
        from tessera.cost.options import CostOptions
        from tessera.hardware.cluster import Cluster, parse_cluster
        from tessera.plan.context import PlanContext
        from tessera.workload import parse_workload

        cl = cluster if isinstance(cluster, Cluster) else parse_cluster(cluster)
        return PlanContext(model, cl, parse_workload(workload_text), workload_text, self.config.max_batch,
                           CostOptions(), price_scenario=self.config.prices, progress=self.detail,
                           graphs=self._graphs.setdefault(model, {}))

    def expensive(self, pair: str) -> str:
        from tessera.hardware.devices import resolve_device

        a, b = split_pair(pair)
        return max((a, b), key=lambda d: resolve_device(d).price(self.config.prices))

    @staticmethod
    def pair_cluster(pair: str, gbps: float | None = None):
        from tessera.hardware.cluster import DEFAULT_LATENCY_S, Link, parse_cluster

        a, b = split_pair(pair)
        cl = parse_cluster(f"{a}:1,{b}:1")
        if gbps is not None:
            cl = replace(cl, inter=Link(cl.inter.kind, gbps * 1e9 / 8, DEFAULT_LATENCY_S[cl.inter.kind]))
        return cl

    def simulate_plan(self, ctx, plan) -> PolicyRun:
        """A plan as a PolicyRun: simulated when it applies and fits."""
        from tessera.sim.requests import simulate

        run = PolicyRun(plan.policy, plan.device, "ok", plan.reason, replicas=plan.replicas)
        if not plan.applicable:
            run.status = "n/a"
            return run
        run.planned = plan.throughput
        run.cost_per_hour = plan.cost_per_hour
        if not plan.feasible:
            run.status = "no fit"
            return run
        try:
            res = simulate(ctx, plan, seed=self.config.seed, engine_shapes=True)
        except TesseraError as e:
            run.status, run.reason = "failed", f"{e}"
            return run
        s = res.summary()
        run.simulated = res.throughput
        run.completed, run.rejected = res.completed, res.rejected
        run.norm_latency_s = res.norm_latency_s
        for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
            setattr(run, k, s[k])
        return run

    def plans(self, ctx) -> list:
        """Every policy's plan (``tessera plan --compare``), or those of the configured policies (homogeneous
        once per device type), in the same order."""
        from tessera.plan.config import POLICIES
        from tessera.plan.planner import compare, plan_policy

        wanted = self.config.policies
        if wanted is None or set(wanted) == set(POLICIES):
            return compare(ctx)
        out = []
        for policy in POLICIES:
            if policy not in wanted:
                continue
            if policy == "homogeneous":
                out += [plan_policy(ctx, policy, device=rid) for rid in ctx.cluster.placement_types()]
            else:
                out.append(plan_policy(ctx, policy))
        return out

    def compare_case(self, model: str, cluster, label: str, workload_text: str | None = None,
                     same_nodes: Case | None = None) -> Case:
        """Every policy planned and simulated on one cluster. ``same_nodes``: a case on the same nodes with
        another network, whose homogeneous and request-dist runs are reused: those plans keep each device
        type on its own node, so they never use the network (their plans are the same)."""
        t0 = time.perf_counter()
        text = workload_text or self.workload_for(model)
        ctx = self.context(model, cluster, text)
        plans = self.plans(ctx)
        runs = []
        for p in plans:
            again = same_nodes.run(p.policy, p.device) if same_nodes is not None else None
            local = p.policy in ("homogeneous", "request-dist")
            runs.append(again if local and again is not None and again.planned == p.throughput
                        else self.simulate_plan(ctx, p))
        case = Case(model, label, ctx.cluster.describe(), text, ctx.unit, runs, time.perf_counter() - t0,
                    bound=next((p.bound for p in plans if p.bound is not None), None))
        best = case.best()
        self.say(f"{model} on {ctx.cluster.describe()}: {len(runs)} plans simulated in {case.seconds:.0f} s"
                 + (f"; best simulated {best.label} {best.simulated:,.4g} {case.unit}" if best else ""))
        return case

    def offline_case(self, model: str, pair: str) -> Case:
        """Every policy on one GPU of each type of ``pair`` (cached: network and two-gpus reuse it)."""
        key = (model, pair)
        if key not in self._offline:
            case = self.compare_case(model, self.pair_cluster(pair), pair)
            case.expensive = self.expensive(pair)
            alone = case.run("homogeneous", case.expensive)
            base = alone.per_cost if alone is not None and alone.ok else None
            for r in case.runs:
                if base and r.per_cost is not None:
                    r.per_cost_vs_expensive = r.per_cost / base
            self._offline[key] = case
        return self._offline[key]

    # -- items ---------------------------------------------------------------------------------------------

    def timed(self, section: str, t0: float) -> None:
        self.section_seconds[section] = self.section_seconds.get(section, 0.0) + time.perf_counter() - t0

    def run_task(self, task: Task) -> TaskResult:
        """One task's items, each skipped when the deadline has passed before it starts."""
        out = TaskResult(task)
        t_start = time.perf_counter()
        cfg = self.config
        if task.kind == "pairs":
            for pair in task.pairs:
                if not self.out_of_time(f"offline {task.model} on {pair}"):
                    t0 = time.perf_counter()
                    out.offline.append(self.offline_case(task.model, pair))
                    self.timed("offline", t0)
            for pair in task.two_pairs:
                if not self.out_of_time(f"two-gpus {task.model} on {pair}"):
                    t0 = time.perf_counter()
                    out.two_gpus.append(self.pair_vs_two(task.model, pair))
                    self.timed("two-gpus", t0)
            if task.bandwidths:
                t0 = time.perf_counter()
                out.network = self.network_case(task.model, task.bandwidths)
                self.timed("network", t0)
        elif task.kind == "online":
            if not self.out_of_time(f"online {task.model} on {cfg.online_pair}"):
                t0 = time.perf_counter()
                out.online = self.online_case(task.model)
                self.timed("online", t0)
        elif not self.out_of_time(f"cluster {task.cluster} with {task.model}"):
            t0 = time.perf_counter()
            out.cluster = self.compare_case(task.model, task.cluster, task.cluster)
            self.timed("clusters", t0)
        out.skipped, self.skipped = self.skipped, []
        out.section_seconds, self.section_seconds = self.section_seconds, {}
        out.seconds = time.perf_counter() - t_start
        return out

    def online_case(self, model: str) -> OnlineCase:
        cfg = self.config
        t0 = time.perf_counter()
        text = f"poisson:rate=1,lengths={cfg.online_lengths},requests={cfg.online_requests}"
        ctx = self.context(model, self.pair_cluster(cfg.online_pair), text)
        if ctx.unit != "tokens/s":
            raise SuiteError(f"online: {model} does not generate tokens; the online section is for text models")
        mean_out = float(sum(ctx.workload.lengths.outputs) / len(ctx.workload.lengths.outputs))
        case = OnlineCase(model, cfg.online_pair, ctx.cluster.describe(), text, [], mean_output=mean_out,
                          expensive=self.expensive(cfg.online_pair))
        problem = self._probe(ctx, case.expensive, mean_out)
        if problem:  # the same failure would repeat for every policy: no need to plan them
            case.status, case.reason = "failed", problem
            case.seconds = time.perf_counter() - t0
            self.say(f"online {model}: the simulator cannot serve these requests ({problem})")
            return case
        plans = self.plans(ctx)
        runs = [self._sustained(ctx, p, mean_out) for p in plans]
        case.runs = runs
        self._fixed_rate(case)
        for r, p in zip(runs, plans, strict=True):
            if r.status == "ok" and case.fixed_rate:
                r.at_fixed = self._at_rate(ctx, p, case.fixed_rate).summary()
        case.seconds = time.perf_counter() - t0
        top = max((r for r in runs if r.sustained_rps), key=lambda r: r.sustained_rps, default=None)
        self.say(f"online {model}: {sum(len(r.samples) for r in runs)} simulations in {case.seconds:.0f} s"
                 + (f"; highest sustained rate {top.label} {_rate(top.sustained_rps)} req/s" if top else ""))
        return case

    def _probe(self, ctx, device: str, mean_out: float) -> str | None:
        """Why the simulator cannot serve the online requests at all (tried with ``device`` alone at a low
        rate; its step timings are kept for the homogeneous plan that follows), or None."""
        from tessera.plan.planner import plan_policy

        try:
            plan = plan_policy(ctx, "homogeneous", device=device)
            if not (plan.applicable and plan.feasible):
                return None
            self._at_rate(ctx, plan, max(1e-3, 0.3 * plan.throughput / max(mean_out, 1.0)))
        except TesseraError as e:
            return str(e)
        return None

    def _at_rate(self, ctx, plan, rate: float):
        from tessera.sim.requests import simulate
        from tessera.workload import PoissonWorkload

        w = PoissonWorkload(rate, ctx.workload.lengths, self.config.online_requests)
        return simulate(ctx, plan, seed=self.config.seed, workload=w, engine_shapes=True)

    def _sustained(self, ctx, plan, mean_out: float) -> OnlineRun:
        """Bisection on the Poisson rate (geometric): bracket the target within a factor of 2 from the
        planner's estimate, then halve the bracket ``bisection_steps`` times (in log space). The same seed at
        every rate scales one arrival pattern, so the latency grows with the rate. A rate above the plan's
        capacity (planned throughput / mean output) misses without a simulation."""
        run = OnlineRun(plan.policy, plan.device, "ok", plan.reason)
        if not plan.applicable:
            run.status = "n/a"
            return run
        run.planned = plan.throughput
        if not plan.feasible:
            run.status = "no fit"
            return run
        target = self.config.latency_target_s
        capacity = plan.throughput / max(mean_out, 1.0)  # requests/s the deployment processes in the steady state

        def meets(rate: float) -> bool:
            if rate > capacity * (1 + 1e-9):  # a short burst fits the engines' slots and may meet the target, but
                return False  # no deployment keeps up with more requests than it processes
            res = self._at_rate(ctx, plan, rate)
            run.samples.append((rate, res.norm_latency_s))
            return res.completed > 0 and res.norm_latency_s <= target

        try:
            lo = hi = None
            rate = max(1e-3, 0.6 * capacity)
            for _ in range(8):
                if meets(rate):
                    lo = rate
                    if hi is not None:
                        break
                    rate *= 2
                else:
                    hi = rate
                    if lo is not None:
                        break
                    rate /= 2
            if lo is not None and hi is not None:
                for _ in range(self.config.bisection_steps):
                    mid = math.sqrt(lo * hi)
                    if meets(mid):
                        lo = mid
                    else:
                        hi = mid
        except TesseraError as e:
            run.status, run.reason = "failed", str(e)
            return run
        run.sustained_rps, run.bracket = lo, (lo, hi)
        run.samples.sort()
        return run

    @staticmethod
    def _fixed_rate(case: OnlineCase) -> None:
        """The rate the tails are compared at: what the pair's expensive GPU alone sustains (two significant
        figures, rounded down); else half the highest sustained rate."""
        rates = [(r, r.sustained_rps) for r in case.runs if r.sustained_rps]
        if not rates:
            return
        alone = next((v for r, v in rates if r.policy == "homogeneous" and r.device == case.expensive), None)
        if alone:
            rule = f"the rate {case.expensive} alone sustains, rounded down to two significant figures"
        else:
            alone = 0.5 * max(v for _, v in rates)
            rule = "half the highest sustained rate, rounded down to two significant figures"
        digits = 1 - math.floor(math.log10(alone))
        case.fixed_rate = math.floor(alone * 10 ** digits) / 10 ** digits
        case.fixed_rate_rule = rule

    def network_case(self, model: str, bandwidths: tuple[float, ...]) -> NetworkCase:
        """Every policy re-planned and simulated at each inter-node bandwidth; the shorthand's own 200 Gb/s
        is the offline case when this process computed it."""
        from tessera.hardware.cluster import DEFAULT_NETWORK_GBPS

        cfg = self.config
        text = self.workload_for(model)
        case = NetworkCase(model, cfg.network_pair, text, "", expensive=self.expensive(cfg.network_pair))
        default = DEFAULT_NETWORK_GBPS["ib"]
        ref = None
        for gbps in sorted(bandwidths, key=lambda g: (g != default, g)):  # the shorthand's own network first
            if self.out_of_time(f"network {model} at {gbps:g} Gb/s"):
                case.skipped.append(gbps)
                continue
            if gbps == default:
                c = ref = self.offline_case(model, cfg.network_pair)
            else:
                c = self.compare_case(model, self.pair_cluster(cfg.network_pair, gbps), cfg.network_pair, text,
                                      same_nodes=ref)
            case.points[float(gbps)] = c.runs
            case.unit = c.unit
        case.points = dict(sorted(case.points.items()))
        return case

    def pair_vs_two(self, model: str, pair: str) -> PairVsTwo:
        from tessera.plan.planner import plan_policy

        exp = self.expensive(pair)
        pair_case = self.offline_case(model, pair)
        ctx = self.context(model, f"{exp}:2", self.workload_for(model))
        try:
            two = self.simulate_plan(ctx, plan_policy(ctx, "homogeneous", device=exp))
        except TesseraError as e:
            two = PolicyRun("homogeneous", exp, "failed", str(e))
        best = pair_case.best()
        mine = pair_case.tessera or best
        entry = PairVsTwo(model, pair, exp, pair_case.unit, two, mine, best)
        problems = [f"{name}: {r.status} ({r.reason})" for name, r in
                    ((f"{exp}:2", two), (f"{pair} {mine.label if mine else ''}", mine))
                    if r is not None and not r.ok]
        if mine is None:
            problems.append(f"no plan on {pair} could be simulated")
        if problems:
            entry.status, entry.reason = "incomplete", "; ".join(problems)
        self.say(f"{model}: {pair} vs {exp}:2"
                 + (f": {mine.label} {mine.simulated / two.simulated:.2f}x the throughput"
                    if entry.status == "ok" else f": {entry.reason}"))
        return entry


@dataclass(frozen=True)
class Task:
    """A unit of parallel work: one model's items that share traced graphs and offline cases.

    ``pairs``: offline cases on each pair, then ``two_pairs`` (the pair against two of its expensive GPU)
    and the network sweep at ``bandwidths``; ``online``: the model's online case; ``cluster``: every policy
    on ``cluster``."""

    kind: str  # pairs | online | cluster
    model: str
    pairs: tuple[str, ...] = ()
    two_pairs: tuple[str, ...] = ()
    bandwidths: tuple[float, ...] = ()
    cluster: str = ""

    def weight(self) -> float:
        """A rough cost, to start the longest tasks first."""
        from tessera.capture.models import resolve_model

        params = (resolve_model(self.model).params or 1e9) / 1e9
        if self.kind == "cluster":
            from tessera.hardware.cluster import parse_cluster

            return (10 + len(parse_cluster(self.cluster).devices)) * max(1.0, math.log2(1 + params))
        if self.kind == "online":
            return 8.0
        return 10.0 * len(self.pairs) + 2.0 * len(self.two_pairs) + 4.0 * len(self.bandwidths)


@dataclass
class TaskResult:
    task: Task
    offline: list[Case] = field(default_factory=list)
    two_gpus: list[PairVsTwo] = field(default_factory=list)
    network: NetworkCase | None = None
    online: OnlineCase | None = None
    cluster: Case | None = None
    skipped: list[str] = field(default_factory=list)
    section_seconds: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def plan_tasks(config: SuiteConfig, sections: tuple[str, ...]) -> list[Task]:
    """The suite's work as tasks, longest first."""
    tasks = []
    two_models = config.two_gpu_models or config.models
    for model in dict.fromkeys([*config.models, *two_models, *config.network_models]):
        pairs = config.pairs if "offline" in sections and model in config.models else ()
        two = config.pairs if "two-gpus" in sections and model in two_models else ()
        bw = tuple(config.bandwidths_gbps) if "network" in sections and model in config.network_models else ()
        if pairs or two or bw:
            tasks.append(Task("pairs", model, tuple(pairs), tuple(two), bw))
    if "online" in sections:
        tasks += [Task("online", m) for m in config.online_models]
    if "clusters" in sections:
        tasks += [Task("cluster", m, cluster=spec) for m, spec in config.clusters]
    return sorted(tasks, key=lambda t: -t.weight())


_WORKER: Suite | None = None  # a worker process's suite: its graph caches live across the tasks it runs


def _worker_init(config: SuiteConfig, deadline: float, t0: float) -> None:
    global _WORKER
    import os as _os

    import torch

    torch.set_num_threads(1)  # one core per worker process
    _WORKER = Suite(config, default_progress)
    _WORKER.set_clock(deadline, t0)
    _WORKER.pid = _os.getpid()


def _worker_run(task: Task) -> TaskResult:
    assert _WORKER is not None
    return _WORKER.run_task(task)


def _assemble(config: SuiteConfig, sections: tuple[str, ...], results: list[TaskResult], started: str,
              seconds: float, jobs: int) -> SuiteResult:
    """The tasks' results in the suite's order."""
    result = SuiteResult(config, sections, machine_info(), started, jobs=jobs)
    pairs, models = list(config.pairs), list(config.models)
    two_models = list(config.two_gpu_models or config.models)
    result.offline = sorted((c for r in results for c in r.offline),
                            key=lambda c: (pairs.index(c.cluster), models.index(c.model)))
    result.two_gpus = sorted((e for r in results for e in r.two_gpus),
                             key=lambda e: (pairs.index(e.gpus), two_models.index(e.model)))
    result.network = sorted((r.network for r in results if r.network is not None),
                            key=lambda c: list(config.network_models).index(c.model))
    result.online = sorted((r.online for r in results if r.online is not None),
                           key=lambda c: list(config.online_models).index(c.model))
    order = list(config.clusters)
    result.clusters = sorted((r.cluster for r in results if r.cluster is not None),
                             key=lambda c: order.index((c.model, c.cluster)))
    for r in results:
        result.skipped += r.skipped
        for name, t in r.section_seconds.items():
            result.seconds[name] = result.seconds.get(name, 0.0) + t
    result.seconds["total"] = seconds
    return result


def run_suite(config: SuiteConfig, sections: tuple[str, ...] = SECTIONS, progress=None, detail=None,
              jobs: int = 1) -> SuiteResult:
    """Run the suite's sections. ``jobs`` > 1 runs its tasks in that many worker processes (which print their
    own progress lines on stderr); else they run here, with progress lines through ``progress`` and the
    planner's through ``detail``. Items that cannot start within ``config.budget_s`` are skipped."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    config.check()
    sections = check_sections(list(sections))
    if jobs < 1:
        raise SuiteError(f"jobs must be at least 1 (got {jobs})")
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.time()
    deadline = t0 + config.budget_s
    tasks = plan_tasks(config, sections)
    if jobs == 1 or len(tasks) == 1:
        suite = Suite(config, progress, detail)
        suite.set_clock(deadline, t0)
        results = [suite.run_task(t) for t in tasks]
    else:
        (progress or default_progress)(f"{len(tasks)} tasks on {min(jobs, len(tasks))} worker processes")
        with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=get_context("spawn"), initializer=_worker_init,
                                 initargs=(config, deadline, t0)) as pool:
            results = list(pool.map(_worker_run, tasks))
    return _assemble(config, sections, results, started, time.time() - t0, jobs)


def default_progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
