"""The simulator charges two steps on the host's CPU workers their contention for exactly the time they overlap:
identical steps side by side take the factor times as long, a step alone keeps its time, GPU simulations and
steps of kinds without a factor keep theirs."""

from __future__ import annotations

import pytest

from tessera.cost.contention import HostContention
from tessera.cost.profile import Profile
from tessera.hardware.catalog import HOST_ID
from tessera.hardware.cluster import parse_cluster
from tessera.plan.context import PlanContext
from tessera.plan.planner import plan_policy
from tessera.sim.requests import simulate
from tessera.workload import parse_workload

WORKLOAD = "fixed:in=64,out=8,requests=8"
FACTOR = 1.5


def _profile(contention: HostContention | None) -> Profile:
    """A profile of this host with no kernel measured (every kernel from the roofline)."""
    return Profile(HOST_ID, "test cpu", 1, "smollm2-135m", "decode", "", {}, 0, 1, "now", [], contention=contention)


def _run(cluster: str, policy: str, draws, contention: HostContention | None, profiled: bool = True):
    ctx = PlanContext("smollm2-135m", parse_cluster(cluster), parse_workload(WORKLOAD), WORKLOAD, 4,
                      profile=_profile(contention) if profiled else None)
    plan = plan_policy(ctx, policy)
    return simulate(ctx, plan, feedback_s=1e-4, draws=draws)


def test_identical_steps_side_by_side_take_the_factor_times_as_long():
    # request-dist: one request per worker, both at once, so every step of one runs beside the same step of the other
    draws = [(0.0, 64, 8), (0.0, 64, 8)]
    plain = _run("cpu:2", "request-dist", draws, None)
    slowed = _run("cpu:2", "request-dist", draws, HostContention.uniform(FACTOR))
    assert len(plain.latency_s) == 2 and plain.latency_s[0] == pytest.approx(plain.latency_s[1])
    for a, b in zip(slowed.latency_s, plain.latency_s, strict=True):
        assert a == pytest.approx(FACTOR * b, rel=1e-9)
    for a, b in zip(slowed.ttft_s, plain.ttft_s, strict=True):
        assert a == pytest.approx(FACTOR * b, rel=1e-9)
    assert sum(slowed.lane_busy_s.values()) == pytest.approx(FACTOR * sum(plain.lane_busy_s.values()), rel=1e-9)


def test_a_step_that_overlaps_part_of_another_is_slowed_for_that_part_only():
    # the second request arrives while the first's prefill runs on the other worker: only the overlap is slowed
    plain = _run("cpu:2", "request-dist", [(0.0, 64, 1), (0.0, 64, 1)], None)
    prefill = plain.latency_s[0]  # one prefill step (one output token)
    lag = prefill / 2
    draws = [(0.0, 64, 1), (lag, 64, 1)]
    slowed = _run("cpu:2", "request-dist", draws, HostContention.uniform(FACTOR))
    # the first: half its work alone, then the other half at 1/FACTOR speed; the second: the first's remaining
    # (FACTOR x prefill / 2 of wall time) at 1/FACTOR, then the rest alone
    first = lag + FACTOR * (prefill - lag)
    overlap = first - lag
    second = overlap + (prefill - overlap / FACTOR)
    assert slowed.latency_s[0] == pytest.approx(first, rel=1e-9)
    assert slowed.latency_s[1] == pytest.approx(second, rel=1e-9)


def test_steps_that_never_overlap_keep_their_times():
    draws = [(0.0, 64, 8), (100.0, 32, 4)]  # the second arrives long after the first finished
    plain = _run("cpu:2", "request-dist", draws, None)
    slowed = _run("cpu:2", "request-dist", draws, HostContention.uniform(FACTOR))
    assert slowed.latency_s == plain.latency_s and slowed.ttft_s == plain.ttft_s


def _only(kind: str, neighbour: str) -> HostContention:
    return HostContention(tuple((a, b, FACTOR if (a, b) == (kind, neighbour) else 1.0)
                                for a in ("decode", "prefill") for b in ("decode", "prefill")))


def test_only_the_kinds_that_overlap_are_charged():
    # prefill-decode: the second prompt is prefilled while the first request decodes on the other worker, and
    # a decode step never runs beside another decode step; request-dist decodes on both workers at once
    first = _run("cpu:2", "prefill-decode", [(0.0, 64, 8)], None)
    staggered = [(0.0, 64, 8), (first.ttft_s[0] + 1e-3, 32, 8)]
    plain = _run("cpu:2", "prefill-decode", staggered, None)
    assert _run("cpu:2", "prefill-decode", staggered, _only("decode", "decode")).latency_s == plain.latency_s
    assert _run("cpu:2", "prefill-decode", staggered, _only("prefill", "decode")).ttft_s[1] > plain.ttft_s[1]
    both = [(0.0, 64, 8), (0.0, 32, 16)]
    plain = _run("cpu:2", "request-dist", both, None)
    assert _run("cpu:2", "request-dist", both, _only("decode", "decode")).latency_s != plain.latency_s
    assert _run("cpu:2", "request-dist", both, _only("prefill", "decode")).latency_s == plain.latency_s


def test_gpu_simulations_are_unchanged_by_a_host_profile_with_contention():
    draws = [(0.0, 64, 8), (0.01, 48, 8), (0.02, 32, 8)]
    plain = _run("A100:1,L40S:1", "prefill-decode", draws, None, profiled=False)
    hosted = _run("A100:1,L40S:1", "prefill-decode", draws, HostContention.uniform(FACTOR))
    assert hosted.summary() == plain.summary()
