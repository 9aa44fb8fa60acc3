"""`tessera serve`'s default policy: the one-copy `tessera` plan, or request-dist (a replica per worker) where
its plan is predicted faster on this host's measured kernels; explicit choices are kept as given."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from tessera.serve.config import ServeConfig
from tessera.serve.launch import REPLICA_TIE_GAIN, prefer_replicas, runtime_policy

MODEL = "smollm2-135m"


def _plan(throughput: float, runnable: bool = True, latency_s: float = 0.1) -> SimpleNamespace:
    return SimpleNamespace(applicable=runnable, feasible=runnable, throughput=throughput, latency_s=latency_s)


def test_replicas_are_preferred_only_when_runnable_and_faster():
    assert prefer_replicas(_plan(100.0), _plan(150.0))
    assert not prefer_replicas(_plan(150.0), _plan(100.0))
    assert not prefer_replicas(_plan(100.0), _plan(100.0))  # a tie at the same latency keeps the one-copy plan
    assert not prefer_replicas(_plan(100.0), _plan(900.0, runnable=False))
    assert prefer_replicas(_plan(900.0, runnable=False), _plan(10.0))


def test_a_one_copy_lead_in_steady_state_only_gives_way_to_replicas():
    # smollm2-135m on this host with packed GEMMs: prefill-decode 329.2 tokens/s planned against request-dist's
    # 290.2, but on a burst of 32 requests the simulator gives it 231.6 against 290.2 (measured 170.8 on a burst
    # of 32 with 32 tokens out, where request-dist's replicas run both workers through the burst)
    one_copy, copies = _plan(329.2, latency_s=0.095), _plan(290.2, latency_s=0.083)
    assert prefer_replicas(one_copy, copies, burst=(231.6, 290.2))
    assert not prefer_replicas(one_copy, copies, burst=(300.0, 290.2))  # ahead on the burst too: one copy
    assert not prefer_replicas(one_copy, copies)  # no burst simulated: the planned lead stands
    # a burst the replicas lead by less than the tie margin is a tie: the steady state decides (smollm2-135m at 4
    # slots: 78.6 tokens/s on a burst for both, one copy planned at 88.1 against 78.6)
    edge = 290.2 * (1 + REPLICA_TIE_GAIN)
    assert not prefer_replicas(one_copy, copies, burst=(290.2, edge))
    assert prefer_replicas(one_copy, copies, burst=(290.2, edge + 0.1))


def test_a_tie_in_throughput_goes_to_the_lower_time_per_token():
    # smollm2-135m on this host at 32 slots: prefill-decode 272.4 tokens/s at 115 ms a token, request-dist 268.1
    # at 90 ms (each replica decodes 16 rows a step, not 32)
    assert prefer_replicas(_plan(272.4, latency_s=0.115), _plan(268.1, latency_s=0.090))
    assert not prefer_replicas(_plan(272.4, latency_s=0.080), _plan(268.1, latency_s=0.090))
    edge = 100.0 * (1 + REPLICA_TIE_GAIN)
    assert prefer_replicas(_plan(edge, latency_s=0.2), _plan(100.0, latency_s=0.1))
    assert not prefer_replicas(_plan(edge + 0.1, latency_s=0.2), _plan(100.0, latency_s=0.1))


@pytest.mark.parametrize("change", [dict(policy="prefill-decode"), dict(local=True), dict(placement="alternate"),
                                    dict(latency_policy="layer-pipeline")])
def test_an_explicit_choice_is_served_as_given_without_planning(change):
    said: list[str] = []
    cfg = ServeConfig(MODEL, "cpu:2", slots=4, max_context=128, threads=1, **change)
    chosen = runtime_policy(cfg, 2, 1, said.append)
    assert chosen.policy == cfg.policy and chosen.plan is None and said == []


def test_one_worker_has_nothing_to_replicate():
    cfg = ServeConfig(MODEL, "cpu:1", slots=4, max_context=128, threads=1)
    assert runtime_policy(cfg, 1, 1, lambda s: None).policy == "tessera"


def test_the_default_takes_the_better_planned_of_one_copy_and_replicas():
    said: list[str] = []
    cfg = ServeConfig(MODEL, "cpu:2", slots=4, max_context=128, threads=1)
    served = runtime_policy(cfg, 2, 1, said.append)
    chosen = served.policy
    assert chosen in ("tessera", "request-dist")
    assert served.plan.policy == chosen and served.context is not None  # the chosen plan, for the start to serve
    line = [s for s in said if s.startswith("request-dist (a replica per worker) planned at")]
    if chosen == "request-dist":  # both predictions: request-dist faster, ahead on the burst, or a tie won on TPOT
        copies, copies_ms, one_copy, one_copy_ms = map(float, re.search(
            r"planned at ([\d.]+) tokens/s and (\d+) ms a token against the tessera plan's ([\d.]+) and (\d+)",
            line[0]).groups())
        burst = re.search(r"on a burst of 4 requests ([\d.]+) against ([\d.]+)", line[0])
        assert (copies > one_copy or (burst and float(burst[1]) > float(burst[2]) * (1 + REPLICA_TIE_GAIN))
                or (copies * (1 + REPLICA_TIE_GAIN) >= one_copy and copies_ms <= one_copy_ms))
    else:
        assert line == []


class _PoolStarted(Exception):
    """Raised where a start would start its worker processes: planning is over by then."""


@pytest.mark.parametrize("replicas", [False, True])
def test_a_start_plans_each_candidate_once(replicas, monkeypatch):
    # the real planner runs; the wrapper only counts its calls by policy
    import tessera.plan.planner as planner
    import tessera.serve.launch as launch
    from tessera.runtime.pool import WorkerPool

    real, calls = planner.plan_policy, []

    def counted(ctx, policy, *args, **kwargs):
        calls.append(policy)
        return real(ctx, policy, *args, **kwargs)

    def started(*args, **kwargs):
        raise _PoolStarted

    monkeypatch.setattr(planner, "plan_policy", counted)
    monkeypatch.setattr(WorkerPool, "local", started)
    # whichever candidate this host's profile favours, both starts are taken: one-copy and replicas
    monkeypatch.setattr(launch, "prefer_replicas", lambda one_copy, copies, burst=None: replicas)
    said: list[str] = []
    cfg = ServeConfig(MODEL, "cpu:2", slots=4, max_context=128, threads=1)
    with pytest.raises(_PoolStarted):
        launch.start_engine(cfg, said.append)
    assert sorted(calls) == ["request-dist", "tessera"]  # each candidate planned once, then served as planned
    assert any(line.startswith("replica on cpu:") for line in said) == replicas
