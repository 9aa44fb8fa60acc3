"""Lanes (phases sharing a target take turns, with their whole cycles) and prompt phases costed over the
workload's representative prompt lengths."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tessera.cost.model import CostModel
from tessera.hardware.cluster import parse_cluster
from tessera.hardware.devices import resolve_device
from tessera.plan.context import PROMPT_BINS, PlanContext
from tessera.plan.deployment import StepPlan, busiest_lane, lanes
from tessera.plan.planner import plan_policy
from tessera.plan.targets import cluster_targets
from tessera.sim.requests import _lanes
from tessera.workload import parse_workload


def _step(phase: str, assignment: list[int], cycle: float, repeats: float = 1.0, rows: int = 1) -> StepPlan:
    return StepPlan(phase, "throughput", rows, 1, repeats, rows, "h", assignment, cycle, cycle, [cycle, cycle],
                    [[0.0, 0.0], [0.0, 0.0]], 0, 0.0)


def test_lanes_group_phases_that_share_a_target_directly_or_through_another():
    enc, pre, dec = _step("encode", [0], 1.0), _step("prefill", [1], 2.0), _step("decode", [2, 2], 3.0, 8, 4)
    assert [[s.phase for s in lane] for lane in lanes([enc, pre, dec])] == [["encode"], ["prefill"], ["decode"]]
    assert busiest_lane([enc, pre, dec]) == (3.0 * 8 / 4, [dec])
    bridge = _step("prefill", [0, 2], 2.0)  # touches both the encoder's and the decoder's targets
    assert [[s.phase for s in lane] for lane in lanes([enc, bridge, dec])] == [["encode", "prefill", "decode"]]
    assert busiest_lane([enc, bridge, dec]) == (1.0 + 2.0 + 3.0 * 8 / 4, [enc, bridge, dec])
    split = _step("decode", [2], 3.0)
    split.expert_parts = {"0": [1, 2]}  # a split expert GEMM's parts use their targets too
    assert len(lanes([pre, split])) == 1 and lanes([]) == []


@pytest.fixture(scope="module")
def pair():
    workload = "fixed:in=512,out=64,requests=32"
    ctx = PlanContext("smollm2-135m", parse_cluster("A100:1,L40S:1"), parse_workload(workload), workload, 8)
    return ctx, cluster_targets(ctx.cluster)


def test_a_prefill_that_leaves_one_kernel_on_the_decode_device_takes_turns_with_decode(pair):
    ctx, targets = pair
    pre_phase, dec_phase = ctx.phases
    k_pre = ctx.step_problem(pre_phase, targets).problem.kernels
    k_dec = ctx.step_problem(dec_phase, targets).problem.kernels
    decode = (dec_phase, 1, (0,) * k_dec, {"method": "fixed"})
    apart = ctx.assemble("x", targets, 1, [(pre_phase, 1, (1,) * k_pre, {"method": "fixed"}), decode])
    # the sampler (the prefill graph's last kernel) on the decode device: one lane, cycles one after another
    shared = ctx.assemble("x", targets, 1, [(pre_phase, 1, (1,) * (k_pre - 1) + (0,), {"method": "fixed"}), decode])
    for plan in (apart, shared):
        pre, dec = plan.step("prefill"), plan.step("decode")
        assert dec.per_request == 64 / 8
    pre, dec = apart.step("prefill"), apart.step("decode")
    links = max(max(row) for row in pre.link_s) + sum(mv.seconds_per_request for mv in apart.state_moves)
    assert apart.request_time_s == pytest.approx(max(pre.cycle_s, dec.cycle_s * 8, links))
    assert [[s.phase for s in lane] for lane in lanes(apart.steps)] == [["prefill"], ["decode"]]
    pre, dec = shared.step("prefill"), shared.step("decode")
    assert shared.request_time_s == pytest.approx(pre.cycle_s + dec.cycle_s * 8)
    assert shared.request_time_s > max(pre.busy_s[0] + dec.busy_s[0] * 8, pre.busy_s[1])  # not the load sum
    assert shared.bottleneck == "phases taking turns on shared devices"
    assert [lane.phases for lane in _lanes(shared.steps)] == [{"prefill", "decode"}]  # the simulator agrees
    assert [lane.phases for lane in _lanes(apart.steps)] == [{"prefill"}, {"decode"}]


def test_an_offline_prompt_phase_costs_the_mean_over_representative_prompt_lengths():
    workload = "offline:prompts=azure-conv,out=32,requests=64"
    ctx = PlanContext("smollm2-135m", parse_cluster("A100:1"), parse_workload(workload), workload)
    lengths = np.sort(np.asarray(ctx.workload.lengths.inputs, dtype=float))
    want = [max(1, round(float(b.mean()))) for b in np.array_split(lengths, PROMPT_BINS)]
    assert ctx.prompt_lengths == want and len(set(want)) == PROMPT_BINS
    plan = plan_policy(ctx, "homogeneous")
    model = CostModel(resolve_device("A100"))
    prefill = ctx.phases[0]
    at_lengths = [model.step_time(ctx.graph(replace(prefill, seq=n, ctx=n))) for n in want]
    assert plan.step("prefill").cycle_s == pytest.approx(float(np.mean(at_lengths)))
    at_mean = model.step_time(ctx.graph(prefill))
    assert plan.step("prefill").cycle_s > at_mean  # the mean time exceeds the time at the mean prompt
    # a fixed prompt length stands for every request: no representatives
    fixed = PlanContext("smollm2-135m", parse_cluster("A100:1"), parse_workload("fixed:in=512,out=8,requests=4"),
                        "fixed:in=512,out=8,requests=4")
    assert fixed.prompt_lengths == []
