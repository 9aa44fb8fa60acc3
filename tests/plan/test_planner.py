"""Deployment planning end to end: every policy on real traced graphs, memory, state moves, plan files
and bad input."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tessera.capture.api import trace_model
from tessera.cli.main import app
from tessera.hardware.cluster import Cluster, ClusterSpecError, Link, parse_cluster
from tessera.plan.config import POLICIES, PolicyError
from tessera.plan.context import PlanContext, PlanningError
from tessera.plan.deployment import DeploymentPlan, PlanFileError
from tessera.plan.planner import compare, plan_policy
from tessera.plan.policies import applicability
from tessera.plan.targets import TargetError, cluster_targets, link_between
from tessera.workload import parse_workload

SMALL = "fixed:in=512,out=64,requests=32"


def context(model: str, cluster: str, workload: str = SMALL, max_batch: int | None = 8) -> PlanContext:
    return PlanContext(model, parse_cluster(cluster), parse_workload(workload), workload, max_batch, gap=0.01)


@pytest.fixture(scope="module")
def smollm2_compare():
    ctx = context("smollm2-135m", "A100:1,L40S:1")
    return ctx, compare(ctx)


def test_every_policy_is_solved_and_tessera_never_loses(smollm2_compare):
    ctx, plans = smollm2_compare
    assert [p.policy for p in plans] == ["homogeneous", "homogeneous", *POLICIES[1:]]
    assert {p.device for p in plans[:2]} == {"A100", "L40S"}
    assert all(p.applicable and p.feasible and p.throughput > 0 for p in plans)
    tess = plans[-1]
    assert tess.throughput >= max(p.throughput for p in plans[:-1]) * (1 - 1e-9)
    for p in plans:
        assert p.cost_per_hour > 0 and p.latency_s > 0
        for s in p.steps:  # every kernel of the step's graph is placed on one of the plan's targets
            assert len(s.assignment) > 100 and min(s.assignment) >= 0 and max(s.assignment) < len(p.targets)
    by = {p.policy: p for p in plans[2:]}
    assert by["attention-ffn"].step("decode").micro_batches >= 2  # ping-pong needs two micro-batches
    assert "layers" in by["layer-pipeline"].reason and "on" in by["layer-pipeline"].reason


def test_homogeneous_plan_is_the_cost_model_step_time(smollm2_compare):
    from tessera.cost.model import CostModel
    from tessera.hardware.devices import resolve_device

    ctx, plans = smollm2_compare
    a100 = next(p for p in plans if p.device == "A100")
    decode = a100.step("decode")
    graph = trace_model("smollm2-135m", "decode", batch=8, ctx=512 + 32)
    assert decode.graph_hash == graph.hash
    t = CostModel(resolve_device("A100")).step_time(graph)
    assert decode.cycle_s == pytest.approx(t)
    prefill = a100.step("prefill").cycle_s
    request = prefill + 64 / 8 * t  # one prefill plus 64 decode steps shared by 8 rows, on the same device
    assert a100.request_time_s == pytest.approx(request)
    assert a100.extra["steady_state_throughput"] == pytest.approx(64 / request)
    # 32 requests arrive at once, 8 in flight: four waves of a whole request's latency, or the work
    makespan = max(32 * request, 4 * (a100.ttft_s + 64 * t))
    assert a100.throughput == pytest.approx(32 * 64 / makespan)


def test_prefill_decode_moves_the_kv_cache_and_costs_it(smollm2_compare):
    ctx, plans = smollm2_compare
    pd = next(p for p in plans if p.policy == "prefill-decode")
    assert len(pd.state_moves) == 2 * 30  # K and V of each of smollm2's 30 layers
    targets = cluster_targets(ctx.cluster)
    for mv in pd.state_moves:
        assert mv.bytes_per_request == 512 * 3 * 64 * 2  # the prompt's K (or V): tokens x kv heads x dim x bf16
        link = link_between(ctx.cluster, targets[mv.src], targets[mv.dst])
        assert mv.seconds_per_request == pytest.approx(link.latency_s + mv.bytes_per_request / link.bandwidth)


def test_tessera_chooses_a_state_move_when_prefill_runs_elsewhere():
    # long prompts: prefill on the A100 (compute), part of the decode on the L40S
    ctx = context("smollm2-135m", "A100:1,L40S:1", "fixed:in=4096,out=64,requests=32", 16)
    plan = plan_policy(ctx, "tessera")
    assert plan.feasible and plan.state_moves
    prefill, decode = plan.step("prefill"), plan.step("decode")
    graph = ctx.graph(ctx.phases[0])
    for mv in plan.state_moves:  # the move goes from where prefill wrote the cache to where decode reads it
        writer = next(a.kernel for a in graph.accesses if a.buffer == mv.buffer and a.mode == "write")
        assert prefill.assignment[writer] == mv.src and mv.dst != mv.src
        assert mv.seconds_per_request > 0
    assert decode is not None


def test_memory_aware_plan_fits_where_replication_does_not():
    ctx = context("llama-3.1-8b", "L4:1,A10:1", "fixed:in=1024,out=1024,requests=64", 48)
    plans = {(p.policy, p.device): p for p in compare(ctx)}
    for key in (("homogeneous", "L4"), ("homogeneous", "A10"), ("request-dist", None), ("prefill-decode", None)):
        p = plans[key]
        assert not p.feasible and "GB more" in p.reason, key
    tess = plans[("tessera", None)]
    assert tess.feasible and tess.throughput > 0
    assert all(m <= c for m, c in zip(tess.memory_bytes, tess.memory_capacity, strict=True))
    # the weights are split, not replicated: each target holds only what its kernels read
    weights = [k for k in tess.residency if not k.startswith("cache.")]
    assert any(len(tess.residency[w]) == 1 for w in weights)


def test_plan_files_round_trip_and_reject_other_graphs(smollm2_compare, tmp_path):
    ctx, plans = smollm2_compare
    plan = plans[-1]
    path = plan.save(tmp_path / "plan.json")
    again = DeploymentPlan.load(path)
    assert again.summary() == plan.summary() and again.steps == plan.steps
    step = plan.step("decode")
    assert again.check_graph("decode", step.graph_hash) == step
    other = trace_model("smollm2-135m", "decode", batch=4, ctx=128)
    with pytest.raises(PlanFileError, match="different model, shape or batch"):
        again.check_graph("decode", other.hash)
    with pytest.raises(PlanFileError, match="no throughput step plan for phase 'encode'"):
        again.check_graph("encode", other.hash)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(PlanFileError, match="not a Tessera plan"):
        DeploymentPlan.load(tmp_path / "bad.json")
    with pytest.raises(PlanFileError, match="cannot read"):
        DeploymentPlan.load(tmp_path / "missing.json")


def test_one_device_degenerates_to_the_homogeneous_plan():
    ctx = context("smollm2-135m", "A100:1")
    plan = plan_policy(ctx, "tessera")
    assert plan.policy == "tessera" and "homogeneous" in plan.reason
    homo = plan_policy(ctx, "homogeneous")
    assert plan.throughput == pytest.approx(homo.throughput)
    assert all(set(s.assignment) == {0} for s in plan.steps)


def test_bad_input():
    with pytest.raises(ClusterSpecError, match="empty cluster spec"):
        parse_cluster("")
    empty = Cluster(nodes=[], devices=[], intra={}, inter=Link("ib", 25e9, 1e-6))
    with pytest.raises(TargetError, match="no devices"):
        cluster_targets(empty)
    ctx = context("smollm2-135m", "A100:1,L40S:1")
    with pytest.raises(PolicyError, match="unknown policy 'fastest'"):
        plan_policy(ctx, "fastest")
    with pytest.raises(PolicyError, match="needs --device"):
        plan_policy(ctx, "homogeneous")
    with pytest.raises(PolicyError, match="has no H100"):
        plan_policy(ctx, "homogeneous", device="H100")
    with pytest.raises(PlanningError, match="image requests"):
        context("sd3.5-medium", "A100:1,L40S:1")
    with pytest.raises(PlanningError, match="text requests"):
        context("smollm2-135m", "A100:1,L40S:1", "images:steps=28,resolution=1024")
    too_small = context("llama-3.1-8b", "L4:1", "fixed:in=1024,out=1024,requests=64", 64)
    plan = plan_policy(too_small, "tessera")
    assert not plan.feasible and "L4 needs" in plan.reason and "GB more" in plan.reason


def test_policies_that_do_not_apply_say_why():
    assert "diffusion" in applicability(context("sd3.5-medium", "A100:1,L40S:1", "images:steps=2,resolution=256", 1),
                                        "prefill-decode")
    ssm = context("mamba-codestral-7b", "A100:1,L40S:1")
    assert "SSM" in applicability(ssm, "attention-ffn")
    assert applicability(ssm, "layer-pipeline") is None
    one_type = context("smollm2-135m", "A100:2")
    assert "the cluster has one" in applicability(one_type, "prefill-decode")
    plan = plan_policy(one_type, "attention-ffn")
    assert plan.reason.startswith("one device type")


def test_plan_cli_compare_json_and_files(tmp_path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", "smollm2-135m", "--cluster", "A100:1,L40S:1", "--workload", SMALL,
                                      "--max-batch", "8", "--compare", "--json", "-o", str(out)])
    assert result.exit_code == 0, result.output
    entries = json.loads(result.stdout)
    assert [e["policy"] for e in entries] == ["homogeneous", "homogeneous", *POLICIES[1:]]
    for e in entries:
        assert {"policy", "applicable", "throughput", "cost_per_hour", "latency_s"} <= set(e)
    assert DeploymentPlan.load(out).policy == "tessera" and out.with_suffix(".png").stat().st_size > 10_000
    bad = CliRunner().invoke(app, ["plan", "smollm2-135m", "--cluster", "A100:1", "--policy", "nope"])
    assert bad.exit_code == 2 and "unknown policy 'nope'" in bad.output
    bad = CliRunner().invoke(app, ["plan", "smollm2-135m", "--cluster", "A100:1", "--objective", "speed"])
    assert bad.exit_code == 2 and "--objective must be one of" in bad.output


def test_plan_cli_table(tmp_path):
    result = CliRunner().invoke(app, ["plan", "smollm2-135m", "--cluster", "A100:1,L40S:1", "--workload", SMALL,
                                      "--max-batch", "8", "--policy", "layer-pipeline"])
    assert result.exit_code == 0, result.output
    assert "layer-pipeline" in result.stdout and "tokens/s" in result.stdout


def test_expert_groups_of_an_moe_layer_can_live_on_different_targets():
    ctx = context("gpt-oss-20b", "A100:1,L40S:1", "fixed:in=256,out=64,requests=16", 8)
    targets = cluster_targets(ctx.cluster)
    decode = ctx.main_phase
    whole = ctx.step_problem(decode, targets, 1)
    split = ctx.step_problem(decode, targets, 1, expert_parts=2)
    experts = [k.index for k in split.graph.kernels if k.op_class == "grouped_gemm"]
    assert len(experts) == 2 * 24
    assert split.problem.kernels == whole.problem.kernels + 2 * len(experts)  # two parts + a combine each
    # in every phase, hot experts (part 0) on the A100, cold ones (part 1) on the L40S, the rest on the A100
    def cold_on_l40s(ph):
        return tuple(1 if tag == 1 else 0 for _, tag in ctx.step_problem(ph, targets, 1, 2).mapping.origin)

    on = list(cold_on_l40s(decode))
    plan = ctx.assemble("tessera", targets, 1, [(ph, 1, cold_on_l40s(ph), {"expert_parts": 2}) for ph in ctx.phases])
    step = plan.step("decode")
    assert {int(k) for k in step.expert_parts} == set(experts)
    assert all(v == [0, 1] for v in step.expert_parts.values())
    assert split.problem_assignment(step.assignment, step.expert_parts) == on
    name = next(n for n in plan.residency if n.endswith("[part 1]"))
    assert plan.residency[name] == [1] and plan.residency[name.replace("[part 1]", "[part 0]")] == [0]
    held_by_l40s = sum(split.problem.memory.item_bytes[w] for w, n in enumerate(split.problem.memory.item_names)
                       if n.endswith("[part 1]"))
    assert plan.memory_bytes[1] == pytest.approx(held_by_l40s + max(
        ctx.step_problem(ph, targets, 1, 2).activation_reserve for ph in ctx.phases))
    assert step.cut_edges > 0 and step.cycle_s > 0
