"""Folding and merging keep a problem's busy times and link loads exact; the evaluator is hand-checked."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.capture.api import trace_model
from tessera.graph.dataflow import colocation, data_edges
from tessera.graph.layers import layer_structure
from tessera.hardware.cluster import parse_cluster
from tessera.plan.build import build_step_problem, memory_items
from tessera.plan.fold import fold_groups, layer_groups, merge
from tessera.plan.problem import MemorySpec, PlacementProblem, PlacementProblemError
from tessera.plan.step_evaluation import Schedule, evaluate, schedule
from tessera.plan.targets import cluster_targets


def test_a_pipeline_streams_at_its_busiest_stage():
    # 0 -> 1 on a, 2 -> 3 on b, 1 s each, free transfers, 2 micro-batches: one micro-batch takes 4 s; run whole
    # (a: mb 0, 1 at 0-4; b at 2-6) 6 s; streamed with the next steps (a micro-batch's next step waits for its
    # step): 4 s per step
    times = np.ones((4, 2))
    free = np.full((2, 2), np.inf)
    p = PlacementProblem(["a", "b"], times, [(0, 1, 1.0), (1, 2, 1.0), (2, 3, 1.0)], free, np.zeros((2, 2)),
                         micro_batches=2, messages=[1.0, 1.0, 1.0])
    assert schedule(p, (0, 0, 1, 1)) == Schedule(4.0, 4.0, 6.0)
    assert evaluate(p, (0, 0, 1, 1)).cycle_s == 4.0


def test_a_device_that_starts_early_and_then_waits_streams_at_its_busy_time():
    # k0 (1 s) on a; on b, k1 (0.1 s, no inputs) then k2 (1 s, after k0); 2 micro-batches, free transfers.
    # One micro-batch holds b from 0 to 2 (k1 runs at once, k2 waits for k0), so M x that span is 4 s and
    # the step run whole takes 3.1 s; streamed with the next steps, a keeps ahead of b and b only waits
    # in the first step: 2 x 1.1 = 2.2 s per step, b's busy time
    times = np.array([[1.0, np.inf], [np.inf, 0.1], [np.inf, 1.0]])
    free = np.full((2, 2), np.inf)
    p = PlacementProblem(["a", "b"], times, [(0, 2, 1.0)], free, np.zeros((2, 2)), micro_batches=2, messages=[1.0])
    assert schedule(p, (0, 1, 1)) == Schedule(2.0, pytest.approx(2.2), pytest.approx(3.1))
    assert evaluate(p, (0, 1, 1)).cycle_s == pytest.approx(2.2)


def test_evaluate_by_hand():
    # kernels 0 -> 1 -> 2; 0 and 2 on device a, 1 on device b; 2 micro-batches
    times = np.array([[1.0, 2.0], [3.0, 1.0], [2.0, 2.0]])
    bw = np.array([[np.inf, 10.0], [10.0, np.inf]])
    lat = np.array([[0.0, 0.5], [0.5, 0.0]])
    mem = MemorySpec(np.array([5.0, 7.0]), [(0, 0), (2, 0), (1, 1)], np.array([6.0, 6.0]))
    p = PlacementProblem(["a", "b"], times, [(0, 1, 20.0), (1, 2, 10.0)], bw, lat, micro_batches=2,
                         messages=[1.0, 3.0], memory=mem, loop_edges=[(2, 0, 0.0, 1.0)])
    ev = evaluate(p, (0, 1, 0))
    assert ev.busy_s == (2 * 3.0, 2 * 1.0)  # a runs kernels 0 and 2 (1 + 2 s), b kernel 1 (1 s), x M
    link_ab = 0.5 + 20 / 10  # one message, 20 bytes at 10 B/s
    link_ba = 3 * 0.5 + 10 / 10  # three messages, 10 bytes
    assert ev.link_s[0][1] == pytest.approx(2 * link_ab)
    assert ev.link_s[1][0] == pytest.approx(2 * link_ba)  # the loop edge 2 -> 0 is on one device: free
    path = 1.0 + link_ab + 1.0 + link_ba + 2.0
    assert ev.critical_path_s == pytest.approx(path)
    # run whole, in segment order: a runs k0 for mb 0, 1 (0-2); b runs k1 at 3.5-4.5 and 4.5-5.5; a runs k2 at
    # 7-9 and 9-11. Streamed, a would hold micro-batch 0 from 0 to 9 before taking micro-batch 1: 2 x 9.
    assert ev.cycle_s == pytest.approx(11.0) and ev.cycle_s > max(6.0, 2 * link_ab, 2 * link_ba, path)
    assert ev.cut_edges == 2 and ev.cut_bytes == 2 * 30.0
    assert schedule(p, (0, 1, 0)) == Schedule(9.0, 18.0, 11.0)
    assert ev.resident_bytes == (5.0, 7.0) and not ev.memory_ok  # item 1 (7 B) exceeds b's 6 B
    # a cut loop edge loads its link and lengthens the critical path by its transfer
    ev2 = evaluate(p, (0, 0, 1))
    assert ev2.critical_path_s == pytest.approx(1 + 3 + (3 * 0.5 + 10 / 10) + 2 + (0.5 + 0 / 10))


@pytest.fixture(scope="module")
def llama_tiny_problem():
    graph = trace_model("llama-3.1-8b", "decode", batch=4, ctx=256)
    cluster = parse_cluster("A100:1,L40S:1")
    return graph, build_step_problem(graph, cluster_targets(cluster), cluster, micro_batches=2)


def test_step_problem_from_a_traced_graph(llama_tiny_problem):
    graph, sp = llama_tiny_problem
    p = sp.problem
    assert p.times.shape == (len(graph.kernels), 2) and np.isfinite(p.times).all()
    # the KV write and the attention kernel of every layer are tied into one co-located set
    pairs = colocation(graph, data_edges(graph))
    for layer in range(32):
        users = sorted({a.kernel for a in graph.accesses if a.buffer.startswith(f"cache.layer{layer}.")})
        tied = {users[0]}
        for _ in users:
            tied |= {j for i, j in pairs if i in tied} | {i for i, j in pairs if j in tied}
        assert len(users) == 2 and set(users) <= tied
    # the merged QKV GEMM's q and k feed RoPE: batch x (q + k width) bf16 bytes, v goes to the KV write
    qkv = next(k for k in graph.kernels if k.layer == 0 and k.op == "tessera.merged_linear.default")
    out = sorted(b for s, d, b in p.edges if s == qkv.index)
    # v to the KV write; q and k to RoPE, which carries them on: attention, reading q, gets nothing from the GEMM
    assert out == [0, 4 * 1024 * 2, 4 * (4096 + 1024) * 2]
    items = memory_items(graph, sp_options(), 2)
    weights = sum(b.nbytes for b in graph.buffers.values() if b.kind == "weight")
    state = sum(b.nbytes for b in graph.buffers.values() if b.kind == "state")
    assert items.item_bytes.sum() == pytest.approx(weights + 2 * state)


def sp_options():
    from tessera.cost.options import CostOptions

    return CostOptions()


def test_folding_is_exact_for_busy_and_links(llama_tiny_problem):
    graph, sp = llama_tiny_problem
    structure = layer_structure(graph)
    rng = np.random.default_rng(0)
    for chunks in (1, 4):
        folded = merge(sp.problem, fold_groups(structure, sp.problem.kernels, chunks))
        assert folded.problem.kernels < sp.problem.kernels / 5
        for _ in range(3):
            a = tuple(int(x) for x in rng.integers(0, 2, folded.problem.kernels))
            full = evaluate(sp.problem, folded.unfold(a))
            small = evaluate(folded.problem, a)
            assert small.busy_s == pytest.approx(full.busy_s)
            assert np.allclose(small.link_s, full.link_s)
            assert small.resident_bytes == pytest.approx(full.resident_bytes)
            assert folded.fold(folded.unfold(a)) == a


def test_layer_groups_and_bad_partitions(llama_tiny_problem):
    graph, sp = llama_tiny_problem
    groups = layer_groups(layer_structure(graph), sp.problem.kernels)
    assert len(groups) == 32 and sorted(k for g in groups for k in g) == list(range(sp.problem.kernels))
    merged = merge(sp.problem, groups)
    a = (0,) * 10 + (1,) * 22
    assert evaluate(merged.problem, a).busy_s == pytest.approx(evaluate(sp.problem, merged.unfold(a)).busy_s)
    with pytest.raises(PlacementProblemError, match="in no merged group"):
        merge(sp.problem, groups[1:])
    with pytest.raises(PlacementProblemError, match="two merged groups"):
        merge(sp.problem, [*groups, [0]])
    with pytest.raises(PlacementProblemError, match="different devices"):
        merged.fold((0, 1) * (sp.problem.kernels // 2) + (0,) * (sp.problem.kernels % 2))


def test_attention_and_ffn_kernels_are_kept_on_their_targets(llama_tiny_problem):
    from tessera.cost.features import block_of
    from tessera.plan.policies import _block_allowed

    graph, sp = llama_tiny_problem
    literal = np.ones(sp.problem.times.shape, dtype=bool)
    for k, own in zip(graph.kernels, sp.problem_kernels(), strict=True):
        if block_of(k) in ("attention", "ffn"):
            literal[own] = False
            literal[own, 0 if block_of(k) == "attention" else 1] = True
    allowed = _block_allowed(sp, 0, 1)
    assert np.array_equal(allowed, literal)
    assert len(sp.block_kernels["attention"]) > 0 and len(sp.block_kernels["ffn"]) > 0
    assert (~allowed).sum() == len(sp.block_kernels["attention"]) + len(sp.block_kernels["ffn"])
