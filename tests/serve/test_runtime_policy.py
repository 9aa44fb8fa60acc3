"""`tessera serve`'s default policy: the one-copy `tessera` plan, or request-dist (a replica per worker) where
its plan is predicted faster on this host's measured kernels; explicit choices are kept as given."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from tessera.serve.config import ServeConfig
from tessera.serve.launch import prefer_replicas, runtime_policy

MODEL = "smollm2-135m"


def _plan(throughput: float, runnable: bool = True) -> SimpleNamespace:
    return SimpleNamespace(applicable=runnable, feasible=runnable, throughput=throughput)


def test_replicas_are_preferred_only_when_runnable_and_faster():
    assert prefer_replicas(_plan(100.0), _plan(150.0))
    assert not prefer_replicas(_plan(150.0), _plan(100.0))
    assert not prefer_replicas(_plan(100.0), _plan(100.0))  # a tie keeps the one-copy plan
    assert not prefer_replicas(_plan(100.0), _plan(900.0, runnable=False))
    assert prefer_replicas(_plan(900.0, runnable=False), _plan(10.0))


@pytest.mark.parametrize("change", [dict(policy="prefill-decode"), dict(local=True), dict(placement="alternate"),
                                    dict(latency_policy="layer-pipeline")])
def test_an_explicit_choice_is_served_as_given_without_planning(change):
    said: list[str] = []
    cfg = ServeConfig(MODEL, "cpu:2", slots=4, max_context=128, threads=1, **change)
    assert runtime_policy(cfg, 2, 1, said.append) == cfg.policy and said == []


def test_one_worker_has_nothing_to_replicate():
    cfg = ServeConfig(MODEL, "cpu:1", slots=4, max_context=128, threads=1)
    assert runtime_policy(cfg, 1, 1, lambda s: None) == "tessera"


def test_the_default_takes_the_faster_planned_of_one_copy_and_replicas():
    said: list[str] = []
    cfg = ServeConfig(MODEL, "cpu:2", slots=4, max_context=128, threads=1)
    chosen = runtime_policy(cfg, 2, 1, said.append)
    assert chosen in ("tessera", "request-dist")
    line = [s for s in said if s.startswith("request-dist (a replica per worker) planned at")]
    if chosen == "request-dist":  # the line names both predictions, request-dist's the higher
        copies, one_copy = map(float, re.findall(r"([\d.]+) tokens/s", line[0])[:1]
                               + re.findall(r"plan's ([\d.]+)", line[0]))
        assert copies > one_copy
    else:
        assert line == []
