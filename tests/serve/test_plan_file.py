"""`tessera serve --plan FILE` on Tessera's own engine: a route mix's routes are engines on the shared workers
(each with its own rows, requests dealt by the plan's shares, lanes taking whole turns on a shared worker);
other policies' plans are served as one route, or one per request-dist replica; bad plan files and options
are refused before serving, saying what to do."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tessera.errors import TesseraError
from tessera.serve.config import ServeConfig, ServeOptionError
from tessera.serve.dealing import DealtRoute, RouteDealer
from tessera.serve.engine import GenerationParams
from tessera.serve.lanes import Lane, lanes_of
from tessera.serve.launch import start_engine
from tessera.serve.plan_routes import load_served_plan, split_slots

PLANS = Path(__file__).resolve().parents[1] / "fixtures" / "plans"
MIX = PLANS / "smollm2-135m_A100_L40S_mix.json"  # 36% whole on the L40S, 64% prefilled on the L40S, decoded on the A100
PIPELINE = PLANS / "smollm2-135m_A100_L40S_layer-pipeline.json"
REPLICAS = PLANS / "smollm2-135m_A100_L40S_request-dist.json"
MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]
TOKENS = 6


def _config(**kw) -> ServeConfig:
    # GEMMs row by row: a request's greedy tokens cannot depend on the requests that share its steps
    return ServeConfig(MODEL, kw.pop("cluster", "cpu:2"), slots=4, max_context=64, threads=1, window_s=3600.0,
                       latency_rows=4, batch_invariant=True, **kw)


def _serve_all(engine) -> list:
    """Every prompt submitted at once; each one's generation when all are done."""
    done: dict[int, tuple] = {}
    finished = threading.Event()
    gens = []
    for i, text in enumerate(PROMPTS):
        def sink(kind, payload, i=i):
            if kind in ("done", "error"):
                done[i] = (kind, payload)
                if len(done) == len(PROMPTS):
                    finished.set()

        gens.append(engine.submit(engine.tokenizer(text).input_ids, GenerationParams(max_tokens=TOKENS), sink))
    assert finished.wait(300) and set(done.values()) == {("done", "length")}, done
    return gens


@pytest.fixture(scope="module")
def one_process() -> list[list[int]]:
    """The prompts' greedy tokens served in one process (`--local`)."""
    engine, _ = start_engine(_config(local=True))
    try:
        return [list(g.tokens) for g in _serve_all(engine)]
    finally:
        engine.stop()


def _record_starts(engine) -> list[tuple[set[int], set[int]]]:
    """Record, for every step the engine starts, its workers and the workers the steps in flight then hold."""
    started: list[tuple[set[int], set[int]]] = []
    start = engine.lanes.start

    def recording(step):
        held = {w for f in engine.lanes.inflight for w in f.lane.workers}
        started.append((set(engine.placements.placements[engine._phase(step)]), held))
        return start(step)

    engine.lanes.start = recording
    return started


def test_a_route_mix_served_with_its_plan_gives_the_tokens_of_one_process(one_process):
    cfg = _config(plan_file=str(MIX))
    cfg.check()
    engine, how = start_engine(cfg)
    try:
        assert "A100 -> cpu:0, L40S -> cpu:1" in how and "homogeneous (L40S): 2 slots" in how, how
        # the whole-request route on the L40S's worker; the prefill-decode route prefills there and decodes on
        # the A100's: its prefill lane takes turns with the whole route's lane on cpu:1
        assert lanes_of(engine.placements, engine.objective) == [
            Lane(frozenset({"r0/prefill", "r0/decode"}), frozenset({1})),
            Lane(frozenset({"r1/prefill"}), frozenset({1})), Lane(frozenset({"r1/decode"}), frozenset({0}))]
        started = _record_starts(engine)
        gens = _serve_all(engine)
        assert [list(g.tokens) for g in gens] == one_process
        # a step starts only on workers no step in flight holds (whole turns on cpu:1), and steps on disjoint
        # workers were in flight at once (a decode on cpu:0 beside a step on cpu:1)
        assert all(not workers & held for workers, held in started), started
        assert any(held for _, held in started), started
        # dealt as the router deals (--shares auto): the fastest route (prefill-decode) until the requests in
        # flight fill its 2 slots, then the plan's shares (64% / 36%, smooth round robin)
        assert [g.route for g in gens] == [1, 1, 1, 0]
        busy = engine.backend.busy_s()
        assert busy.get("cpu:0", 0) > 0 and busy.get("cpu:1", 0) > 0, busy
    finally:
        engine.stop()


def test_a_layer_pipeline_plan_for_gpus_is_served_as_one_route_split_over_both_workers(one_process):
    engine, how = start_engine(_config(plan_file=str(PIPELINE)))
    try:
        assert how.startswith(f"layer-pipeline plan from {PIPELINE}"), how
        assert lanes_of(engine.placements, engine.objective) == [Lane(frozenset({"prefill", "decode"}),
                                                                      frozenset({0, 1}))]
        assert [list(g.tokens) for g in _serve_all(engine)] == one_process
    finally:
        engine.stop()


def test_request_dist_replicas_are_routes_each_on_its_own_worker(one_process):
    served = load_served_plan(REPLICAS, MODEL, 2)
    assert [(r.name, round(r.share, 2), r.workers) for r in served.routes] == [
        ("homogeneous (A100)", 0.6, {0}), ("homogeneous (L40S)", 0.4, {1})]
    engine, _ = start_engine(_config(plan_file=str(REPLICAS)))
    try:  # two engines on disjoint workers: a lane each, both in flight at once
        assert lanes_of(engine.placements, engine.objective) == [
            Lane(frozenset({"r0/prefill", "r0/decode"}), frozenset({0})),
            Lane(frozenset({"r1/prefill", "r1/decode"}), frozenset({1}))]
        gens = _serve_all(engine)
        assert [list(g.tokens) for g in gens] == one_process
        # the faster A100 replica until its 2 slots are full, then 60% / 40%
        assert [g.route for g in gens] == [0, 0, 0, 1]
    finally:
        engine.stop()


def test_a_plan_for_the_cpu_workers_themselves_runs_each_target_on_its_worker(tmp_path):
    from typer.testing import CliRunner

    from tessera.cli.main import app
    from tessera.plan.deployment import PlanFileError

    path = tmp_path / "cpu-prefill-decode.json"
    result = CliRunner().invoke(app, ["plan", MODEL, "--cluster", "cpu:2", "--policy", "prefill-decode", "-o",
                                      str(path)])
    assert result.exit_code == 0, result.output
    served = load_served_plan(path, MODEL, 2)
    assert len(served.routes) == 1 and "stand-in" not in served.how
    placed = served.routes[0].assignments["throughput"]
    assert {len(set(placed["prefill"])), len(set(placed["decode"]))} == {1}  # each phase whole on one worker
    assert set(placed["prefill"]) | set(placed["decode"]) == {0, 1}
    with pytest.raises(PlanFileError, match=r"places kernels on cpu:., but --cluster has 1 worker; use --cluster "
                                            r"cpu:2"):
        load_served_plan(path, MODEL, 1)


def test_requests_are_dealt_as_the_router_deals_them():
    routes = [DealtRoute(0.36, 0.014, 3), DealtRoute(0.64, 0.009, 5)]  # the mix at 8 slots: r1 is the fastest
    now = [0.0]
    auto = RouteDealer(routes, "auto", cooldown_s=1.0, clock=lambda: now[0])
    assert [auto.pick(n) for n in range(5)] == [1] * 5 and auto.mode == "latency"
    assert [auto.pick(n) for n in (5, 6, 7, 8)] == [1, 0, 1, 1] and auto.mode == "throughput"
    assert auto.pick(1) == 0 and auto.mode == "throughput"  # within the cool-down: the shares go on
    now[0] = 2.0
    assert auto.pick(3) == 1 and auto.mode == "latency"  # below 0.8 x 5 in flight, after the cool-down
    through = RouteDealer(routes, "throughput")
    assert [through.pick(0) for _ in range(25)].count(0) == 9  # 36% of 25
    assert {RouteDealer(routes, "latency").pick(100) for _ in range(5)} == {1}
    assert RouteDealer([DealtRoute(1.0, None, 4)], "auto").pick(7) == 0


def test_slots_are_divided_by_the_shares_each_route_at_least_one():
    assert split_slots([0.36, 0.64], 4) == [2, 2]
    assert split_slots([0.36, 0.64], 8) == [3, 5]
    assert split_slots([0.01, 0.99], 2) == [1, 1]
    assert sum(split_slots([0.2, 0.3, 0.5], 7)) == 7


def _not_a_plan(tmp_path: Path) -> str:
    path = tmp_path / "notes.json"
    path.write_text(json.dumps({"model": MODEL, "steps": []}))
    return str(path)


@pytest.mark.parametrize(("kw", "message"), [
    ({"plan_file": str(PLANS / "llama-3.1-8b_A100_L40S.json")},
     "is a plan for llama-3.1-8b, not for smollm2-135m"),
    ({"plan_file": str(MIX), "cluster": "cpu:3"}, "has 2 targets (A100, L40S) and each runs on one cpu worker, but "
                                                 "--cluster has 3 workers; use --cluster cpu:2"),
    ({"plan_file": "NOT_A_PLAN"}, "not a Tessera plan of version"),
    ({"plan_file": str(PLANS / "missing.json")}, "missing.json"),
    ({"plan_file": str(MIX), "slots": 1}, "the plan has 2 routes, each an engine with rows of its own, but --slots "
                                          "is 1; give --slots 2 or more"),
    ({"plan_file": str(MIX), "latency_policy": "homogeneous"}, "--latency-policy places kernels otherwise"),
    ({"plan_file": str(MIX), "placement": "alternate"}, "--placement places kernels otherwise"),
    ({"plan_file": str(MIX), "local": True}, "--plan places kernels on workers: give one of them"),
    ({"plan_file": str(MIX), "shares": "fastest"}, "--shares must be one of auto, throughput, latency (got 'fastest')"),
    ({"plan_file": str(REPLICAS), "shares": "latency", "slots": 2}, None),
    ({"shares": "throughput"}, "--shares deals requests among a plan file's routes: give --plan FILE"),
])
def test_a_plan_that_cannot_be_served_is_refused_before_serving(tmp_path, kw, message):
    if kw.get("plan_file") == "NOT_A_PLAN":
        kw = {**kw, "plan_file": _not_a_plan(tmp_path)}
    cfg = ServeConfig(MODEL, kw.pop("cluster", "cpu:2"), **{"slots": 4, **kw})
    if message is None:  # a good one among them: the check passes
        cfg.check()
        return
    with pytest.raises(TesseraError) as e:
        cfg.check()
    assert message in str(e.value)
    if "places kernels otherwise" in message or "give one of them" in message or "--shares" in message:
        assert isinstance(e.value, ServeOptionError)
