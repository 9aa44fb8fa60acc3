"""Request-route mixes: engines of different placements sharing one cluster, requests split between them.

A route is one engine's placement of every phase (a homogeneous engine on one device, prefill on one
device and decode on another, a kernel split over both...), at the batch its memory admits. Two routes
may share a device: one GPU prefilling for every request and decoding some of them itself, the other
GPU decoding the rest. Per request, a route occupies each device it uses for the cycle of every phase
placed there (``repeats / rows x cycle``; a phase's step holds its devices for its whole cycle, so two
routes' steps on one device take turns and never overlap) and each directed link for its transfers and
state moves. The mix sends ``rate_r`` requests per second to route r, as large as the devices allow:

    maximise sum_r rate_r   s.t.   sum_r rate_r x occupancy_r[d] <= 1 on every device and link,
                                   fill_r <= rate_r <= 1 / request time of r alone
                                   rate_r / sum of rates x requests >= batch_r   (a finite workload)

a small LP (HiGHS). Memory: the routes sharing a device hold their weights there once (when one route's
weights on it are a subset of the other's) and each its own state, and the sum must fit; routes that do
not fit together are not mixed. A finite workload must fill every route's engine (each route's share of the
requests at least the sequences it admits), or the route never runs the batch its costs assume; and a route
whose repeated phase another lane feeds (prefill on one device, decode on another) must be fed fast enough to
keep that batch full (``fill_r``, Little's law: :func:`fill_rates`), or its decode steps run at the rows that
have arrived and take more of the shared device than its full batch would.
Throughput is outputs per request x sum_r rate_r.

One engine (:func:`one_engine`): prefill on one device with decode on another, paired with the decode
device alone, is also weighed as a single engine that decodes every request and prefills a share of the
prompts itself: the same LP over the two routes' occupancies, but one decode batch (its state held once),
which the engine's own queue keeps full, so no fill rate and no finite-workload split apply.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import highspy
import numpy as np

from tessera.plan.deployment import DeploymentPlan, lanes

RATE_SLACK = 1e-6  # relative: what the LP's tolerances may add to a rate bound it was given


@dataclass
class Route:
    """One engine of a mix: its plan, and what one request costs it on each cluster target and link."""

    plan: DeploymentPlan
    occupancy: dict[str, float]  # cluster target name -> seconds per request
    links: dict[tuple[str, str], float] = field(default_factory=dict)  # (src, dst) -> seconds per request
    max_rate: float = 0.0  # requests/s of the route alone
    batch: int = 1  # sequences its engine admits (the repeated phase's rows)
    fed: bool = False  # its repeated phase has a lane of its own, fed by another lane (prefill elsewhere)
    repeats: float = 0.0  # steps of the repeated phase per request
    cycle_s: float = 0.0  # the repeated phase's cycle at ``batch``

    @property
    def name(self) -> str:
        return self.plan.policy + (f" ({self.plan.device})" if self.plan.device else "")


def route_of(plan: DeploymentPlan, objective: str = "throughput") -> Route | None:
    """The route of a single-engine plan (None for plans of several engines or without step plans)."""
    if plan.replicas != 1 or "replicas" in plan.extra or "routes" in plan.extra or not plan.feasible:
        return None
    steps = [s for s in plan.steps if s.objective == objective]
    if not steps or plan.request_time_s <= 0:
        return None
    occupancy: dict[str, float] = {}
    links: dict[tuple[str, str], float] = {}
    for s in steps:
        for t in s.used_targets:
            occupancy[plan.targets[t]] = occupancy.get(plan.targets[t], 0.0) + s.per_request * s.cycle_s
        for i, row in enumerate(s.link_s):
            for j, sec in enumerate(row):
                if sec > 0:
                    key = (plan.targets[i], plan.targets[j])
                    links[key] = links.get(key, 0.0) + s.per_request * sec
    for mv in plan.state_moves:
        key = (plan.targets[mv.src], plan.targets[mv.dst])
        links[key] = links.get(key, 0.0) + mv.seconds_per_request
    batch = plan.admission.max_seqs if plan.admission else max(s.batch for s in steps)
    main = max(steps, key=lambda s: s.repeats)
    lane = next(ln for ln in lanes(steps) if any(s is main for s in ln))
    return Route(plan, occupancy, links, 1.0 / plan.request_time_s, batch, len(lane) == 1 and len(steps) > 1,
                 main.repeats, main.cycle_s)


def fill_rates(routes: list[Route]) -> np.ndarray:
    """Per route, the requests/s that keep its repeated phase's batch full where a lane of its own runs it
    (prefill on another device feeding decode). By Little's law ``batch`` in flight need ``batch / dwell``
    arrivals per second; a request dwells ``repeats`` steps of the phase's cycle when its steps run back to
    back, as they do once the routes sharing its device have drained their share of a finite workload (the
    turns they take before that lengthen the dwell, but do not last). Fed more slowly, the engine's steps run
    at the rows that have arrived, at a higher cost per request than its full batch's. 0 where the repeated
    phase shares its lane with the prompt phases: such an engine admits from its own queue, which keeps its
    batch full while requests wait."""
    return np.array([r.batch / (r.repeats * r.cycle_s) if r.fed and r.repeats * r.cycle_s > 0 else 0.0
                     for r in routes])


def device_memory(routes: list[Route], name: str) -> tuple[float, float]:
    """(bytes needed, capacity) of cluster target ``name`` under the routes holding it: their weights (once
    where one route's weights there are a subset of another's), each route's state, the largest reserve."""
    parts = []
    for r in routes:
        if name not in r.plan.targets:
            continue
        i = r.plan.targets.index(name)
        mem = r.plan.extra.get("memory_parts")
        if mem is None:  # a plan from before memory parts were recorded: nothing is known to be shared
            parts.append((set(), 0.0, r.plan.memory_bytes[i], 0.0, r.plan.memory_capacity[i]))
            continue
        held = {item for item, where in r.plan.residency.items() if i in where and not item.startswith("cache")}
        parts.append((held, mem["weights"][i], r.plan.memory_bytes[i] - mem["weights"][i] - mem["reserve"],
                      mem["reserve"], r.plan.memory_capacity[i]))
    parts.sort(key=lambda p: -p[1])
    weights, items = parts[0][1], set(parts[0][0])
    for held, w, _, _, _ in parts[1:]:
        if not held <= items:
            weights += w
            items |= held
    return weights + sum(p[2] for p in parts) + max(p[3] for p in parts), min(p[4] for p in parts)


def fit_together(routes: list[Route]) -> bool:
    """Whether the routes' weights (once per device where one route's are a subset of another's) and their
    state fit every device they share."""
    for name in {t for r in routes for t in r.plan.targets}:
        need, capacity = device_memory(routes, name)
        if need > capacity * (1 + 1e-9):
            return False
    return True


def best_rates(routes: list[Route], requests: int | None = None) -> np.ndarray:
    """The LP's requests/s per route (see the module docstring). ``requests``: a finite workload's count;
    each route then gets at least the sequences its engine admits (share x requests >= its batch), since
    an engine a workload cannot fill never runs the batch its cost per request assumes."""
    devices = sorted({t for r in routes for t in r.occupancy})
    links = sorted({k for r in routes for k in r.links})
    n = len(routes)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    lower = fill_rates(routes)
    upper = np.array([r.max_rate for r in routes])
    if (lower > upper * (1 + 1e-9)).any():  # a route that cannot keep its own batch full
        return np.zeros(n)
    h.addVars(n, np.minimum(lower, upper), upper)
    h.changeColsCost(n, np.arange(n, dtype=np.int32), -np.ones(n))
    rows = [[r.occupancy.get(d, 0.0) for r in routes] for d in devices] + \
        [[r.links.get(k, 0.0) for r in routes] for k in links]
    for row in rows:
        idx = np.array([i for i, v in enumerate(row) if v > 0], dtype=np.int32)
        if len(idx):
            h.addRow(-highspy.kHighsInf, 1.0, len(idx), idx, np.array([row[i] for i in idx]))
    if requests is not None:  # requests x rate_r - batch_r x sum of rates >= 0
        for r, route in enumerate(routes):
            coef = -np.full(n, float(route.batch))
            coef[r] += requests
            h.addRow(0.0, highspy.kHighsInf, n, np.arange(n, dtype=np.int32), coef)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:  # e.g. no split fills both engines
        return np.zeros(n)
    return np.clip(np.array(h.getSolution().col_value[:n], dtype=float), 0.0, None)


def one_engine(a: Route, b: Route, objective: str = "throughput") -> list[Route] | None:
    """The two routes as one engine, [fed, local], when ``a`` and ``b`` (in either order) are prefill on one
    device with decode on another (``fed``) and the decode device alone (``local``), with the same decode
    step at the same admission: that engine decodes every request and prefills some itself while the other
    device prefills the rest. Its decode batch is one (state held once) and it keeps it full from its own
    queue, so neither route needs a fill rate of its own; None when the pair is not of that shape."""
    for fed, local in ((a, b), (b, a)):
        if not fed.fed or local.fed or local.plan.policy != "homogeneous" or len(local.occupancy) != 1:
            continue
        fed_main, local_main = (max((s for s in r.plan.steps if s.objective == objective), key=lambda s: s.repeats)
                                for r in (fed, local))
        decode_on = {fed.plan.targets[t] for t in fed_main.used_targets}
        if (decode_on != set(local.occupancy) or fed_main.graph_hash != local_main.graph_hash
                or fed_main.micro_batches != local_main.micro_batches or fed.batch != local.batch):
            continue
        return [replace(fed, fed=False), replace(local, fed=False)]
    return None


def best_mix(plans: list[DeploymentPlan], outputs_per_request: float, prices: dict[str, float],
             objective: str = "throughput", price_scenario: str = "relative",
             requests: int | None = None) -> DeploymentPlan | None:
    """The best mix of two routes among single-engine ``plans`` (None when no pair beats its better route):
    two engines sharing the cluster, or one engine whose decode device also prefills (:func:`one_engine`);
    ``prices``: each cluster target's price per hour; ``requests``: a finite workload's count, which must
    fill both routes' engines."""
    routes = [r for r in (route_of(p, objective) for p in plans) if r is not None]
    best, best_rate = None, 0.0
    for pair in itertools.combinations(routes, 2):
        if (pair[0].max_rate + pair[1].max_rate) * (1 + RATE_SLACK) < best_rate:
            continue  # each route runs at most its rate alone: this pair cannot beat the best so far
        forms = [(list(pair), requests, False)] if fit_together(list(pair)) else []
        joined = one_engine(*pair, objective)
        if joined is not None:  # one engine: a finite workload that fills it fills both routes
            forms.append((joined, None, True))
        for routes_, count, shared in forms:
            rates = best_rates(routes_, count)
            total = float(rates.sum())
            alone = max(r.max_rate for r in routes_)
            if total > alone * (1 + 1e-6) and rates.min() > 0 and total > best_rate:
                best, best_rate = (routes_, rates, shared), total
    if best is None:
        return None
    routes_, rates, shared = best
    return _mix_plan(routes_, rates, outputs_per_request, prices, objective, price_scenario, shared)


def one_engine_memory(routes: list[Route], name: str) -> tuple[float, float]:
    """(bytes needed, capacity) of cluster target ``name`` under routes that are one engine: the same weights
    and the same sequences' state, so the largest of the routes' needs there."""
    at = [(r.plan, r.plan.targets.index(name)) for r in routes if name in r.plan.targets]
    held = [(plan.memory_bytes[i], plan.memory_capacity[i]) for plan, i in at]
    return max(b for b, _ in held), min(c for _, c in held)


def _mix_plan(routes: list[Route], rates: np.ndarray, outputs: float, prices: dict[str, float], objective: str,
              price_scenario: str, shared: bool = False) -> DeploymentPlan:
    """The deployment plan of routes at ``rates`` (requests/s): every route's step plans (tagged with their
    route), memory per device; ``shared``: the routes are one engine (each route's ``engine`` is 0; else its
    own index)."""
    first = routes[0].plan
    held = {t for r in routes for t in r.plan.targets}
    names = [t for t in prices if t in held] + sorted(held - set(prices))  # the cluster's order
    memory_of = one_engine_memory if shared else device_memory
    memory, capacity = (list(x) for x in zip(*(memory_of(routes, name) for name in names), strict=True))
    total = float(rates.sum())
    shares = rates / total
    plan = DeploymentPlan(
        model=first.model, cluster=first.cluster, workload=first.workload, policy="tessera", applicable=True,
        feasible=True, targets=names, replicas=1, memory_bytes=memory, memory_capacity=capacity, unit=first.unit,
        throughput=total * outputs, price_scenario=price_scenario,
        latency_s=max(r.plan.latency_s for r in routes), ttft_s=max(r.plan.ttft_s for r in routes),
        request_time_s=1.0 / total, bottleneck=_bottleneck(routes, rates),
        reason=("one engine: " if shared else "route mix: ") + ", ".join(
            f"{s:.0%} of requests {_describe(r)}" for r, s in zip(routes, shares, strict=True)))
    used = {t for r in routes for s in r.plan.steps if s.objective == objective
            for t in (r.plan.targets[i] for i in set(s.assignment))}
    plan.cost_per_hour = sum(prices[t] for t in used)
    for k, r in enumerate(routes):
        offset = {i: names.index(t) for i, t in enumerate(r.plan.targets)}
        for s in r.plan.steps:
            plan.steps.append(type(s)(**{**s.__dict__, "solver": dict(s.solver, route_of=k, target_map=[
                offset[i] for i in range(len(r.plan.targets))])}))
    plan.extra["routes"] = [dict(r.plan.summary(), rate=float(rates[k]), share=float(shares[k]),
                                 route=_describe(r), throughput=float(rates[k]) * outputs, engine=0 if shared else k,
                                 residency=r.plan.residency, state_moves=[m.__dict__ for m in r.plan.state_moves])
                            for k, r in enumerate(routes)]
    return plan


def _describe(r: Route) -> str:
    return f"on {r.name}" + (f" ({r.plan.reason})" if r.plan.reason and r.plan.policy != "homogeneous" else "") + \
        (f", an engine of {r.batch} sequences" if "smaller_engine_of" in r.plan.extra else "")


def _bottleneck(routes: list[Route], rates: np.ndarray) -> str:
    load: dict[str, float] = {}
    for r, rate in zip(routes, rates, strict=True):
        for t, sec in r.occupancy.items():
            load[t] = load.get(t, 0.0) + rate * sec
    busy = [t for t, v in load.items() if v >= 1 - 1e-6]
    return "compute on " + " and ".join(sorted(busy)) if busy else "each route's own cycle"
