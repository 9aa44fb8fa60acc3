"""Plans for the runtime's shapes: attention-ffn at one micro-batch, request-dist's exact batch split."""

from __future__ import annotations

import pytest

from tessera.cost.features import block_of
from tessera.plan.context import PlanningError
from tessera.plan.policies import attention_ffn, request_dist, split_rows
from tessera.runtime.session import runtime_context


def test_split_rows_is_exact_and_proportional():
    assert split_rows(64, [2448.6, 1350.2]) == [41, 23]
    assert split_rows(8, [1.0, 1.0]) == [4, 4]
    assert split_rows(7, [1.0, 1.0, 1.0]) == [3, 2, 2]
    assert split_rows(1, [1.0, 1.0]) == [1, 0]  # fewer rows than replicas: one gets none
    assert split_rows(2, [1.0, 3.0, 1.0]) == [1, 1, 0]  # largest remainders: 0.4 beats 0.2; ties go first
    for batch in range(0, 20):
        assert sum(split_rows(batch, [0.3, 1.1, 2.9])) == batch
    with pytest.raises(PlanningError, match="cannot split"):
        split_rows(4, [0.0, 0.0])


@pytest.fixture(scope="module")
def one_request():
    """smollm2-135m on cpu:2 at `tessera run`'s shapes: one request, M fixed at 1 (cost model, no profile)."""
    return runtime_context("smollm2-135m", 2, 5, 4, 64)


def test_attention_ffn_plans_at_one_micro_batch_when_the_batch_cannot_be_split(one_request):
    plan = attention_ffn(one_request, "throughput")
    assert plan.feasible, plan.reason
    decode = plan.step("decode")
    assert decode.micro_batches == 1
    graph = one_request.graph(one_request.main_phase)
    where = {blk: {t for k, t in zip(graph.kernels, decode.assignment, strict=True) if block_of(k) == blk}
             for blk in ("attention", "ffn")}
    assert len(where["attention"]) == 1 and len(where["ffn"]) == 1 and where["attention"] != where["ffn"], where


@pytest.mark.parametrize("batch", [1, 3])
def test_request_dist_divides_the_runtime_batch_exactly(batch):
    ctx = runtime_context("smollm2-135m", 2, 5, 4, 64, batch=batch)
    plan = request_dist(ctx, "throughput")
    assert plan.applicable and plan.feasible, plan.reason
    decodes = [s for s in plan.steps if s.phase == "decode"]
    assert sum(s.batch for s in decodes) == batch
    assert all(s.batch > 0 for s in decodes)
    assert len(decodes) == min(batch, 2)
    assert sorted(s.solver["target_offset"] for s in decodes) == list(range(len(decodes)))


@pytest.mark.parametrize("policy", ["prefill-decode", "layer-pipeline", "attention-ffn"])
def test_a_named_policys_other_objective_keeps_its_placement(policy):
    """The latency step plans of a named policy keep every kernel on the target the policy put it on (the
    serving monitor switches to them under light load: prefill-decode must stay prefill-decode), at the latency
    bucket's shape and one micro-batch."""
    from tessera.plan.objective_steps import add_objective_steps
    from tessera.plan.planner import plan_policy

    ctx = runtime_context("smollm2-135m", 2, 16, 8, 128, batch=16)
    plan = plan_policy(ctx, policy, "throughput")
    assert plan.feasible, plan.reason
    add_objective_steps(ctx, plan, "latency")
    for phase in ("prefill", "decode"):
        through, latency = plan.step(phase, "throughput"), plan.step(phase, "latency")
        assert latency.micro_batches == 1 and latency.solver["method"] == "fixed"
        assert latency.batch <= 8
        assert len(latency.assignment) == len(through.assignment)  # the same kernels at another batch
        assert list(latency.assignment) == list(through.assignment), phase


def test_tesseras_own_policy_solves_its_other_objective():
    from tessera.plan.objective_steps import add_objective_steps
    from tessera.plan.planner import plan_policy

    ctx = runtime_context("smollm2-135m", 2, 16, 8, 128, batch=16)
    plan = add_objective_steps(ctx, plan_policy(ctx, "tessera", "throughput"), "latency")
    assert all(s.solver.get("method") != "fixed" for s in plan.steps if s.objective == "latency")
