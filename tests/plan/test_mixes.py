"""Request-route mixes: two engines of different placements sharing a cluster, rates from the LP, memory
per shared device, and the simulator running them with their steps taking turns on the shared device."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.hardware.cluster import parse_cluster
from tessera.plan.admission import round_batch
from tessera.plan.context import PlanContext
from tessera.plan.deployment import DeploymentPlan, EngineAdmission, StepPlan
from tessera.plan.mixes import Route, best_mix, best_rates, fill_rates, fit_together, one_engine, route_of
from tessera.plan.planner import compare, with_bound
from tessera.plan.policies import (
    MIN_ROUTE_BATCH,
    MIX_MIN_GAIN,
    ROUTE_BATCH_SHARES,
    adopt_mix,
    prefill_decode_plans,
    route_mix,
    smaller_engines,
)
from tessera.sim.requests import arrivals, engines_for, run_requests, simulate
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


def _step(phase: str, assignment: list[int], repeats: float, rows: int, cycle_s: float) -> StepPlan:
    return StepPlan(phase, "throughput", rows, 1, repeats, rows, f"graph-{phase}-{rows}", assignment, cycle_s, cycle_s,
                    [], [], 0, 0.0)


def _engine(policy: str, targets: list[str], steps: list[StepPlan], request_s: float, device: str | None = None):
    plan = _plan(targets, [1.0] * len(targets), [0.5] * len(targets), {}, [2.0] * len(targets))
    plan.policy, plan.device, plan.steps, plan.request_time_s = policy, device, steps, request_s
    plan.admission = EngineAdmission(10, None, 16, "max_num_seqs")
    return plan


def test_one_engine_decodes_every_request_and_prefills_what_the_other_device_cannot_by_hand():
    # prefill-decode: prefill on L 0.4 s a prompt, decode on A 100 steps of 0.02 s at 10 rows (0.2 s of A per
    # request): L-bound at 2.5 requests/s, A busy half the time, and its decode batch needs 10 / (100 x 0.02)
    # = 5 requests/s to stay full, so as two engines it is never mixed. A alone: 0.1 s prefill + 0.2 s decode.
    # One engine: L prefills 2.5/s, A's other half prefills and decodes (1 - 0.5) / 0.3 = 5/3 more
    pd = _engine("prefill-decode", ["A", "L"], [_step("prefill", [1, 1], 1, 1, 0.4), _step("decode", [0, 0], 100, 10,
                                                                                          0.02)], 0.4)
    alone = _engine("homogeneous", ["A"], [_step("prefill", [0], 1, 1, 0.1), _step("decode", [0, 0], 100, 10, 0.02)],
                    0.3, "A")
    routes = one_engine(route_of(pd), route_of(alone))
    assert routes is not None and [r.plan for r in routes] == [pd, alone] and not any(r.fed for r in routes)
    assert best_rates([route_of(pd), route_of(alone)]).sum() == 0  # two engines: pd's batch is never full
    assert best_rates(routes) == pytest.approx([2.5, 5 / 3])
    mix = best_mix([pd, alone], 100.0, {"A": 2.0, "L": 1.0}, requests=1000)
    assert mix.throughput == pytest.approx(100 * (2.5 + 5 / 3)) and mix.reason.startswith("one engine: 60% of")
    assert [r["engine"] for r in mix.extra["routes"]] == [0, 0]
    assert mix.memory_bytes == [1.0, 1.0]  # one engine's weights and state, not two engines'
    # another decode step (another graph) or another admission is not the same engine
    alone.steps[1] = _step("decode", [0, 0], 100, 8, 0.02)
    assert one_engine(route_of(pd), route_of(alone)) is None
    assert best_mix([pd, alone], 100.0, {"A": 2.0, "L": 1.0}) is None


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


MARGIN = 0.10  # above this case's planned mix gain (about 5%), so Tessera declines the mix


@pytest.fixture(scope="module")
def smollm2_mix():
    ctx = PlanContext("smollm2-135m", parse_cluster("A100:1,L40S:1"), parse_workload(WORKLOAD), WORKLOAD,
                      mix_min_gain=MARGIN)
    plans = compare(ctx)
    return ctx, plans, route_mix(ctx, "throughput", plans)


def test_a_mix_of_routes_beats_every_baseline_and_tessera_adopts_it_only_past_the_margin(smollm2_mix):
    ctx, plans, tess = smollm2_mix
    routes = tess.extra.get("routes")
    assert routes and len(routes) == 2 and [r["engine"] for r in routes] == [0, 1], tess.reason
    best = max(p.throughput for p in plans[:-1] if p.feasible)
    assert best * 1.01 < tess.throughput < best * (1 + MARGIN)
    # below the margin Tessera keeps the best single engine and says what it did not adopt
    assert plans[-1].throughput == best and "routes" not in plans[-1].extra
    assert plans[-1].summary()["mix_declined"] == plans[-1].extra["mix_declined"] == (f"{tess.reason} planned {tess.throughput / best - 1:+.1%}, below the 10% "
                                               "a mix must gain over one engine (--mix-min-gain)")
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
    ctx, _, tess = smollm2_mix
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
    ctx, plans, _ = smollm2_mix
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


def test_a_lower_margin_adopts_the_mix_and_its_plan_names_three_engines_on_two_devices(smollm2_mix, tmp_path):
    ctx, plans, mix = smollm2_mix
    single = DeploymentPlan(**{**plans[-1].__dict__, "extra": {}})
    ctx.mix_min_gain = 0.0
    try:
        tess = adopt_mix(ctx, single, mix)
        assert adopt_mix(ctx, single, None) is single
        ctx.mix_min_gain = 0.5
        assert adopt_mix(ctx, single, mix) is single and "(--mix-min-gain)" in single.extra["mix_declined"]
    finally:
        ctx.mix_min_gain = MARGIN
    assert tess is mix and tess.extra["routes"]
    (tess,) = with_bound(ctx, [tess])  # as the planner finishes every plan: the bound and the engine layout
    layout = tess.layout
    engines = {e.name: e for e in layout.engines}
    assert set(engines) == {"whole@L40S", "prefill@L40S", "decode@A100"}
    assert engines["prefill@L40S"].kv_role == "kv_producer" and engines["decode@A100"].kv_role == "kv_consumer"
    assert engines["whole@L40S"].kv_role is None and engines["decode@A100"].devices == ("A100:0",)
    # two engines on the L40S share its memory in proportion to what each holds; the A100's is its own
    on_l40s = [e.memory_fraction for e in layout.engines if e.targets == ("L40S",)]
    assert sum(on_l40s) == pytest.approx(0.9, abs=1e-3) and engines["decode@A100"].memory_fraction == 0.9
    shares = {r.hops: r.share for r in layout.routes}
    planned = {r["policy"]: r["share"] for r in tess.extra["routes"]}
    assert shares == {("whole@L40S",): pytest.approx(planned["homogeneous"]),
                      ("prefill@L40S", "decode@A100"): pytest.approx(planned["prefill-decode"])}
    # each route carries its own plan's request latency (what the router's latency shares pick by)
    latency = {r.hops: r.latency_s for r in layout.routes}
    planned_latency = {r["policy"]: r["latency_s"] for r in tess.extra["routes"]}
    assert latency == {("whole@L40S",): planned_latency["homogeneous"],
                       ("prefill@L40S", "decode@A100"): planned_latency["prefill-decode"]}
    assert layout.runnable_on == ("vllm",)  # Tessera's runtime does not run mixes (yet)
    again = DeploymentPlan.load(tess.save(tmp_path / "mix.json"))
    assert again.layout == layout


def test_each_baseline_names_its_engines(smollm2_mix):
    _, plans, _ = smollm2_mix
    by = {p.policy + (f" ({p.device})" if p.device else ""): p.layout for p in plans}
    rd = by["request-dist"]
    assert [e.name for e in rd.engines] == ["whole@A100", "whole@L40S"] and rd.runnable_on == ("vllm", "tessera")
    assert sum(r.share for r in rd.routes) == pytest.approx(1.0) and rd.routes[0].share > rd.routes[1].share
    pd = by["prefill-decode"]
    assert [r.hops for r in pd.routes] == [tuple(e.name for e in pd.engines)] and pd.routes[0].share == 1.0
    assert [e.roles for e in pd.engines] == [("prefill",), ("decode",)]
    for policy in ("attention-ffn", "layer-pipeline"):
        (split,) = by[policy].engines
        assert split.roles == ("split",) and split.targets == ("A100", "L40S") and not split.runs_on_vllm
        assert by[policy].runnable_on == ("tessera",)
    assert [e.name for e in by["homogeneous (A100)"].engines] == ["whole@A100"]


def test_every_prefill_decode_orientation_is_offered_and_the_baseline_is_the_best(smollm2_mix):
    ctx, plans, _ = smollm2_mix
    both = prefill_decode_plans(ctx, "throughput")
    assert sorted(p.reason for p in both) == ["prefill on A100, decode on L40S", "prefill on L40S, decode on A100"]
    baseline = next(p for p in plans if p.policy == "prefill-decode")
    assert baseline.throughput == max(p.throughput for p in both) and baseline.reason in {p.reason for p in both}


def test_tessera_adopts_one_engine_past_the_margin_and_the_simulator_keeps_its_decode_lane_to_its_share():
    # short outputs: the L40S's prefills cannot keep the A100's decode batch full, so the A100 prefills some
    work = "offline:prompts=azure-conv,out=64,requests=1000"
    ctx = PlanContext("smollm2-135m", parse_cluster("A100:1,L40S:1"), parse_workload(work), work)
    plans = compare(ctx)
    tess = plans[-1]
    assert tess.reason.startswith("one engine: ") and [r["engine"] for r in tess.extra["routes"]] == [0, 0]
    # one engine decodes for the L40S's prefills and serves its own share whole
    assert [(e.name, e.kv_role) for e in tess.layout.engines] == [("prefill@L40S", "kv_producer"),
                                                                   ("decode/whole@A100", "kv_consumer")]
    assert sorted(r.hops for r in tess.layout.routes) == [("decode/whole@A100",), ("prefill@L40S", "decode/whole@A100")]
    assert tess.throughput >= max(p.throughput for p in plans[:-1] if p.feasible) * (1 + MIX_MIN_GAIN)
    assert tess.bound >= tess.throughput  # the bound's fractional split holds this engine's too
    (engine,) = engines_for(ctx, tess, engine_shapes=True)
    prefill_lane, decode_lane = engine.lanes
    assert (prefill_lane.phases, decode_lane.phases) == ({"prefill"}, {"prefill", "decode"})
    assert prefill_lane.delays["decode"] > 0 and decode_lane.delays.get("decode", 0.0) == 0  # KV moves from L40S
    # the decode lane's planned share of its time on prompts: its route's rate x its prefill cycle
    local = next(k for k, r in enumerate(tess.extra["routes"]) if r["policy"] == "homogeneous")
    prefill = next(s for s in tess.steps if s.solver["route_of"] == local and s.phase == "prefill")
    assert prefill_lane.share is None
    assert decode_lane.share == pytest.approx(tess.extra["routes"][local]["rate"] * prefill.per_request * prefill.cycle_s)
    done = run_requests([engine], arrivals(ctx.workload))
    assert all(r.finish_s is not None and r.generated == r.output for r in done)
    end = max(r.finish_s for r in done)
    assert prefill_lane.prompts + decode_lane.prompts >= len(done) and min(prefill_lane.prompts, decode_lane.prompts) > 0
    longest = max(r.busy_s for r in done)  # no step of a request is longer than its whole time in steps
    assert decode_lane.prompt_s <= decode_lane.share * end + longest
