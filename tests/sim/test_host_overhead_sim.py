"""The simulator charges Tessera's engine's host overhead on this host's CPU workers exactly (per kernel and per
step), and nothing of it on GPUs."""

from __future__ import annotations

import pytest

from tessera.cost.host_overhead import HostOverhead
from tessera.cost.profile import Profile
from tessera.hardware.catalog import HOST_ID
from tessera.hardware.cluster import parse_cluster
from tessera.plan.context import PlanContext
from tessera.plan.planner import plan_policy
from tessera.sim.requests import engines_for
from tessera.workload import parse_workload

WORKLOAD = "fixed:in=64,out=8,requests=8"
DISPATCH, ENGINE = 2.0**-14, 2.0**-9


def _cpu_profile(overhead: HostOverhead | None) -> Profile:
    """A profile of this host with no kernel measured (every kernel from the roofline)."""
    return Profile(HOST_ID, "test cpu", 1, "smollm2-135m", "decode", "", {}, 0, 1, "now", [], overhead=overhead)


def _timer(cluster: str, profile: Profile | None, policy: str = "homogeneous", device: str | None = "cpu"):
    ctx = PlanContext("smollm2-135m", parse_cluster(cluster), parse_workload(WORKLOAD), WORKLOAD, 4, profile=profile)
    plan = plan_policy(ctx, policy, device=device)
    return engines_for(ctx, plan, feedback_s=1e-4)[0].timer


def test_a_step_of_k_kernels_costs_k_dispatches_and_one_engine_step_more():
    # weights never slower than profiled here (an unbounded bandwidth): only the dispatch and the engine's step
    with_overhead = _timer("cpu:1", _cpu_profile(HostOverhead(DISPATCH, float(2**120), ENGINE)))
    plain = _timer("cpu:1", _cpu_profile(None))
    for phase, rows, seq, ctx in (("decode", 4, None, 256), ("decode", 1, None, 128), ("prefill", 1, 64, None)):
        a, b = with_overhead.time(phase, rows, seq, ctx), plain.time(phase, rows, seq, ctx)
        kernels = sum(ins.kind == "run" for p in plain.programs(phase, rows, seq, ctx).programs
                      for ins in p.instructions)
        assert kernels > 100
        assert a.first_s - b.first_s == pytest.approx(kernels * DISPATCH + ENGINE, abs=1e-12)
        assert a.busy_s[0] - b.busy_s[0] == pytest.approx(kernels * DISPATCH, abs=1e-12)
        assert a.period_s - b.period_s == pytest.approx(kernels * DISPATCH + ENGINE, abs=1e-12)


def test_gpu_steps_are_unchanged_by_a_host_profile_with_overhead():
    hosted = _timer("A100:1,L40S:1", _cpu_profile(HostOverhead(DISPATCH, 1e9, ENGINE)), "layer-pipeline", None)
    plain = _timer("A100:1,L40S:1", None, "layer-pipeline", None)
    assert hosted.steps["decode"].assignment == plain.steps["decode"].assignment
    for bucket in (("decode", 4, None, 256), ("prefill", 1, 64, None)):
        assert hosted.time(*bucket) == plain.time(*bucket)
        assert hosted.engine_step_s(hosted.time(*bucket).targets) == 0.0
