"""Decode attention charged by each step's furthest cache position: a host profile times decode at a short and
the longest position, the step timer charges the kernels whose time follows the position between the two
(exactly the profile measured there at the profiled positions), the simulator gives each decode step its
furthest position, and GPU steps are untouched."""

from __future__ import annotations

import statistics

import pytest

from tessera.capture.tiny import tiny_config
from tessera.cost.model import CostModel
from tessera.cost.positions import PositionError, PositionModel, positional_key, profiled_positions
from tessera.cost.profile import Profile
from tessera.plan.planner import plan_policy
from tessera.runtime.session import host_profile, runtime_context, runtime_graphs
from tessera.sim.requests import engines_for, simulate
from tessera.sim.step_timer import StepTimer, StepTimingError

PROMPT, OUTPUT, CTX, ROWS = 4, 8, 16, 2


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A tiny LLM's graphs and this host's profile of them, decode at two positions (in a cache of its own)."""
    folder = tmp_path_factory.mktemp("models") / "tiny-llm"
    tiny_config("llm").save_pretrained(folder)
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESSERA_CACHE", str(cache))
        graphs = runtime_graphs(str(folder), PROMPT, CTX, ROWS)
        profile = host_profile(str(folder), graphs, 1, decode_position=PROMPT + OUTPUT // 2)
    decode = graphs["decode"]
    files = {p: Profile.load(next((cache / "profiles").glob(f"{decode.model}-decode-{decode.hash[:16]}-t1-k*-p{p}.json")))
             for p in profile.positions.positions}
    return str(folder), graphs, profile, files


def _timer(model: str, profile: Profile | None, cluster: str | None = None, policy: str = "homogeneous",
           device: str | None = "cpu") -> StepTimer:
    ctx = runtime_context(model, 1, PROMPT, OUTPUT, CTX, ROWS, 1, profile, cluster=cluster)
    plan = plan_policy(ctx, policy, "throughput", device)
    return engines_for(ctx, plan, max_context=CTX, min_prompt=PROMPT, feedback_s=1e-4)[0].timer


def _positional(graph) -> list[int]:
    return [k.index for k in graph.kernels if positional_key(k) is not None]


def _with_overhead(profile: Profile, overhead) -> Profile:
    profile.overhead = overhead
    return profile


def test_a_step_at_a_profiled_position_is_charged_what_was_measured_there(measured):
    model, graphs, profile, files = measured
    timer = _timer(model, profile)
    graph = timer.ctx.graph(timer.phase_spec("decode", ROWS, None, CTX))
    assert graph.hash == graphs["decode"].hash  # the step timed is the one profiled
    attention = _positional(graph)
    assert len(attention) == 2  # one per layer
    cpu = timer.targets[0].spec
    for position, measured_there in files.items():
        there = CostModel(cpu, timer.ctx.options, _with_overhead(measured_there, profile.overhead))
        expected = [there.kernel_costs(graph)[k].time_s for k in attention]
        got = timer.kernel_times_at("decode", ROWS, None, CTX, position)[attention, 0]
        assert list(got) == pytest.approx(expected, rel=1e-9)
    # at the short position the whole step is the short profile's (its other kernels are the short ones)
    short = min(files)
    alone = _timer(model, _with_overhead(files[short], profile.overhead))
    assert timer.time("decode", ROWS, None, CTX, short).first_s == pytest.approx(
        alone.time("decode", ROWS, None, CTX).first_s, rel=1e-9)


def test_between_the_profiled_positions_the_charge_is_linear(measured):
    model, _, profile, _ = measured
    timer = _timer(model, profile)
    lo, hi = profile.positions.positions
    mid = (lo + hi) // 2
    steps = {p: timer.time("decode", ROWS, None, CTX, p) for p in (lo, mid, hi)}
    share = (mid - lo) / (hi - lo)
    assert steps[mid].first_s == pytest.approx((1 - share) * steps[lo].first_s + share * steps[hi].first_s, rel=1e-9)
    # the charge follows the KV positions read, rows x (furthest + 1), at any rows bucket
    one_row = timer.kernel_times_at("decode", 1, None, CTX, 2 * (lo + 1) - 1)
    two_rows = timer.kernel_times_at("decode", ROWS, None, CTX, lo)
    k = _positional(timer.ctx.graph(timer.phase_spec("decode", ROWS, None, CTX)))[0]
    assert one_row[k, 0] == pytest.approx(two_rows[k, 0], rel=1e-9)


def test_positions_outside_the_context_are_refused(measured):
    model, graphs, profile, _ = measured
    timer = _timer(model, profile)
    for position in (-1, CTX):
        with pytest.raises(StepTimingError, match=f"position {position} is outside the step's cache of {CTX}"):
            timer.time("decode", ROWS, None, CTX, position)
    with pytest.raises(StepTimingError, match="outside the step's cache of 8 positions"):
        timer.time("decode", ROWS, None, 8, 8)
    with pytest.raises(PositionError, match="a cache of 1 position has one"):
        profiled_positions(1)
    with pytest.raises(PositionError, match="a short and a longer position"):
        PositionModel.fit(graphs["decode"], "cpu", (5, 5), [[0.0] * len(graphs["decode"].kernels)] * 2)
    with pytest.raises(PositionError, match="position 16 is outside the profiled decode step's cache"):
        PositionModel.fit(graphs["decode"], "cpu", (1, 16), [[], []])
    with pytest.raises(PositionError, match="every profile must time this graph"):
        PositionModel.fit(graphs["decode"], "cpu", (1, 8, 15), [[0.0] * len(graphs["decode"].kernels)] * 2)


def test_gpu_steps_are_unchanged_by_a_profile_fitted_by_position(measured):
    model, _, profile, _ = measured
    hosted = _timer(model, profile, "A100:1,L40S:1", "layer-pipeline", None)
    graph = hosted.ctx.graph(hosted.phase_spec("decode", ROWS, None, CTX))
    assert all(profile.positions.kernel_s(graph.kernels[k], 1) is not None for k in _positional(graph))  # fitted
    plain = _timer(model, None, "A100:1,L40S:1", "layer-pipeline", None)
    traced = plain.time("decode", ROWS, None, CTX)
    for position in (0, 7, CTX - 1):
        assert hosted.time("decode", ROWS, None, CTX, position) == traced
        assert plain.time("decode", ROWS, None, CTX, position) == traced


def test_the_simulator_gives_each_decode_step_its_furthest_position(measured, monkeypatch):
    model, _, profile, _ = measured
    ctx = runtime_context(model, 1, PROMPT, OUTPUT, CTX, ROWS, 1, profile)
    plan = plan_policy(ctx, "homogeneous", "throughput", "cpu")
    seen: list[tuple[str, int | None]] = []
    real = StepTimer.time

    def recorded(self, phase, rows, seq=None, ctx=None, position=None):
        seen.append((phase, position))
        return real(self, phase, rows, seq, ctx, position)

    monkeypatch.setattr(StepTimer, "time", recorded)
    # one request of 5 prompt tokens generating 6: the prefill writes 4, each decode step feeds one token, the
    # first the last prompt token at position 4, and reads the cache up to it
    simulate(ctx, plan, max_context=CTX, min_prompt=PROMPT, draws=[(0.0, 5, 6)])
    assert [p for phase, p in seen if phase == "decode"] == [4, 5, 6, 7, 8, 9]
    assert [p for phase, p in seen if phase == "prefill"] == [None]
    # two requests decoding together: each step is charged at the longer one's position
    seen.clear()
    simulate(ctx, plan, max_context=CTX, min_prompt=PROMPT, draws=[(0.0, 3, 4), (0.0, 10, 4)])
    assert [p for phase, p in seen if phase == "decode"] == [9, 10, 11, 12]


def test_the_planner_charges_attention_at_the_planned_position_in_steps_no_profile_timed(measured):
    model, graphs, profile, files = measured
    planned = profile.positions.planned
    assert planned == PROMPT + OUTPUT // 2
    timer = _timer(model, profile)
    one_row = timer.ctx.graph(timer.phase_spec("decode", 1, None, CTX))  # not profiled: rows 1, not ROWS
    assert one_row.hash != graphs["decode"].hash
    cpu = timer.targets[0].spec
    costs = CostModel(cpu, timer.ctx.options, profile).kernel_costs(one_row)
    for k in _positional(one_row):
        expected = profile.overhead.kernel_s(profile.positions.kernel_s(one_row.kernels[k], planned), 0.0)
        assert costs[k].time_s == pytest.approx(expected, rel=1e-12) and costs[k].bound == "measured"
    # the kernels the profile timed keep their own times, interpolated at the planned position kernel by kernel
    profiled = CostModel(cpu, timer.ctx.options, profile).kernel_costs(graphs["decode"])
    short, long = (files[p] for p in profile.positions.positions)
    lo, hi = profile.positions.positions
    share = (planned - lo) / (hi - lo)
    k = _positional(graphs["decode"])[0]
    same = [i for i, t in enumerate(short.kernels) if t.signature == short.kernels[k].signature]
    at_planned = statistics.median((1 - share) * short.kernels[i].median_s + share * long.kernels[i].median_s
                                   for i in same)
    assert profiled[k].time_s == pytest.approx(profile.overhead.kernel_s(at_planned, 0.0), rel=1e-9)


def test_a_large_cache_is_profiled_at_three_positions():
    assert profiled_positions(512) == (7, 63, 511)  # a sixty-fourth, an eighth, the last
    assert profiled_positions(128) == (1, 15, 127)
    assert profiled_positions(64) == (7, 63) and profiled_positions(16) == (1, 15)  # too small for the shortest
    assert profiled_positions(2) == (0, 1)


def test_the_fit_is_piecewise_through_every_profiled_position(measured):
    """Decode attention has a floor of fixed work at short contexts and bends up where its working set leaves the
    cache: a line through two positions misprices both; the fit goes through each measured point."""
    _, graphs, _, _ = measured
    graph = graphs["decode"]
    attention = _positional(graph)
    times = [[0.0] * len(graph.kernels) for _ in range(3)]
    for i, seconds in enumerate((1e-3, 2e-3, 10e-3)):
        for k in attention:
            times[i][k] = seconds
    model = PositionModel.fit(graph, "cpu", (1, 8, 15), times)
    kernel = graph.kernels[attention[0]]
    at = {p: model.kernel_s(kernel, p) for p in (0, 1, 4, 8, 12, 15)}
    assert at[1] == pytest.approx(1e-3) and at[8] == pytest.approx(2e-3) and at[15] == pytest.approx(10e-3)
    assert at[4] == pytest.approx(1e-3 + 1e-3 * 3 / 7)  # on the first segment
    assert at[12] == pytest.approx(2e-3 + 8e-3 * 4 / 7)  # on the second
    assert at[0] == pytest.approx(1e-3 - 1e-3 / 7)  # the first segment continued below it
    two = PositionModel.fit(graph, "cpu", (1, 15), [times[0], times[2]])
    assert two.kernel_s(kernel, 8) == pytest.approx(1e-3 + 9e-3 * 7 / 14)  # the line the middle point bends


def test_a_step_is_charged_between_the_profiled_positions_around_it(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tiny-llm"
    tiny_config("llm").save_pretrained(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESSERA_CACHE", str(tmp_path_factory.mktemp("cache")))
        graphs = runtime_graphs(str(folder), PROMPT, 128, ROWS)
        profile = host_profile(str(folder), graphs, 1, decode_position=40)
    assert profile.positions.positions == (1, 15, 127)
    ctx = runtime_context(str(folder), 1, PROMPT, OUTPUT, 128, ROWS, 1, profile)
    plan = plan_policy(ctx, "homogeneous", "throughput", "cpu")
    timer = engines_for(ctx, plan, max_context=128, min_prompt=PROMPT, feedback_s=1e-4)[0].timer
    steps = {p: timer.time("decode", ROWS, None, 128, p) for p in (1, 8, 15, 71, 127)}
    for p, (lo, hi) in ((8, (1, 15)), (71, (15, 127))):
        share = (p - lo) / (hi - lo)
        assert steps[p].first_s == pytest.approx((1 - share) * steps[lo].first_s + share * steps[hi].first_s,
                                                  rel=1e-9)
