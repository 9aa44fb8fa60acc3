"""Engine-like admission in the planner: each engine admits the sequences its memory holds (paged state at
the mean context, after weights and activations, at the utilisation share), up to max_num_seqs; the
prefill side of prefill-decode holds only the prompt it computes."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.hardware.cluster import parse_cluster
from tessera.hardware.devices import resolve_device
from tessera.plan.admission import MemoryShape, admit, round_batch
from tessera.plan.build import activation_peak
from tessera.plan.config import AdmissionConfig, PlanConfig, PlanConfigError
from tessera.plan.context import PlanContext
from tessera.plan.planner import plan_policy
from tessera.workload import parse_workload

LLAMA_KV_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x kv heads x head dim x bf16 bytes
WORKLOAD = "fixed:in=2048,out=1024,requests=1000"  # long prompts: the A100's memory binds below 256


def shape(capacity: float, fixed: float, per_seq: float, tokens: float = 1000.0) -> MemoryShape:
    return MemoryShape(["X"], np.array([capacity]), np.array([fixed]), np.array([per_seq]), tokens)


def test_admission_by_hand():
    cfg = AdmissionConfig()  # 256 sequences, 0.9 of memory, 16-token blocks
    # 0.9 x 48 GB - 16 GB = 27.2 GB free; 0.2 GB per sequence -> 136, traced as 128 (a multiple of 16)
    a = admit(shape(48e9, 16e9, 0.2e9), cfg, 256)
    assert a.max_seqs == 128 and "memory on X" in a.limited_by
    assert a.kv_tokens == int(27.2e9 / (0.2e9 / 1000)) and a.kv_blocks == a.kv_tokens // 16
    # 0.9 x 80 - 16 = 56 GB holds 280 sequences: max_num_seqs binds
    a = admit(shape(80e9, 16e9, 0.2e9), cfg, 256)
    assert a.max_seqs == 256 and a.limited_by == "--max-num-seqs 256"
    assert admit(shape(80e9, 16e9, 0.2e9), cfg, 100, cap_reason="the workload's 100 requests").max_seqs == 96
    # small counts are kept exactly, down to a multiple of M
    assert admit(shape(20e9, 16e9, 0.5e9), cfg, 256).max_seqs == 4
    assert admit(shape(20e9, 16e9, 0.5e9), cfg, 256, micro_batches=4).max_seqs == 4
    assert admit(shape(20e9, 16e9, 0.5e9), cfg, 256, micro_batches=8).max_seqs == 0


def test_no_fit_only_when_weights_and_one_sequence_do_not_fit():
    cfg = AdmissionConfig()
    weights = admit(shape(16e9, 15e9, 0.1e9), cfg, 256)  # 14.4 GB usable < 15 GB of weights
    assert weights.max_seqs == 0 and weights.limited_by.startswith("no fit: X needs 15.0 GB")
    one = admit(shape(16e9, 14e9, 0.5e9), cfg, 256)  # 0.4 GB left, a sequence needs 0.5
    assert one.max_seqs == 0 and "below one sequence's state" in one.limited_by
    assert admit(shape(16e9, 14e9, 0.3e9), cfg, 256).max_seqs == 1


@pytest.mark.parametrize("n, m, expected", [(1, 1, 1), (7, 2, 6), (32, 8, 32), (33, 1, 32), (255, 4, 240)])
def test_round_batch(n, m, expected):
    assert round_batch(n, m) == expected


def test_bad_admission_options_are_refused():
    for cfg, text in [(AdmissionConfig(max_num_seqs=0), "--max-num-seqs must be at least 1"),
                      (AdmissionConfig(memory_utilization=1.5), "--gpu-memory-utilization must be in"),
                      (AdmissionConfig(block_size=0), "--block-size must be at least 1")]:
        with pytest.raises(PlanConfigError, match=text):
            PlanConfig("llama-3.1-8b", "A100:1", admission=cfg).check()


@pytest.fixture(scope="module")
def llama_pair():
    return PlanContext("llama-3.1-8b", parse_cluster("A100:1,L40S:1"), parse_workload(WORKLOAD), WORKLOAD)


def test_a_homogeneous_engine_admits_its_hand_computed_kv_capacity(llama_pair):
    ctx = llama_pair
    assert ctx.admits and ctx.batch == 256  # probed at max_num_seqs, then memory decides
    plan = plan_policy(ctx, "homogeneous", device="A100")
    decode = plan.step("decode")
    prefill, probe = ctx.phases[0], ctx.main_phase
    weights = sum(b.nbytes for b in ctx.graph(probe).buffers.values() if b.kind == "weight")
    reserve = max(activation_peak(ctx.graph(prefill)), activation_peak(ctx.graph(probe)))
    free = 0.9 * resolve_device("A100").memory_bytes - weights - reserve
    mean_ctx = 2048 + 1024 // 2  # a request's mean context: its prompt and half its output
    by_hand = int(free // (LLAMA_KV_PER_TOKEN * mean_ctx))
    assert by_hand < 256
    assert plan.admission.max_seqs == by_hand // 16 * 16 == decode.batch == decode.rows
    assert plan.admission.kv_tokens == int(free // LLAMA_KV_PER_TOKEN)
    assert "memory on A100" in plan.admission.limited_by
    assert plan.feasible and plan.memory_bytes[0] <= 0.9 * resolve_device("A100").memory_bytes


def test_the_prefill_side_holds_only_the_prompt_it_computes(llama_pair):
    ctx = llama_pair
    plan = plan_policy(ctx, "prefill-decode")
    assert plan.feasible, plan.reason
    pre = plan.step("prefill").assignment[0]
    dec = plan.step("decode").assignment[0]
    assert pre != dec
    graph = ctx.graph(ctx.phases[0])
    weights = sum(b.nbytes for b in graph.buffers.values() if b.kind == "weight")
    prompt_kv = 2048 * LLAMA_KV_PER_TOKEN
    reserve = max(activation_peak(graph), activation_peak(ctx.graph(ctx.main_phase)))
    assert plan.memory_bytes[pre] == pytest.approx(weights + prompt_kv + reserve, rel=1e-9)
    # the decode side admits from its own memory: the KV of every decoding sequence lives there
    assert plan.admission.max_seqs == plan.step("decode").batch
    assert plan.admission.limited_by.startswith(f"memory on {plan.targets[dec]}")


def test_every_baseline_fits_and_request_dist_adds_its_engines(llama_pair):
    from tessera.plan.planner import baselines

    plans = baselines(llama_pair)  # Tessera >= every baseline is tested on smaller cases (test_planner)
    by = {(p.policy, p.device): p for p in plans}
    assert all(p.applicable and p.feasible for p in plans), [(p.policy, p.reason) for p in plans if not p.feasible]
    a100, l40s = by[("homogeneous", "A100")], by[("homogeneous", "L40S")]
    assert a100.admission.max_seqs > l40s.admission.max_seqs  # each engine admits from its own memory
    rd = by[("request-dist", None)]
    assert rd.throughput >= 0.9 * (a100.throughput + l40s.throughput)
    assert [r["admission"]["max_seqs"] for r in rd.extra["replicas"]] == [a100.admission.max_seqs,
                                                                          l40s.admission.max_seqs]


def test_a_fixed_batch_keeps_the_flat_cap():
    ctx = PlanContext("smollm2-135m", parse_cluster("A100:1"), parse_workload("fixed:in=128,out=16,requests=64"),
                      "fixed:in=128,out=16,requests=64", 8)
    assert not ctx.admits
    plan = plan_policy(ctx, "homogeneous")
    assert plan.admission is None and plan.step("decode").batch == 8


def test_weights_that_do_not_fit_are_no_fit_with_the_reason():
    ctx = PlanContext("llama-3.1-8b", parse_cluster("L4:1"), parse_workload(WORKLOAD), WORKLOAD,
                      admission=AdmissionConfig(memory_utilization=0.6))
    plan = plan_policy(ctx, "homogeneous")
    assert not plan.feasible
    assert plan.reason.startswith("no fit: L4 needs 16.") and "GB for weights and activations, above 14.4 GB" in plan.reason
