"""The upper bound on throughput: never below any policy's plan (a tiny model of every family on a GPU
pair), exact on a hand-computed LP, and its batch shrunk by memory where memory binds."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from tessera.cli.main import app
from tessera.hardware.cluster import parse_cluster
from tessera.plan.bound import (
    PhaseCosts,
    admissible_batch,
    candidate_batches,
    fractional_request_time,
    headroom_share,
    upper_bound,
)
from tessera.plan.config import AdmissionConfig
from tessera.plan.context import PlanContext
from tessera.plan.planner import compare
from tessera.plan.policies import homogeneous, prefill_decode, request_dist
from tessera.workload import parse_workload

PAIR = "A100:1,L40S:1"
TEXT = "fixed:in=64,out=16,requests=16"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A local folder of a tiny random-init model of every family (diffusion: a pipeline's configs)."""
    from tessera.capture.tiny import tiny_config

    root = tmp_path_factory.mktemp("models")
    paths = {}
    for family in ("llm", "moe", "ssm", "vlm"):
        paths[family] = str(root / f"tiny-{family}")
        tiny_config(family).save_pretrained(paths[family])
    pipeline = root / "tiny-diffusion"
    for name, cfg in tiny_config("diffusion").items():
        (pipeline / name).mkdir(parents=True)
        (pipeline / name / ("scheduler_config.json" if name == "scheduler" else "config.json")).write_text(json.dumps(cfg))
    paths["diffusion"] = str(pipeline)
    return paths


CASES = {  # family -> (workload, fixed batch, extra context options)
    "llm": (TEXT, 8, {}),
    "moe": (TEXT, 8, {}),  # Tessera may split expert GEMMs: the LP has that mode too
    "ssm": (TEXT, 8, {}),
    "vlm": ("fixed:in=160,out=16,requests=16", 8, {"image": "112x112"}),  # a small image fits the tiny context
    "diffusion": ("images:steps=2,resolution=64,requests=4", 2, {}),
    "diffusion-engine": ("images:steps=2,resolution=64,requests=16", None, {}),  # 4 images in every engine
    "llm-admitted": ("fixed:in=64,out=16,requests=512", None, {}),  # no fixed batch: B = max_num_seqs
    # a runtime plan: one copy of the model, the runtime's M and cache context (prefill's state rows follow M)
    "llm-runtime": (TEXT, 8, {"micro_batches": 2, "cache_ctx": 128, "single_replica": True}),
    "llm-groups": (TEXT, 8, {"cluster": "A100:2,L40S:1"}),  # replicas and a two-GPU group of A100s
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_policy_beats_the_bound(tiny_models, case):
    workload, batch, extra = CASES[case]
    extra = dict(extra)
    cluster = extra.pop("cluster", PAIR)
    model = tiny_models[case.split("-")[0]]
    ctx = PlanContext(model, parse_cluster(cluster), parse_workload(workload), workload, batch, **extra)
    plans = compare(ctx)
    bound = upper_bound(ctx)
    feasible = [p for p in plans if p.applicable and p.feasible]
    assert len(feasible) >= 4 and all(p.throughput > 0 for p in feasible)
    for p in plans:
        assert p.bound == bound.throughput
    for p in feasible:  # the steady state too (a finite workload reports outputs over its makespan)
        best = max(p.throughput, p.extra.get("steady_state_throughput", 0.0))
        assert best <= bound.throughput * (1 + 1e-9), (p.policy, p.device, best, bound)
    assert sum(bound.work_share.values()) == pytest.approx(1.0)
    assert all(sum(s.values()) == pytest.approx(1.0) for s in bound.phase_share.values())
    assert set(bound.phase_share) == {ph.phase for ph in ctx.phases}
    assert (bound.compute_types or bound.link_types) and bound.seconds > 0
    if not ctx.admits:  # a fixed batch: the one asked for, or diffusion's default images per engine
        assert bound.batch == (batch or 4) and bound.batch_limited_by == "fixed batch"
    else:
        assert bound.batch == ctx.admission.max_num_seqs and bound.batch_limited_by == "max_num_seqs"
        assert bound.candidates == (32, 64, 128, 256)  # down to B / 8: the repeated phase in M = 1..8
        # the engines admit from memory: here every one holds as many sequences as it may
        assert ctx.admits and all(p.admission.max_seqs == bound.batch for p in feasible if p.admission)


def test_lp_is_exact_on_a_hand_computed_instance():
    # kernel a: 2 s on A, 6 s on B; kernel b: 6 s on A, 1 s on B. All of b on B, a fraction x of a on B
    # too: A carries 2 (1 - x), B carries 1 + 6 x; balanced at x = 1/8, T = 1.75 s (b on A costs more)
    costs = PhaseCosts("decode", 1, 1.0, np.array([[2.0, 6.0], [6.0, 1.0]]))
    lp = fractional_request_time([[costs]], [1, 1])
    assert lp.request_time_s == pytest.approx(1.75, rel=1e-9)
    assert lp.loads == pytest.approx([1.75, 1.75], rel=1e-9)
    # two GPUs of B halve its per-GPU load: A carries 2 (1 - x), each B (1 + 6 x) / 2: x = 3/10, T = 1.4 s
    assert fractional_request_time([[costs]], [1, 2]).request_time_s == pytest.approx(1.4, rel=1e-9)
    # a kernel that cannot run on B goes to A whole; a phase run once per request adds to the same loads
    only_a = PhaseCosts("prefill", 1, 1.0, np.array([[0.5, np.inf]]))
    lp = fractional_request_time([[only_a], [costs]], [1, 1])
    # A: 0.5 + 2 (1 - x), B: 1 + 6 x -> x = 1.5 / 8, T = 1 + 9 / 8
    assert lp.request_time_s == pytest.approx(1 + 6 * 1.5 / 8, rel=1e-9)
    # work in fastest-type seconds: a's 2 s split 13/16 : 3/16, b's 1 s on B, the prefill's 0.5 s on A
    assert lp.work["decode"] == pytest.approx([2 * 13 / 16, 2 * 3 / 16 + 1], rel=1e-9)
    assert lp.work["prefill"] == pytest.approx([0.5, 0.0], abs=1e-12)
    # the repeated phase at two batches: per request the cheaper one is taken
    cheap = PhaseCosts("decode", 2, 0.5, np.array([[2.0, 6.0], [6.0, 1.0]]))
    lp = fractional_request_time([[costs, cheap]], [1, 1])
    assert lp.request_time_s == pytest.approx(1.75 / 2, rel=1e-9) and lp.mode_share[0] == pytest.approx([0, 1])
    # an expert kernel: 4 s whole on either type, or split into two parts of 1 s on A (3 s on B) and a free
    # combine. Whole alone balances at 2 s; split at a share u with its parts on A and the rest whole on
    # B: A carries 2 u, B 4 (1 - u), u = 2/3, T = 4/3 s (the LP dual: prices 2/3 on A, 1/3 on B)
    whole = PhaseCosts("decode", 1, 1.0, np.array([[4.0, 4.0]]))
    assert fractional_request_time([[whole]], [1, 1]).request_time_s == pytest.approx(2.0, rel=1e-9)
    split = PhaseCosts("decode", 1, 1.0, np.array([[4.0, 4.0]]), {0: np.array([[1.0, 3.0], [1.0, 3.0], [0.0, 0.0]])})
    assert fractional_request_time([[split]], [1, 1]).request_time_s == pytest.approx(4 / 3, rel=1e-9)


def test_transfers_are_charged_to_the_senders_links():
    # the instance above with an edge a -> b of 10 bytes per step. At 10 B/s a full cut costs 1 s, the
    # optimum's 7/8 of a cut fits in its 1.75 s: nothing changes
    edge = np.array([[0, 1, 10.0]])
    costs = PhaseCosts("decode", 1, 1.0, np.array([[2.0, 6.0], [6.0, 1.0]]), edges=edge)
    assert fractional_request_time([[costs]], [1, 1], [10.0, 10.0]).request_time_s == pytest.approx(1.75, rel=1e-9)
    # at 2 B/s a cut costs 5 s. With a's share alpha on A and b's beta: A carries 2 alpha + 6 beta, B
    # 6 (1 - alpha) + (1 - beta), A's link 5 (alpha - beta); all three equal at beta = 3 alpha / 11,
    # alpha = 77 / 109: T = 280 / 109 s, between the free-transfer 1.75 and no cut at all (56 / 15)
    lp = fractional_request_time([[costs]], [1, 1], [2.0, 2.0])
    assert lp.request_time_s == pytest.approx(280 / 109, rel=1e-9)
    assert lp.link_s == pytest.approx([280 / 109, 0.0], abs=1e-9)
    assert lp.loads == pytest.approx([280 / 109, 280 / 109], rel=1e-9)
    assert fractional_request_time([[costs]], [1, 1]).link_s == pytest.approx([0.0, 0.0])  # not asked: free


def test_memory_shrinks_the_batch_where_it_binds():
    text = "fixed:in=4096,out=1024,requests=256"
    ctx = PlanContext("llama-3.1-8b", parse_cluster("L4:1,A10:1"), parse_workload(text), text)
    batch, why, memory = admissible_batch(ctx)
    # one sequence's K and V at the mean context: 2 x 32 layers x 8 kv heads x 128 x bf16 x (4096 + 512)
    assert memory["state_per_sequence"] == 2 * 32 * 8 * 128 * 2 * (4096 + 512)
    assert memory["capacity"] == pytest.approx((24e9 + 24e9) * 0.9, rel=0.02)
    assert 15e9 < memory["weights"] < 17e9
    assert why == "memory" and batch == int(memory["free"] // memory["state_per_sequence"]) < 256
    roomier = PlanContext("llama-3.1-8b", parse_cluster("L4:1,A10:1"), parse_workload(text), text,
                          admission=AdmissionConfig(memory_utilization=1.0), graphs=ctx.graphs)
    small, big = upper_bound(ctx), upper_bound(roomier)
    assert small.batch == batch and small.batch_limited_by == "memory" and big.batch > small.batch
    assert big.throughput > small.throughput  # per-token decode cost falls with the batch
    # a plan at the most sequences memory could hold (fit or not) stays under the bound: its engine's rows
    # are at most B, and its kernels run whole on one type
    at_most = ctx.for_batch(batch)
    for plan in (homogeneous(at_most, "throughput", "L4"), homogeneous(at_most, "throughput", "A10"),
                 prefill_decode(at_most, "throughput")):
        assert 0 < plan.extra["steady_state_throughput"] <= small.throughput * (1 + 1e-9)


def test_candidates_and_headroom():
    assert candidate_batches(256) == (32, 64, 128, 256)
    assert candidate_batches(44) == (5, 11, 22, 44)
    assert candidate_batches(48) == (6, 12, 24, 48)  # the planner's graphs for an engine at 48 and M = 1..8
    assert candidate_batches(1) == (1,)
    assert headroom_share(150.0, 100.0, 200.0) == pytest.approx(0.5)
    assert headroom_share(100.0, 100.0, 100.5) is None  # within 1%: no headroom


def test_cli_prints_the_bound(tiny_models):
    args = ["plan", tiny_models["llm"], "--cluster", PAIR, "--workload", TEXT, "--max-batch", "8", "--compare"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    bound = rows[-1]["bound"]
    assert all(r["bound"] == bound for r in rows) and bound > max(r["throughput"] for r in rows)
    base = max(r["throughput"] for r in rows[:-1] if r["feasible"])
    assert rows[-1]["headroom_share"] == pytest.approx((rows[-1]["throughput"] - base) / (bound - base))


def test_diffusion_engines_each_hold_the_default_images_and_a_fixed_batch_is_shared(tiny_models):
    text = "images:steps=2,resolution=64,requests=16"
    own = PlanContext(tiny_models["diffusion"], parse_cluster(PAIR), parse_workload(text), text)
    shared = PlanContext(tiny_models["diffusion"], parse_cluster(PAIR), parse_workload(text), text, 4)
    assert not own.shared_batch and shared.shared_batch
    rows = {name: [s.batch for s in request_dist(c, "throughput").steps if s.phase == "step"]
            for name, c in (("own", own), ("shared", shared))}
    assert rows["own"] == [4, 4]  # each replica its own 4 images, as a homogeneous engine has
    assert sum(rows["shared"]) == 4 and len(rows["shared"]) == 2  # --max-batch 4: the deployment's, split
