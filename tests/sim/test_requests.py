"""The cluster simulator: kernel-level step times of real plans, its bounds, the request level, and the
agreement of the two levels with a full kernel-level run."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tessera.cli.main import app
from tessera.cost.model import CostModel
from tessera.cost.options import CostOptions
from tessera.hardware.cluster import Link, parse_cluster
from tessera.hardware.devices import resolve_device
from tessera.plan.context import PlanContext
from tessera.plan.planner import plan_policy
from tessera.program.placements import synthetic_placement
from tessera.program.program import build_programs
from tessera.sim.programs import simulate_programs, simulate_stream
from tessera.sim.requests import SimulationSetupError, engines_for, simulate
from tessera.workload import parse_workload

WORKLOAD = "fixed:in=64,out=8,requests=8"


def context(workload: str = WORKLOAD, max_batch: int | None = 4, micro_batches: int | None = None) -> PlanContext:
    return PlanContext("smollm2-135m", parse_cluster("A100:1,L40S:1"), parse_workload(workload), workload, max_batch,
                       micro_batches=micro_batches)


@pytest.fixture(scope="module")
def pipelined():
    """A layer-pipeline plan with two micro-batches in flight."""
    ctx = context(micro_batches=2)
    return ctx, plan_policy(ctx, "layer-pipeline")


def test_one_device_with_free_transfers_is_the_sum_of_kernel_times():
    ctx = context()
    plan = plan_policy(ctx, "homogeneous", device="A100")
    timer = engines_for(ctx, plan)[0].timer
    t = timer.time("decode", 4, None, 256)
    graph = timer.ctx.graph(timer.phase_spec("decode", 4, None, 256), 1)
    assert t.micro_batches == 1 and t.cut_bytes == 0 and t.targets == (0,)
    assert t.first_s == pytest.approx(CostModel(resolve_device("A100")).step_time(graph), rel=1e-9)
    assert t.period_s == pytest.approx(t.first_s, rel=1e-9)  # one micro-batch: nothing overlaps across steps


def test_pipelining_never_beats_the_bottleneck(pipelined):
    ctx, plan = pipelined
    timer = engines_for(ctx, plan)[0].timer
    for rows, c in ((4, 128), (2, 128), (4, 512)):
        t = timer.time("decode", rows, None, c)
        sp = timer.programs("decode", rows, None, c)
        links = simulate_stream(sp, lambda d, k, m, times=timer.kernel_times("decode", rows, None, c): times[k, d],
                                timer.link, steps=4).link_busy_s
        assert t.micro_batches == (2 if rows % 2 == 0 else 1)
        assert t.period_s >= max(t.busy_s) * (1 - 1e-9)
        assert t.period_s >= max(links.values(), default=0.0) / 4 * (1 - 1e-9)
        assert t.first_s >= t.period_s * (1 - 1e-9)
    assert timer.time("decode", 4, None, 128).period_s < sum(timer.time("decode", 4, None, 128).busy_s)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_streamed_random_placements_never_beat_the_busiest_device(m):
    graph = context().graph(context().phases[-1], 1)
    sp = build_programs(graph, synthetic_placement(graph, 3, "random", m), ["a", "b", "c"], m)
    link = Link("ib", 25e9 / 8, 5e-6)
    timeline = simulate_stream(sp, lambda d, k, mb: 1e-5 * (1 + k % 4), lambda s, d: link, steps=5, feedback_s=1e-4)
    per_step = [b / 5 for b in timeline.busy_s]
    assert timeline.period_s >= max(per_step) * (1 - 1e-9)
    alone = simulate_programs(sp, lambda d, k, mb: 1e-5 * (1 + k % 4), lambda s, d: link)
    assert timeline.first_step_s >= max(alone.busy_s) * (1 - 1e-9)


def test_request_level_agrees_with_a_full_kernel_level_run(pipelined):
    """4 requests arrive at once into 4 slots: one prefill step of their 4 prompts (63 tokens each, batched),
    then 8 decode steps of all 4 rows (the last prompt token in, 8 tokens out). The request level
    (cached bucket times: the first step alone, then the streamed period) against one kernel-level run of the
    prefills and of the 8 decode steps streamed back to back."""
    ctx, plan = pipelined
    wl = parse_workload("fixed:in=64,out=8,requests=4")
    result = simulate(ctx, plan, workload=wl)
    engine = engines_for(ctx, plan)[0]
    timer, buckets = engine.timer, engine.scheduler.buckets
    seq, prompt_ctx, decode_ctx = buckets.prompt(63), buckets.context(64), buckets.context(64 + 7)
    assert (seq, prompt_ctx, decode_ctx) == (128, 256, 256)
    prefill = timer.programs("prefill", 4, seq, prompt_ctx)
    p_times = timer.kernel_times("prefill", 4, seq, prompt_ctx)
    decode = timer.programs("decode", 4, None, decode_ctx)
    d_times = timer.kernel_times("decode", 4, None, decode_ctx)
    full = simulate_programs(prefill, lambda d, k, m: p_times[k, d], timer.link).makespan_s
    full += simulate_stream(decode, lambda d, k, m: d_times[k, d], timer.link, steps=8).makespan_s
    assert result.completed == 4 and result.steps == 1 + 8
    assert result.makespan_s == pytest.approx(full, rel=0.01)


def test_every_arrival_completes_or_is_rejected(tmp_path):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([[40, 6], [100, 3], [300, 20], [10, 1]]))  # 320 tokens: above --max-context
    wl = f"poisson:rate=50,lengths={lengths},requests=40"
    ctx = context(wl)
    plan = plan_policy(ctx, "prefill-decode")
    result = simulate(ctx, plan, seed=3, max_context=256)
    assert result.completed + result.rejected == 40 and result.rejected > 0
    assert all("above the deployment's 256" in r for r in result.rejections)
    assert len(result.ttft_s) == result.completed and min(result.ttft_s) > 0
    assert all(t >= 0 for t in result.tpot_s) and result.throughput > 0
    again = simulate(ctx, plan, seed=3, max_context=256)
    assert again.summary() == result.summary()  # deterministic for a seed


def test_prefill_decode_runs_its_phases_concurrently_and_waits_for_the_kv_move():
    ctx = context("fixed:in=64,out=8,requests=8")
    plan = plan_policy(ctx, "prefill-decode")
    engine = engines_for(ctx, plan)[0]
    assert sorted(sorted(lane.phases) for lane in engine.lanes) == [["decode"], ["prefill"]]
    moved = sum(m.seconds_per_request for m in plan.state_moves)
    assert moved > 0 and engine.delays["decode"] == pytest.approx(moved) and engine.delays["prefill"] == 0


def test_simulate_cli_json_and_errors(tmp_path):
    runner = CliRunner()
    args = ["simulate", "smollm2-135m", "--cluster", "A100:1,L40S:1", "--policy", "layer-pipeline", "-w", WORKLOAD,
            "--max-batch", "4"]
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    for key in ("throughput", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "norm_latency_s", "completed",
                "rejected", "preemptions"):
        assert key in data
    assert data["completed"] == 8 and data["rejected"] == 0 and data["policy"] == "layer-pipeline"
    assert data["preemptions"] == 0  # a plan without admission: slots alone
    res = runner.invoke(app, [*args, "--max-context", "0"])
    assert res.exit_code != 0 and "--max-context must be at least 1" in res.output
    res = runner.invoke(app, ["simulate", "smollm2-135m", "--cluster", "A100:1,L40S:1", "--policy", "fastest"])
    assert res.exit_code != 0 and "fastest" in res.output
    mamba = runner.invoke(app, ["simulate", "mamba-codestral-7b", "--cluster", "A100:1,L40S:1", "--policy",
                                "attention-ffn", "-w", WORKLOAD, "--json"])
    assert mamba.exit_code != 0 and "does not apply" in mamba.output


def test_a_plan_that_does_not_fit_is_not_simulated():
    # gpt-oss-20b deployed in MXFP4 (13.8 GB) fits a 24 GB L4; with its experts in bf16 (about 42 GB) it does not
    ctx = PlanContext("gpt-oss-20b", parse_cluster("L4:1"), parse_workload(WORKLOAD), WORKLOAD, 4,
                      options=CostOptions(weights_dtype="bf16"))
    assert plan_policy(PlanContext("gpt-oss-20b", parse_cluster("L4:1"), parse_workload(WORKLOAD), WORKLOAD, 4),
                       "homogeneous").feasible
    plan = plan_policy(ctx, "homogeneous")
    assert not plan.feasible
    with pytest.raises(SimulationSetupError, match="not feasible"):
        simulate(ctx, plan)


def test_a_plan_carries_over_to_a_bucket_with_more_kernels():
    import torch

    from tessera.capture.step import Step
    from tessera.capture.trace import trace
    from tessera.sim.step_timer import transfer_assignment

    def graph(chunks: int):
        def fn(inp, st, _c):
            x = inp["x"] + 1  # add #0
            for _ in range(chunks):  # a scan over chunks: mul #0, #1, ...
                x = x * 2
            return {"y": x - 1}  # sub #0

        return trace(Step(model="unit", family="test", phase="unit", modules={}, fn=fn,
                          inputs={"x": torch.ones(4)}, state={}))

    planned, bigger = graph(2), graph(4)
    assert [k.op for k in planned.kernels].count("aten.mul.Tensor") == 2
    assert transfer_assignment(planned, bigger, [0, 1, 0, 1]) == [0, 1, 0, 0, 0, 1]
