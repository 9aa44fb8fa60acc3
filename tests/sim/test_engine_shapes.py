"""Engine shapes in the simulator: steps at their own rows, prompt and context (16-token granules), a decode
step's context its rows' mean, timed multilinearly between traced power-of-two shapes."""

from __future__ import annotations

import pytest

from tessera.hardware.cluster import parse_cluster
from tessera.plan.context import PlanContext
from tessera.plan.planner import plan_policy
from tessera.sched.scheduler import Buckets, Request, Scheduler, stages_for
from tessera.sim.requests import engines_for, simulate
from tessera.sim.step_timer import _bracket, _grid_above, _grid_below
from tessera.workload import parse_workload

WORKLOAD = "offline:prompts=azure-conv,out=32,requests=40"


@pytest.fixture(scope="module")
def a100():
    ctx = PlanContext("smollm2-135m", parse_cluster("A100:1"), parse_workload(WORKLOAD), WORKLOAD)
    return ctx, plan_policy(ctx, "homogeneous")


def test_fine_buckets_pad_to_a_block_and_a_step_reads_its_rows_mean_context():
    b = Buckets.fine(6, 100, 16)
    assert b.rows(5) == 5 and b.prompt(17) == 32 and b.context(100) == 100 and b.paged
    sched = Scheduler(stages_for("llm"), 6, b, 100)
    for i, n in enumerate((10, 40)):
        sched.submit(Request(i, 0.0, n, 4))
    for _ in range(2):  # both prompts fill their caches
        step = sched.next_step(0.0)
        sched.complete(step, 0.0, 0.0)
    step = sched.next_step(0.0)
    assert step.phase == "decode" and step.rows == 2
    assert step.ctx == 32  # mean context (10 + 40) / 2 = 25, in a 16-token granule; the longest would be 48


def test_interpolated_times_are_exact_on_the_grid_and_linear_between(a100):
    ctx, plan = a100
    timer = engines_for(ctx, plan, engine_shapes=True)[0].timer
    # the grid: powers of two and their midpoints (8, 12, 16, ...; 512, 768, 1024)
    lo, hi = timer.time("decode", 8, None, 512), timer.time("decode", 12, None, 512)
    assert timer.interpolated("decode", 8, None, 512).first_s == pytest.approx(lo.first_s)
    assert timer.interpolated("decode", 12, None, 512).first_s == pytest.approx(hi.first_s)
    mid = timer.interpolated("decode", 10, None, 512)
    assert mid.first_s == pytest.approx((lo.first_s + hi.first_s) / 2)
    c1, c2 = timer.time("decode", 8, None, 512), timer.time("decode", 8, None, 768)
    assert timer.interpolated("decode", 8, None, 576).first_s == pytest.approx(0.75 * c1.first_s + 0.25 * c2.first_s)
    p1, p2 = timer.time("prefill", 1, 256, 256), timer.time("prefill", 1, 384, 384)
    assert timer.interpolated("prefill", 1, 320, 320).first_s == pytest.approx((p1.first_s + p2.first_s) / 2)


def test_the_interpolation_grid_is_powers_of_two_and_their_midpoints():
    assert [_grid_below(v) for v in (1, 2, 3, 5, 7, 13, 1088)] == [1, 2, 3, 4, 6, 12, 1024]
    assert [_grid_above(v) for v in (1, 2, 3, 5, 7, 13, 1088)] == [1, 2, 3, 6, 8, 16, 1536]
    assert _bracket(160, 1) == ((128, 0.5), (192, 0.5))
    assert _bracket(1088, 128) == ((1024, 0.875), (1536, 0.125))
    assert _bracket(700, 1024) == ((700, 1.0),)  # below the lowest bucket: the shape itself
    assert _bracket(None, 1) == ((None, 1.0),)


def test_engine_shapes_run_faster_than_padded_buckets_and_complete_everything(a100):
    ctx, plan = a100
    # the prompts the planner costs a request's prefill at (its representative lengths, equal shares), so
    # that the steady state it predicts is the one this run can reach
    draws = [(0.0, n, 32) for n in ctx.prompt_lengths for _ in range(10)]
    engine, padded = simulate(ctx, plan, engine_shapes=True, draws=draws), simulate(ctx, plan, draws=draws)
    assert engine.completed == padded.completed == 40
    assert engine.throughput > padded.throughput  # prompts padded to powers of two cost up to 2x
    assert engine.throughput <= plan.throughput * 1.05  # and not above the planner's steady state
