"""Planning requests: defaults, the family's default workload, every bad option with its message, and the
context a request plans in."""

from __future__ import annotations

import pytest

from tessera.plan.config import PlanConfig, PlanConfigError, PolicyError
from tessera.plan.context import PlanContext
from tessera.workload import DEFAULT_IMAGE_WORKLOAD, DEFAULT_TEXT_WORKLOAD


def test_the_default_workload_depends_on_the_family():
    assert PlanConfig("llama-3.1-8b", "A100:1").workload_text() == DEFAULT_TEXT_WORKLOAD
    assert PlanConfig("sd3.5-medium", "A100:1").workload_text() == DEFAULT_IMAGE_WORKLOAD
    assert PlanConfig("llama-3.1-8b", "A100:1", workload="fixed:in=8,out=8,requests=2").workload_text() == (
        "fixed:in=8,out=8,requests=2")


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"policy": "fastest"}, PolicyError, "unknown policy 'fastest'; policies: homogeneous, request-dist"),
        ({"objective": "cost"}, PlanConfigError, "--objective must be one of throughput, latency (got 'cost')"),
        ({"prices": "spot"}, PlanConfigError, "--prices must be relative or cloud_usd (got 'spot')"),
        ({"max_batch": 0}, PlanConfigError, "--max-batch must be at least 1 (got 0)"),
        ({"cache_ctx": 0}, PlanConfigError, "--ctx must be at least 1 (got 0)"),
    ],
)
def test_bad_options(change, error, message):
    config = PlanConfig("llama-3.1-8b", "A100:1,L40S:1", **change)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        config.check()
    with pytest.raises(error):
        PlanContext.from_config(config)


def test_the_context_of_a_request():
    config = PlanConfig("smollm2-135m", "A100:1,L40S:1", "fixed:in=64,out=16,requests=4", max_batch=4,
                        prices="cloud_usd", routing_skew=0.5, cache_ctx=128)
    ctx = PlanContext.from_config(config)
    assert (ctx.model, ctx.workload_text, ctx.max_batch, ctx.price_scenario) == (
        "smollm2-135m", "fixed:in=64,out=16,requests=4", 4, "cloud_usd")
    assert ctx.routing_skew == 0.5 and ctx.cache_ctx == 128
    assert [d.spec.id for d in ctx.cluster.devices] == ["A100", "L40S"]
    assert all(p.ctx == 128 for p in ctx.phases if p.ctx is not None)


def test_contexts_share_traced_graphs_through_one_dict():
    graphs: dict = {}
    config = PlanConfig("smollm2-135m", "A100:1,L40S:1", "fixed:in=32,out=8,requests=2", max_batch=2)
    first = PlanContext.from_config(config)
    first.graphs = graphs
    first.graph(first.main_phase)
    second = PlanContext(first.model, first.cluster, first.workload, first.workload_text, first.max_batch,
                         graphs=graphs)
    assert second.graph(second.main_phase) is first.graph(first.main_phase)
    assert len(graphs) == 1
