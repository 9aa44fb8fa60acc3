"""The simulator's engines switching objectives as `tessera serve`'s monitor does (`tessera.sim.objectives`)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tessera.hardware.cluster import parse_cluster
from tessera.plan.context import PlanContext
from tessera.plan.deployment import DeploymentPlan
from tessera.plan.engines import engine_parts
from tessera.plan.objective_steps import add_objective_steps
from tessera.plan.planner import plan_policy
from tessera.sched.monitor import Monitor
from tessera.sched.scheduler import Request
from tessera.sim.requests import SimulationSetupError, engines_for, run_requests, simulate
from tessera.workload import parse_workload

MIX = Path(__file__).parents[1] / "fixtures" / "plans" / "smollm2-135m_A100_L40S_mix.json"


def _context(workload: str) -> PlanContext:
    return PlanContext("smollm2-135m", parse_cluster("A100:1,L40S:1"), parse_workload(workload), workload, 8)


@pytest.fixture(scope="module")
def tessera_plan():
    """Tessera's own plan with its latency step plans, which place the decode elsewhere than the throughput
    ones (the monitor's switch then moves every running request's KV)."""
    ctx = _context("fixed:in=64,out=16,requests=16")
    plan = add_objective_steps(ctx, plan_policy(ctx, "tessera", "throughput"), "latency")
    return ctx, plan


def _burst_then_trickle() -> list[tuple[float, int, int]]:
    """A burst of 12 requests at once, then one every two seconds: the monitor must go to throughput for the
    burst and back to latency for the trickle."""
    return [(0.0, 64, 16)] * 12 + [(5.0 + 2.0 * i, 64, 16) for i in range(6)]


def test_a_disabled_monitor_runs_its_objective_exactly_as_without_one(tessera_plan):
    ctx, plan = tessera_plan
    draws = [(0.1 * i, 64, 16) for i in range(12)]
    for objective in ("throughput", "latency"):
        plain = simulate(ctx, plan, objective=objective, draws=draws).summary()
        pinned = simulate(ctx, plan, draws=draws, monitor=Monitor(objective=objective, enabled=False)).summary()
        assert pinned == plain, objective
        assert pinned["switches"] == 0


def test_the_monitor_switches_to_throughput_under_a_burst_and_back(tessera_plan):
    ctx, plan = tessera_plan
    draws = _burst_then_trickle()
    switching = simulate(ctx, plan, draws=draws, monitor=Monitor(), latency_rows=4)
    assert switching.switches >= 2  # latency -> throughput for the burst, back for the trickle
    assert switching.completed == len(draws)
    latency_only = simulate(ctx, plan, objective="latency", draws=draws)
    throughput_only = simulate(ctx, plan, objective="throughput", draws=draws)
    # the trickle's lone requests are served by the latency plans (the first one starts before the window that
    # switches back, as in a serving engine): their TTFT as under the latency objective
    lone = slice(13, None)
    assert switching.ttft_s[lone] == pytest.approx(latency_only.ttft_s[lone], rel=1e-9)
    assert switching.ttft_s[lone] != pytest.approx(throughput_only.ttft_s[lone], rel=1e-3)


def test_latency_rows_hold_the_rest_back_until_the_switch(tessera_plan):
    """Under the latency objective at most ``latency_rows`` requests are in flight: a burst of 12 at 4 rows
    waits, and the switch to throughput (at the first window's end) lets the rest in."""
    ctx, plan = tessera_plan
    draws = [(0.0, 64, 600)] * 12  # long enough (about 0.4 s a wave of 4) for a window to close under way
    never = simulate(ctx, plan, draws=draws, monitor=Monitor(enabled=False), latency_rows=4)
    switching = simulate(ctx, plan, draws=draws, monitor=Monitor(), latency_rows=4)
    assert switching.switches >= 1
    assert switching.makespan_s < never.makespan_s  # 12 requests 4 at a time take longer than after the switch
    assert max(never.ttft_s) > max(switching.ttft_s)


def _with_latency_decode_on_the_prefill_target(plan):
    """``plan`` (prefill-decode) with latency step plans that decode where the prefill ran (as serve's latency
    plans did before a named policy kept its placement): a switch moves every running request's KV."""
    prefill = plan.step("prefill", "throughput")
    home = prefill.assignment[0]
    for s in [s for s in plan.steps if s.objective == "throughput"]:
        plan.steps.append(replace(s, objective="latency", micro_batches=1, assignment=[home] * len(s.assignment)))
    return plan


def test_a_switch_holds_the_running_requests_back_for_their_state_moves():
    ctx = _context("fixed:in=64,out=16,requests=16")
    plan = _with_latency_decode_on_the_prefill_target(plan_policy(ctx, "prefill-decode", "throughput"))
    engine = engines_for(ctx, plan, monitor=Monitor(), latency_rows=4)[0]
    modes = engine.switching.modes
    assert modes["latency"].state_targets != modes["throughput"].state_targets
    per_request = sum(m.seconds_per_request for m in plan.state_moves)
    assert engine.switching.move_s == pytest.approx(per_request) and per_request > 0
    assert engine.max_rows == 4 and engine.timer is modes["latency"].timer  # a serving engine starts on latency
    # the same run with the switch's moves free: the 4 requests decoding at the switch finish later by their
    # rows' moves (4 x move_s, before their next step on the other target), the others no earlier
    finish = {}
    for move_s in (engine.switching.move_s, 0.0):
        engines = engines_for(ctx, plan, monitor=Monitor(), latency_rows=4)
        engines[0].switching.move_s = move_s
        done = run_requests(engines, [Request(i, 0.0, 64, 600) for i in range(12)])
        assert engines[0].switching.switches == 1
        finish[move_s] = [r.finish_s for r in sorted(done, key=lambda r: r.id)]
    held = [a - b for a, b in zip(finish[engine.switching.move_s], finish[0.0], strict=True)]
    assert sorted(held)[-4:] == pytest.approx([4 * engine.switching.move_s] * 4, rel=0.05)
    assert min(held) >= -1e-12


def test_a_one_engine_route_mix_is_refused_with_the_monitor():
    ctx = _context("fixed:in=64,out=16,requests=16")
    mixed = DeploymentPlan.load(MIX)
    engines_for(ctx, mixed, monitor=Monitor())  # two engines sharing the cluster: each switches
    for route in mixed.extra["routes"]:
        route["engine"] = 0  # the same routes as one engine (the decode device also prefills)
    assert any(p.one_engine for p in engine_parts(mixed))
    with pytest.raises(SimulationSetupError, match="one objective"):
        engines_for(ctx, mixed, monitor=Monitor())


def test_simulate_cli_switches_with_the_monitor_and_refuses_bad_uses():
    from typer.testing import CliRunner

    from tessera.cli.main import app

    runner = CliRunner()
    args = ["simulate", "smollm2-135m", "--cluster", "A100:1,L40S:1", "--policy", "tessera", "-w",
            "fixed:in=64,out=600,requests=12", "--max-batch", "8"]
    res = runner.invoke(app, [*args, "--monitor", "--latency-rows", "4", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["switches"] >= 1 and data["completed"] == 12
    plain = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert plain["switches"] == 0
    res = runner.invoke(app, [*args, "--monitor", "--latency-rows", "0"])
    assert res.exit_code != 0 and "--latency-rows must be at least 1" in res.output
    res = runner.invoke(app, [*args, "--monitor", "--engine", "vllm"])
    assert res.exit_code != 0 and "leave --monitor out" in res.output
    res = runner.invoke(app, [*args, "--latency-rows", "4"])
    assert res.exit_code != 0 and "give it with --monitor" in res.output


def test_every_engine_switches_with_a_monitor_of_its_own():
    used = Monitor(beta=2.0, window_s=0.5, cooldown_s=3.0, hysteresis=0.5)
    used.close_window(1.0, [], [], [])
    used.switch_count, used.objective = 3, "throughput"
    fresh = used.fresh("latency")
    assert (fresh.beta, fresh.window_s, fresh.cooldown_s, fresh.hysteresis, fresh.enabled) == (2.0, 0.5, 3.0, 0.5, True)
    assert fresh.objective == "latency" and fresh.switch_count == 0 and not fresh.switches
    assert fresh.window_end_s() is None and used.fresh().objective == "throughput"
    ctx = _context("fixed:in=64,out=16,requests=16")
    plan = plan_policy(ctx, "request-dist", "throughput")
    engines = engines_for(ctx, plan, monitor=used, latency_rows=2)
    assert len(engines) == 2 and engines[0].switching.monitor is not engines[1].switching.monitor
    for e in engines:  # each starts on the objective of the monitor given: throughput, every slot
        assert e.switching.monitor is not used and e.switching.monitor.objective == "throughput"
        assert e.max_rows == e.scheduler.slots and e.switching.modes["latency"].max_rows == 2


def test_replicas_start_each_on_its_own_monitor_s_objective():
    """One monitor per engine: request-dist's replicas left on different objectives by a served run start there
    (a replica on latency holds `latency_rows` requests in flight, one on throughput every slot)."""
    ctx = _context("fixed:in=64,out=16,requests=16")
    plan = plan_policy(ctx, "request-dist", "throughput")
    assert len(engines_for(ctx, plan)) == 2
    mixed = engines_for(ctx, plan, monitor=[Monitor(objective="latency"), Monitor(objective="throughput")],
                        latency_rows=2)
    assert [e.switching.monitor.objective for e in mixed] == ["latency", "throughput"]
    assert mixed[0].max_rows == 2 and mixed[1].max_rows > 2
    same = engines_for(ctx, plan, monitor=Monitor(objective="latency"), latency_rows=2)
    assert [e.switching.monitor.objective for e in same] == ["latency", "latency"]
    assert same[0].switching.monitor is not same[1].switching.monitor  # a copy each
    with pytest.raises(SimulationSetupError, match="3 monitors for the 2 engines of the request-dist plan"):
        engines_for(ctx, plan, monitor=[Monitor()] * 3)
