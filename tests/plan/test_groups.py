"""Device groups: sharded kernel times and collectives against hand-computed costs."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest

from tessera.capture.api import trace_model
from tessera.cost.features import FeatureExtractor
from tessera.cost.model import CostModel, memory_footprint
from tessera.cost.options import CostOptions
from tessera.cost.profile import KernelTiming, Profile, kernel_signature
from tessera.cost.roofline import kernel_time
from tessera.cost.routing import RoutingDistribution
from tessera.hardware.cluster import Link
from tessera.hardware.devices import resolve_device
from tessera.plan.groups import (
    DeviceGroup,
    DeviceGroupError,
    GraphTraffic,
    expert_layout,
    group_footprint,
    group_kernel_times,
    group_weight_bytes,
    replica_share,
    shard_kernels,
    state_share,
    weight_share,
)

B200 = resolve_device("B200")
LINK = Link("nvlink", 900e9, 2e-6)
BATCH, HIDDEN, VOCAB = 8, 4096, 128256


@pytest.fixture(scope="module")
def llama():
    # The hand-computed shards below name each projection (q_proj, k_proj...): the eager graph runs them as
    # separate GEMMs. The production graph's merged projections are checked in test_merged_qkv_...
    g = trace_model("llama-3.1-8b", "decode", batch=BATCH, ctx=1024, graph="eager")
    return g, FeatureExtractor(g).all()


@pytest.fixture(scope="module")
def llama_production():
    g = trace_model("llama-3.1-8b", "decode", batch=BATCH, ctx=1024)
    return g, FeatureExtractor(g).all()


@pytest.fixture(scope="module")
def gpt_oss():
    g = trace_model("gpt-oss-20b", "decode", batch=2, ctx=128)
    return g, FeatureExtractor(g).all()


def _find(graph, scope_end: str, layer: int = 0) -> int:
    return next(k.index for k in graph.kernels if k.scope.endswith(scope_end) and k.layer == layer
                and k.op_class == "gemm")


def test_group_sizes_are_checked():
    with pytest.raises(DeviceGroupError, match="tp=3 does not divide the group's 8 GPUs; use one of 1, 2, 4, 8"):
        DeviceGroup(B200, 8, LINK, tp=3)
    with pytest.raises(DeviceGroupError, match="ep=16 does not divide"):
        DeviceGroup(B200, 8, LINK, tp=8, ep=16)
    with pytest.raises(DeviceGroupError, match="size must be a whole number >= 1"):
        DeviceGroup(B200, 0, LINK)
    with pytest.raises(DeviceGroupError, match="tp must be a whole number >= 1"):
        DeviceGroup(B200, 4, LINK, tp=0)
    assert DeviceGroup(B200, 8, LINK, tp=8).name == "B200x8 (tp8)"
    g = DeviceGroup(B200, 8, LINK, tp=4, ep=8)
    assert (g.name, g.dp, g.expert_replicas) == ("B200x8 (tp4, dp2, ep8)", 2, 1)
    assert g.memory_bytes == 8 * B200.memory_bytes


def test_one_gpu_is_the_cost_model(llama):
    graph, feats = llama
    model = CostModel(B200)
    t = group_kernel_times(graph, feats, model, DeviceGroup(B200, 1, LINK))
    assert np.array_equal(t.total_s, [c.time_s for c in model.kernel_costs(graph, feats)])
    assert not t.collective_s.any()


def test_measured_times_only_where_the_shard_is_the_whole_kernel(llama):
    graph, feats = llama
    timings = [KernelTiming(k.index, k.id, kernel_signature(k), k.op, k.op_class, 1e-3, 1e-3, 3) for k in graph.kernels]
    prof = Profile("B200", "test", None, graph.model, "decode", graph.hash, {}, 1, 3, "now", timings)
    model = CostModel(B200, profile=prof)
    one = group_kernel_times(graph, feats, model, DeviceGroup(B200, 1, LINK))
    assert np.allclose(one.total_s, 1e-3)
    eight = group_kernel_times(graph, feats, model, DeviceGroup(B200, 8, LINK, tp=8))
    rules = np.array(eight.rules)
    assert np.allclose(eight.compute_s[rules == "replicated"], 1e-3)  # norms run whole on every GPU (dp = 1)
    sharded = eight.compute_s[rules != "replicated"]
    assert len(sharded) and not np.isclose(sharded, 1e-3).any()  # shards are timed by the roofline


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_all_reduce_and_lm_head_all_gather(llama, tp):
    graph, feats = llama
    t = group_kernel_times(graph, feats, CostModel(B200), DeviceGroup(B200, tp, LINK, tp=tp, ep=tp))
    out = BATCH * HIDDEN * 2  # [8, 4096] bf16 output activation of o_proj / down_proj
    ring = 2 * (tp - 1) * (2e-6 + out / tp / 900e9)
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        i = _find(graph, name, layer=3)
        assert t.rules[i] == "row"
        assert t.collective_s[i] == pytest.approx(ring, rel=1e-12)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj"):
        i = _find(graph, name, layer=3)
        assert (t.rules[i], t.collective_s[i]) == ("column", 0.0)
    head = _find(graph, "lm_head", layer=None)
    assert t.collective_s[head] == pytest.approx((tp - 1) * (2e-6 + BATCH * VOCAB * 2 / tp / 900e9), rel=1e-12)
    assert t.total_s == pytest.approx(t.compute_s + t.collective_s)
    # 32 layers x 2 all-reduces + the logits all-gather, nothing else
    assert t.collective_s.sum() == pytest.approx(64 * ring + t.collective_s[head])


def test_column_parallel_gemm_is_divided_by_tp(llama):
    graph, feats = llama
    group = DeviceGroup(B200, 4, LINK, tp=4)
    shards = shard_kernels(graph, feats, group)
    model = CostModel(B200)
    times = group_kernel_times(graph, feats, model, group)
    q = _find(graph, "self_attn.q_proj")
    f, (s,) = feats[q], shards[q].features
    assert s.flops == pytest.approx(f.flops / 4) and s.flops == pytest.approx(2 * BATCH * HIDDEN * HIDDEN / 4)
    assert s.weight_bytes == pytest.approx(f.weight_bytes / 4) and s.weight_bytes == pytest.approx(HIDDEN**2 * 2 / 4)
    assert s.gemm == (1, BATCH, HIDDEN // 4, HIDDEN)
    # input [8, 4096] read whole by every GPU, output [8, 1024] a quarter: the roofline of that shard
    by_hand = replace(f, flops=f.flops / 4, weight_bytes=f.weight_bytes / 4, gemm=(1, 8, 1024, 4096),
                      other_bytes=BATCH * HIDDEN * 2 + BATCH * HIDDEN * 2 / 4)
    expect = kernel_time(by_hand, B200, model.efficiency.classes["gemv"], model.options).time_s
    assert times.compute_s[q] == pytest.approx(expect)
    down = _find(graph, "mlp.down_proj")
    f, (s,) = feats[down], shards[down].features
    assert (s.flops, s.weight_bytes, s.gemm) == (pytest.approx(f.flops / 4), pytest.approx(f.weight_bytes / 4),
                                                 (1, BATCH, HIDDEN, 14336 // 4))


def test_attention_by_heads_and_data_parallel_replicas(llama):
    graph, feats = llama
    group = DeviceGroup(B200, 8, LINK, tp=4)  # 2 replicas of tp4: 4 sequences each
    shards = shard_kernels(graph, feats, group)
    att = next(k.index for k in graph.kernels if k.op_class == "attention")
    f, (s,) = feats[att], shards[att].features
    assert shards[att].rule == "heads"
    assert s.flops == pytest.approx(f.flops / 8) and s.kv_bytes == pytest.approx(f.kv_bytes / 8)  # 32/4 q, 8/4 kv heads
    norm = next(k.index for k in graph.kernels if k.scope.endswith("input_layernorm") and k.op.endswith("mul.Tensor")
                and len(k.shapes[0]) == 1)  # the weight multiply
    f, (s,) = feats[norm], shards[norm].features
    assert shards[norm].rule == "replicated"
    assert (s.flops, s.weight_bytes) == (pytest.approx(f.flops / 2), f.weight_bytes)
    o = _find(graph, "self_attn.o_proj")
    assert shards[o].collective_s == pytest.approx(all_reduce_by_hand(BATCH // 2 * HIDDEN * 2, 4))
    assert shards[_find(graph, "self_attn.q_proj")].features[0].gemm == (1, BATCH // 2, HIDDEN // 4, HIDDEN)


def test_replicas_get_whole_sequences(llama):
    graph, feats = llama
    assert replica_share(graph, DeviceGroup(B200, 6, LINK, tp=2)) == 3 / 8  # 8 sequences over 3 replicas: 3, 3, 2
    single = copy.copy(graph)
    single.meta = {**graph.meta, "batch": 1}  # one sequence: one replica runs it, the others idle
    group = DeviceGroup(B200, 8, LINK, tp=2)
    assert replica_share(single, group) == 1.0
    model = CostModel(B200)
    t = group_kernel_times(single, feats, model, group)
    whole = np.array([c.time_s for c in model.kernel_costs(single, feats)])
    replicated = np.array(t.rules) == "replicated"
    assert np.array_equal(t.compute_s[replicated], whole[replicated])
    q = _find(graph, "self_attn.q_proj")
    assert shard_kernels(single, feats, group)[q].features[0].flops == pytest.approx(feats[q].flops / 2)


def all_reduce_by_hand(nbytes: float, n: int) -> float:
    return 2 * (n - 1) * (LINK.latency_s + nbytes / n / LINK.bandwidth)


def test_kv_heads_below_tp_are_replicated(llama):
    graph, _ = llama
    group = DeviceGroup(B200, 16, LINK, tp=16)  # 32 query heads, 8 KV heads: 2 GPUs share each KV head
    assert weight_share("model.layers.0.self_attn.q_proj.weight", graph, group) == 1 / 16
    assert weight_share("model.layers.0.self_attn.k_proj.weight", graph, group) == 1 / 8
    assert state_share("cache.layer0.k", graph, group) == 1 / 8


def test_expert_parallel_all_to_all_uses_the_imbalance(gpt_oss):
    graph, feats = gpt_oss
    routing = RoutingDistribution(32, top_k=4, skew=1.0)
    group = DeviceGroup(B200, 4, LINK, tp=4, ep=4)
    imbalance = routing.imbalance(4)
    assert imbalance > 1.2
    layout = expert_layout(routing, 4)
    probs = np.array(routing.probabilities())
    assert sorted(sum(layout, [])) == list(range(32)) and {len(h) for h in layout} == {8}
    assert max(probs[h].sum() for h in layout) * 4 == pytest.approx(imbalance)
    shards = shard_kernels(graph, feats, group, routing)
    gemms = [k.index for k in graph.kernels if k.layer == 0 and k.op_class == "grouped_gemm"]
    assert len(gemms) == 2
    for i in gemms:  # the busiest GPU runs imbalance / ep of the assignments
        assert len(shards[i].features) == 4
        assert max(s.flops for s in shards[i].features) == pytest.approx(feats[i].flops * imbalance / 4)
        assert sum(s.flops for s in shards[i].features) == pytest.approx(feats[i].flops)
    rows, width = 2 * 4, 2880  # 2 tokens x top-4 assignments, hidden 2880, bf16
    per_device = rows / 4 * width * 2
    a2a = 3 * (LINK.latency_s + imbalance * per_device / 4 / LINK.bandwidth)
    gather = 3 * (LINK.latency_s + 2 * width * 2 / 4 / LINK.bandwidth)  # the MoE output of 2 tokens over tp4
    assert shards[gemms[0]].collective_s == pytest.approx(a2a)
    assert shards[gemms[1]].collective_s == pytest.approx(a2a + gather)
    uniform = group_kernel_times(graph, feats, CostModel(B200), group, RoutingDistribution(32, top_k=4))
    skewed = group_kernel_times(graph, feats, CostModel(B200), group, routing)
    assert skewed.collective_s[gemms[0]] > uniform.collective_s[gemms[0]]
    assert uniform.collective_s[gemms[0]] == pytest.approx(3 * (LINK.latency_s + per_device / 4 / LINK.bandwidth))


def test_memory_per_gpu(llama, gpt_oss):
    graph, _ = llama
    opts = CostOptions()
    assert group_weight_bytes(graph, opts, DeviceGroup(B200, 1, LINK)) == pytest.approx(
        memory_footprint(graph, opts).weight_bytes)
    expect = 0.0  # tp4: layer matrices and the LM head a quarter each, embedding and norms whole
    for b in graph.buffers.values():
        if b.kind == "weight":
            sharded = len(b.shape) == 2 and (".layers." in b.name or b.name == "lm_head.weight")
            expect += b.nbytes / 4 if sharded else b.nbytes
    group = DeviceGroup(B200, 4, LINK, tp=4)
    assert group_weight_bytes(graph, opts, group) == pytest.approx(expect)
    fp = group_footprint(graph, CostOptions(kv_dtype="fp8"), group)
    assert fp.state_bytes == pytest.approx(memory_footprint(graph, CostOptions(kv_dtype="fp8")).state_bytes / 4)
    moe, _ = gpt_oss
    ep4 = DeviceGroup(B200, 4, LINK, tp=4, ep=4)
    assert weight_share("model.layers.0.mlp.experts.gate_up_proj_blocks", moe, ep4) == 1 / 4  # MXFP4
    assert weight_share("model.layers.0.mlp.experts.gate_up_proj_scales", moe, ep4) == 1 / 4
    assert weight_share("model.layers.0.mlp.experts.down_proj_bias", moe, ep4) == 1 / 4
    assert weight_share("model.layers.0.mlp.router.weight", moe, ep4) == 1.0
    assert weight_share("model.layers.0.post_attention_layernorm.weight", moe, ep4) == 1.0
    assert weight_share("model.layers.0.mlp.experts.down_proj_blocks", moe,
                        DeviceGroup(B200, 3, LINK, tp=1, ep=3)) == 11 / 32
    with pytest.raises(DeviceGroupError, match="not a weight"):
        weight_share("cache.layer0.k", moe, ep4)


def test_mismatches_are_reported(llama, gpt_oss):
    graph, feats = llama
    with pytest.raises(DeviceGroupError, match="cost model is for H100 but the group is of B200"):
        group_kernel_times(graph, feats, CostModel(resolve_device("H100")), DeviceGroup(B200, 2, LINK, tp=2))
    with pytest.raises(DeviceGroupError, match="kernel features for a graph"):
        group_kernel_times(graph, feats[:-1], CostModel(B200), DeviceGroup(B200, 2, LINK, tp=2))
    moe, moe_feats = gpt_oss
    with pytest.raises(DeviceGroupError, match="has 32 experts but the routing distribution has 8"):
        shard_kernels(moe, moe_feats, DeviceGroup(B200, 2, LINK, tp=2, ep=2), RoutingDistribution(8, top_k=4))


def test_merged_qkv_shares_q_by_tp_and_kv_by_kv_heads(llama_production):
    """One QKV GEMM over q (4096 rows), k and v (1024 each, 8 KV heads): at tp 16 a GPU runs q/16 and the KV
    heads' share 1/8 of k and v, weighted by their weights; its weights are shared the same way."""
    graph, feats = llama_production
    group = DeviceGroup(B200, 16, LINK, tp=16)
    qkv = next(k.index for k in graph.kernels if k.layer == 0 and k.op == "tessera.merged_linear.default"
               and k.scope.endswith("self_attn"))
    shards = shard_kernels(graph, feats, group)
    share = (4096 / 16 + 2 * 1024 / 8) / 6144
    assert shards[qkv].rule == "column"
    assert shards[qkv].features[0].flops == pytest.approx(feats[qkv].flops * share)
    assert shards[qkv].features[0].weight_bytes == pytest.approx(feats[qkv].weight_bytes * share)
    assert weight_share("model.layers.0.self_attn.q_proj.weight", graph, group) == 1 / 16
    assert weight_share("model.layers.0.self_attn.k_proj.weight", graph, group) == 1 / 8
    gate_up = next(k.index for k in graph.kernels if k.layer == 0 and k.op == "tessera.merged_linear.default"
                   and k.scope.endswith("mlp"))
    assert shards[gate_up].features[0].flops == pytest.approx(feats[gate_up].flops / 16)


@pytest.mark.parametrize("case", ["llama_production", "gpt_oss"])
def test_group_times_are_each_shard_timed_on_its_own(case, request):
    """Shards with the same features (the layers repeat them) are timed once, and a caller's one-GPU times
    stand for the unsharded kernels: the same seconds as timing every shard by the roofline."""
    graph, feats = request.getfixturevalue(case)
    model = CostModel(B200)
    whole = [c.time_s for c in model.kernel_costs(graph, feats)]
    for size in (2, 4):
        group = DeviceGroup(B200, size, LINK, tp=size, ep=size)
        shards = shard_kernels(graph, feats, group)
        literal = [whole[i] if s.features == (f,) else
                   max(kernel_time(sf, B200, model.efficiency.for_kernel(sf.cost_class, sf.op)).time_s
                       for sf in s.features) for i, (s, f) in enumerate(zip(shards, feats, strict=True))]
        times = group_kernel_times(graph, feats, model, group)
        assert times.compute_s.tolist() == literal
        given = group_kernel_times(graph, feats, model, group, whole_s=np.array(whole), traffic=GraphTraffic(graph))
        assert given.total_s.tolist() == times.total_s.tolist()
