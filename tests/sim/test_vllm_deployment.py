"""A plan's engines in the vLLM simulator: the layout's engines, routes and knobs carried over, measured or
predicted step times, and the plans vLLM cannot run refused."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tessera.cost.engine_steps import EngineStepTimes
from tessera.plan.config import PlanConfig
from tessera.plan.deployment import DeploymentPlan
from tessera.plan.shares import ShareSwitchError
from tessera.sim.config import SimulationConfig
from tessera.sim.vllm_deployment import predicted_step_times, share_switch, vllm_engines
from tessera.sim.vllm_engines import VLLMSimulationError, simulate_vllm

PLANS = Path(__file__).resolve().parents[1] / "fixtures" / "plans"
MIX = PLANS / "smollm2-135m_A100_L40S_mix.json"
MEASURED = EngineStepTimes("vllm 0.32.0", "smollm2-135m", "cpu (2 threads)", ((16, 0.03), (256, 0.2), (1024, 0.8)),
                           ((1, 64, 0.02), (1, 1024, 0.025), (32, 64, 0.08), (32, 1024, 0.2)), overhead_s=0.004,
                           block_size=32, kv_blocks=1456)


@pytest.fixture(scope="module")
def mix():
    cfg = SimulationConfig(PlanConfig("smollm2-135m", "A100:1,L40S:1", "fixed:in=64,out=32,requests=32"),
                           plan_file=MIX)
    return cfg.deployment()


def test_the_layout_becomes_engines_and_routes(mix):
    ctx, plan = mix
    engines, routes = vllm_engines(ctx, plan, MEASURED)
    layout = plan.layout
    assert [e.name for e in engines] == [e.name for e in layout.engines]
    assert [e.max_num_seqs for e in engines] == [e.max_num_seqs for e in layout.engines]
    assert all(e.kv_blocks == 1456 and e.block_size == 32 and e.times is MEASURED for e in engines)
    names = [e.name for e in layout.engines]
    assert [(r.share, tuple(names[h] for h in r.hops)) for r in routes] == [(r.share, r.hops) for r in layout.routes]
    decode = engines[names.index("decode@A100")]
    assert decode.handoff_s > 0 and engines[names.index("whole@L40S")].handoff_s == 0
    # the whole engine and the prefill engine share the L40S: they take turns
    assert engines[names.index("whole@L40S")].devices == engines[names.index("prefill@L40S")].devices


def test_the_mix_serves_every_request_along_its_shares(mix):
    ctx, plan = mix
    engines, routes = vllm_engines(ctx, plan, MEASURED)
    result = simulate_vllm(engines, routes, [(0.0, 64, 32)] * 100)
    assert result.summary()["completed"] == 100
    two_hops = sum(len(r.hops) == 2 for r in result.requests)
    share = next(r.share for r in plan.layout.routes if len(r.hops) == 2)
    assert abs(two_hops - 100 * share) <= 1


def _with_latency(plan: DeploymentPlan, fastest_hops: int) -> DeploymentPlan:
    """The plan with its routes' planned latencies (the fixture predates them): the route of
    ``fastest_hops`` hops the fastest."""
    routes = tuple(replace(r, latency_s=1.0 if len(r.hops) == fastest_hops else 2.0) for r in plan.layout.routes)
    return replace(plan, layout=replace(plan.layout, routes=routes))


def test_the_router_share_switch_in_the_simulator(mix):
    ctx, plan = mix
    plan = _with_latency(plan, fastest_hops=1)
    engines, routes = vllm_engines(ctx, plan, MEASURED)
    whole = next(r for r in plan.layout.routes if len(r.hops) == 1)
    capacity = plan.layout.engine(whole.hops[0]).max_num_seqs
    # light load (each request done before the next arrives): every request on the fastest route
    spaced = simulate_vllm(engines, routes, [(10.0 * i, 64, 8) for i in range(12)], share_switch(plan, "auto"))
    assert all(len(r.hops) == 1 for r in spaced.requests)
    # a burst: the fastest route until its engine is full, then the plan's shares
    n = capacity + 100
    engines, routes = vllm_engines(ctx, plan, MEASURED)
    switch = share_switch(plan, "auto")
    burst = simulate_vllm(engines, routes, [(0.0, 64, 8)] * n, switch)
    assert burst.summary()["completed"] == n and switch.switch_count == 1
    assert all(len(r.hops) == 1 for r in burst.requests[:capacity])
    two_hops = sum(len(r.hops) == 2 for r in burst.requests[capacity:])
    share = next(r.share for r in plan.layout.routes if len(r.hops) == 2)
    assert abs(two_hops - 100 * share) <= 1
    # the plan's shares throughout, and a plan whose routes say no latency cannot take the latency shares
    engines, routes = vllm_engines(ctx, plan, MEASURED)
    fixed = simulate_vllm(engines, routes, [(10.0 * i, 64, 8) for i in range(12)], share_switch(plan, "throughput"))
    assert any(len(r.hops) == 2 for r in fixed.requests)
    with pytest.raises(ShareSwitchError, match="do not say their latency"):
        share_switch(mix[1], "latency")


def test_predicted_step_times_follow_the_devices(mix):
    ctx, plan = mix
    a100, l40s = (next(t for t in _targets(ctx) if t.name == n) for n in ("A100", "L40S"))
    fast, slow = predicted_step_times(ctx, a100, 1), predicted_step_times(ctx, l40s, 1)
    assert fast.device == "predicted: A100" and [(r, c) for r, c, _ in fast.decode] == [(1, 128), (1, 4096)]
    # decode reads every weight each step: the A100's bandwidth (2.0 TB/s against 0.86) makes it faster
    assert fast.decode_s(1, 512) < slow.decode_s(1, 512)
    assert all(b > a for (_, a), (_, b) in zip(fast.prefill, fast.prefill[1:], strict=False))


def _targets(ctx):
    from tessera.plan.targets import cluster_targets

    return cluster_targets(ctx.cluster)


def test_plans_vllm_cannot_run_or_step_times_of_another_model_are_refused(mix, tmp_path):
    ctx, plan = mix
    other = EngineStepTimes("vllm", "llama-3.1-8b", "A100", MEASURED.prefill, MEASURED.decode)
    with pytest.raises(VLLMSimulationError, match="measured for llama-3.1-8b, the plan serves smollm2-135m"):
        vllm_engines(ctx, plan, other)
    d = json.loads(MIX.read_text())
    for e in d["layout"]["engines"]:
        e["roles"] = ["split"]
    (tmp_path / "split.json").write_text(json.dumps(d))
    split = DeploymentPlan.load(tmp_path / "split.json")
    with pytest.raises(VLLMSimulationError, match="splits kernels.*--engine tessera"):
        vllm_engines(ctx, split, MEASURED)
