"""Request-route mixes: two engines of different placements sharing a cluster, rates from the LP, memory
per shared device, and the simulator running them with their steps taking turns on the shared device."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.hardware.cluster import parse_cluster
from tessera.plan.admission import round_batch
from tessera.plan.context import PlanContext
from tessera.plan.deployment import DeploymentPlan
from tessera.plan.mixes import Route, best_rates, fill_rates, fit_together, route_of
from tessera.plan.planner import compare
from tessera.plan.policies import MIN_ROUTE_BATCH, ROUTE_BATCH_SHARES, prefill_decode_plans, smaller_engines
from tessera.sim.requests import simulate
from tessera.workload import parse_workload

WORKLOAD = "offline:prompts=azure-conv,out=256,requests=1000"  # enough requests to fill both engines


def _plan(targets, memory, weights, residency, capacity) -> DeploymentPlan:
    return DeploymentPlan(model="m", cluster="c", workload="w", policy="p", applicable=True, targets=targets,
                          memory_bytes=memory, memory_capacity=capacity, residency=residency,
                          extra={"memory_parts": {"weights": weights, "reserve": 1.0}})


def test_the_lp_fills_the_shared_device_by_hand():
    # prefill-decode: 0.25 s of A per request (decode), 0.1 s of L (prefill), at most 4 requests/s alone;
    # L alone: 0.6 s of L per request. A is full at 4/s; L has 1 - 0.4 left: 0.6 / 0.6 = 1 request/s more
    pd = Route(_plan(["A", "L"], [0, 0], [0, 0], {}, [1, 1]), {"A": 0.25, "L": 0.1}, {("L", "A"): 0.01}, 4.0)
    alone = Route(_plan(["L"], [0], [0], {}, [1]), {"L": 0.6}, {}, 1 / 0.6)
    assert best_rates([pd, alone]) == pytest.approx([4.0, 1.0])
    # a busy link caps the mix too: 0.5 s of the link per prefill-decode request
    pd.links[("L", "A")] = 0.5
    assert best_rates([pd, alone]) == pytest.approx([2.0, (1 - 0.2) / 0.6])
    # 100 requests must fill both engines: L alone admits 60, so it takes at least 60% of the requests;
    # 0.1 rate_pd + 0.6 rate_l <= 1 with rate_l = 1.5 rate_pd: rate_pd = 1 / 1.0, rate_l = 1.5
    pd.links[("L", "A")] = 0.01
    pd.batch, alone.batch = 10, 60
    assert best_rates([pd, alone], requests=100) == pytest.approx([1.0, 1.5])
    alone.batch = 95  # 10 + 95 > 100: no split fills both
    assert best_rates([pd, alone], requests=100).sum() == 0


def test_a_route_fed_by_another_lane_must_be_fed_fast_enough_to_fill_its_batch():
    # prefill-decode whose decode lane runs 10 rows per 0.05 s step, 100 steps a request: a request dwells
    # 5 s, so 10 in flight need 2 requests/s (Little's law); the L-alone route admits from its own queue
    pd = Route(_plan(["A", "L"], [0, 0], [0, 0], {}, [1, 1]), {"A": 0.5, "L": 0.1}, {}, 4.0, 10, True, 100.0, 0.05)
    alone = Route(_plan(["L"], [0], [0], {}, [1]), {"L": 0.6}, {}, 1 / 0.6, 4)
    assert fill_rates([pd, alone]) == pytest.approx([2.0, 0.0])
    # alone the L route would take L's whole time; the mix must still feed the decode lane 2 requests/s:
    # rate_pd = 2 at least, A has room for exactly 2, L's rest (1 - 0.2) / 0.6 goes to the L route
    assert best_rates([pd, alone]) == pytest.approx([2.0, 0.8 / 0.6])
    pd.cycle_s = 0.01  # a dwell of 1 s needs 10 requests/s, more than the route's own 4: never mixed
    assert best_rates([pd, alone]).tolist() == [0.0, 0.0]


def test_routes_share_weights_once_and_must_fit_their_state():
    w = {"w1": [0], "w2": [0]}
    a = _plan(["L"], [10.0], [6.0], w, [20.0])  # 6 weights + 3 state + 1 reserve
    b = _plan(["L", "A"], [8.0, 5.0], [6.0, 0.0], w, [20.0, 30.0])  # the same weights, 1 state + 1 reserve
    ra, rb = (Route(p, {}, {}, 1.0) for p in (a, b))
    assert fit_together([ra, rb])  # 6 + 3 + 1 + 1 = 11 <= 20
    a.memory_capacity = [10.5]
    assert not fit_together([ra, rb])
    a.memory_capacity = [20.0]
    b.residency = {"w3": [0]}  # other weights: held twice, 6 + 6 + 3 + 1 + 1 = 17 <= 20
    assert fit_together([ra, rb])
    b.extra["memory_parts"]["weights"] = [10.0, 0.0]
    b.memory_bytes = [12.0, 5.0]
    assert not fit_together([ra, rb])  # 6 + 10 + 3 + 1 + 1 = 21 > 20


@pytest.fixture(scope="module")
def smollm2_mix():
    ctx = PlanContext("smollm2-135m", parse_cluster("A100:1,L40S:1"), parse_workload(WORKLOAD), WORKLOAD)
    return ctx, compare(ctx)


def test_tessera_mixes_routes_where_that_beats_every_baseline(smollm2_mix):
    ctx, plans = smollm2_mix
    tess = plans[-1]
    routes = tess.extra.get("routes")
    assert routes and len(routes) == 2, tess.reason
    best = max(p.throughput for p in plans[:-1] if p.feasible)
    assert tess.throughput > best * 1.01
    rates = np.array([r["rate"] for r in routes])
    assert tess.throughput == pytest.approx(ctx.outputs_per_request * rates.sum())
    assert sum(r["share"] for r in routes) == pytest.approx(1.0)
    assert all(r["share"] * 1000 >= r["admission"]["max_seqs"] * (1 - 1e-6) for r in routes)  # engines filled
    # no device is busier than all the time: each route occupies its devices for its phases' cycles
    load: dict[str, float] = {}
    for s in tess.steps:
        k = s.solver["route_of"]
        if s.objective == "throughput":
            for t in set(s.assignment):
                name = routes[k]["targets"][t]
                load[name] = load.get(name, 0.0) + rates[k] * s.per_request * s.cycle_s
    assert max(load.values()) <= 1 + 1e-6 and min(load.values()) > 0.5
    assert all(m <= c * (1 + 1e-9) for m, c in zip(tess.memory_bytes, tess.memory_capacity, strict=True))
    assert {s.solver["route_of"] for s in tess.steps} == {0, 1}


def test_the_simulator_runs_a_mix_with_its_routes_taking_turns(smollm2_mix):
    ctx, plans = smollm2_mix
    tess = plans[-1]
    routes = tess.extra["routes"]
    shared = [t for t in routes[0]["targets"] if t in routes[1]["targets"]]
    assert len(shared) == 1
    # which engine's phases run on the shared device
    on_shared: dict[str, set[str]] = {}
    for s in tess.steps:
        r = routes[s.solver["route_of"]]
        if s.objective == "throughput" and shared[0] in {r["targets"][t] for t in s.assignment}:
            on_shared.setdefault(r["policy"] + (f" ({r['device']})" if r["device"] else ""), set()).add(s.phase)
    result = simulate(ctx, tess, engine_shapes=True)
    assert result.completed == 1000 and result.rejected == 0
    busy = {k: v for k, v in result.lane_busy_s.items()
            if any(k.split(":")[0] == e and set(k.split(":")[1].split("+")) & ph for e, ph in on_shared.items())}
    assert len(busy) == 2 and min(busy.values()) > 0, result.lane_busy_s  # both engines ran on it, never at once
    assert sum(busy.values()) <= result.makespan_s * (1 + 1e-9)


def test_smaller_engines_keep_the_placement_and_admit_their_batch(smollm2_mix):
    ctx, plans = smollm2_mix
    for plan in (next(p for p in plans if p.policy == "prefill-decode"), next(p for p in plans if p.device == "A100")):
        full = plan.admission.max_seqs
        small = smaller_engines(ctx, plan, "throughput")
        want = sorted({round_batch(int(full * f), 1) for f in ROUTE_BATCH_SHARES} - {full}, reverse=True)
        assert [v.admission.max_seqs for v in small] == [b for b in want if b >= MIN_ROUTE_BATCH]
        for v in small:
            assert v.policy == plan.policy and v.device == plan.device and v.targets == plan.targets
            assert v.extra["smaller_engine_of"] == full and "smaller engine" in v.admission.limited_by
            for s in v.steps:  # the same placement, at the smaller batch
                same = plan.step(s.phase, s.objective)
                assert s.assignment == same.assignment
                assert s.batch == (v.admission.max_seqs if s.phase == "decode" else same.batch)
            # a smaller engine costs more per request: weights and launches amortised over fewer rows
            assert v.throughput < plan.throughput
            assert route_of(v).batch == v.admission.max_seqs
            # prefill on one device feeds decode on the other: a route whose batch its arrivals must fill
            assert route_of(v).fed == (plan.policy == "prefill-decode")
            assert all(m <= f for m, f in zip(v.memory_bytes, plan.memory_bytes, strict=True))
    assert smaller_engines(ctx, next(p for p in plans if p.policy == "request-dist"), "throughput") == []


def test_every_prefill_decode_orientation_is_offered_and_the_baseline_is_the_best(smollm2_mix):
    ctx, plans = smollm2_mix
    both = prefill_decode_plans(ctx, "throughput")
    assert sorted(p.reason for p in both) == ["prefill on A100, decode on L40S", "prefill on L40S, decode on A100"]
    baseline = next(p for p in plans if p.policy == "prefill-decode")
    assert baseline.throughput == max(p.throughput for p in both) and baseline.reason in {p.reason for p in both}
