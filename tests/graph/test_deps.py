"""Dependency precision: exact byte-range overlaps, no false edges, every real one."""

from __future__ import annotations

import torch

from tessera.capture.step import Step
from tessera.capture.trace import trace
from tessera.graph.overlap import Region, regions_overlap


def _graph(fn, inputs, state=None, device="cpu"):
    inputs = {k: v.to(device) for k, v in inputs.items()}
    state = {k: v.to(device) for k, v in (state or {}).items()}
    return trace(Step(model="unit", family="test", phase="unit", modules={}, fn=fn, inputs=inputs, state=state))


def _edges(g):
    return {(g.kernels[e.src].op.split(".")[1], g.kernels[e.dst].op.split(".")[1], e.kind) for e in g.edges}


def _edge_pairs(g):
    return {(e.src, e.dst, e.kind) for e in g.edges}


def test_region_overlap_exact_cases():
    r = lambda off, sizes, strides: Region(off, sizes, strides, 4)  # noqa: E731
    assert not regions_overlap(r(0, (8, 4), (8, 1)), r(4, (8, 4), (8, 1)))  # x[:, :4] vs x[:, 4:]
    assert not regions_overlap(r(0, (8, 4), (8, 2)), r(1, (8, 4), (8, 2)))  # x[:, ::2] vs x[:, 1::2]
    assert regions_overlap(r(0, (8, 4), (8, 2)), r(2, (8, 4), (8, 2)))  # shifted by one even column
    assert not regions_overlap(r(0, (4, 2, 16), (128, 16, 1)), r(32, (4, 2, 16), (128, 16, 1)))  # heads
    assert regions_overlap(r(0, (64,), (1,)), r(63, (1,), (1,)))
    assert not regions_overlap(r(0, (64,), (1,)), r(64, (1,), (1,)))
    # different element sizes over the same bytes: a float32 at byte 4 overlaps the bf16 at byte 6
    assert regions_overlap(Region(1, (1,), (1,), 4), Region(3, (1,), (1,), 2))
    assert not regions_overlap(Region(1, (1,), (1,), 4), Region(4, (1,), (1,), 2))


def test_disjoint_contiguous_slices_give_no_false_edges():
    def fn(inp, st, _c):
        x = inp["x"] * 2  # producer of the whole buffer
        x[:4].add_(1)  # in-place on the first half
        b = x[4:] + 3  # reads only the second half: depends on the producer, not on add_
        return {"b": b}

    g = _graph(fn, {"x": torch.ones(8, 4)})
    mul, add_, add = 0, 1, 2
    assert (mul, add_, "RAW") in _edge_pairs(g)
    assert (mul, add, "RAW") in _edge_pairs(g)
    assert not any(e.src == add_ and e.dst == add for e in g.edges)


def test_interleaved_strided_slices_are_independent():
    def fn(inp, st, _c):
        x = inp["x"] * 1
        x[:, ::2].mul_(3)  # even columns
        y = x[:, 1::2] - 1  # odd columns: no edge from the even-column write
        z = x[:, 2::2] + 1  # even columns again: RAW on the in-place write
        return {"y": y, "z": z}

    g = _graph(fn, {"x": torch.ones(6, 8)})
    pairs = _edge_pairs(g)
    assert (1, 2, "RAW") not in pairs
    assert (1, 3, "RAW") in pairs
    assert (0, 2, "RAW") in pairs and (0, 1, "RAW") in pairs


def test_per_head_slices_are_independent():
    def fn(inp, st, _c):
        q = inp["q"] * 1  # [B, H, D]
        q[:, 0].zero_()
        q[:, 1].fill_(2.0)
        h2 = q[:, 2] * 5
        h1 = q[:, 1] * 5
        return {"h2": h2, "h1": h1}

    g = _graph(fn, {"q": torch.ones(2, 4, 16)})
    pairs = _edge_pairs(g)
    zero, fill, h2, h1 = 1, 2, 3, 4
    assert not any(e.dst == h2 and e.src in (zero, fill) for e in g.edges)
    assert (fill, h1, "RAW") in pairs and (zero, h1, "RAW") not in pairs
    assert (zero, fill, "WAW") not in pairs


def test_in_place_ops_give_war_and_waw():
    def fn(inp, st, _c):
        x = inp["x"] * 1
        y = x + 1  # reads x
        x.mul_(2)  # overwrites what y read: WAR, and what the producer wrote: WAW
        return {"y": y, "x": x}

    g = _graph(fn, {"x": torch.ones(4)})
    pairs = _edge_pairs(g)
    assert (1, 2, "WAR") in pairs
    assert (0, 2, "WAW") in pairs
    assert (0, 1, "RAW") in pairs


def test_kv_cache_writes_precede_attention_and_layers_are_independent():
    from tessera.capture.ops import StepContext, step_context, tessera_attention

    class Layer(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.layer_idx = i

    layers = [Layer(0), Layer(1)]
    b, h, kvh, ctx, d = 2, 4, 2, 8, 16

    def fn(inp, st, _c):
        kv = {i: (st[f"cache.layer{i}.k"], st[f"cache.layer{i}.v"]) for i in range(2)}
        outs = {}
        with step_context(StepContext("decode", inp["slots"], inp["positions"], kv)):
            for i, layer in enumerate(layers):
                q = inp["q"] * (i + 1)
                k = inp["k"] * (i + 1)
                outs[f"o{i}"] = tessera_attention(layer, q, k, k, None)[0]
        return outs

    state = {f"cache.layer{i}.{kind}": torch.zeros(b, kvh, ctx, d) for i in range(2) for kind in "kv"}
    g = _graph(fn, {"q": torch.ones(b, h, 1, d), "k": torch.ones(b, kvh, 1, d),
                    "slots": torch.arange(b), "positions": torch.tensor([3, 5])}, state)
    ops = [k.op for k in g.kernels]
    attn = [i for i, op in enumerate(ops) if "decode_attention" in op]
    writes = [i for i, op in enumerate(ops) if "index_put_" in op]
    assert len(attn) == 2 and len(writes) == 4
    pairs = _edge_pairs(g)
    for layer, a in enumerate(attn):
        mine = writes[2 * layer:2 * layer + 2]
        other = writes[2 * (1 - layer):2 * (1 - layer) + 2]
        assert all((w, a, "RAW") in pairs for w in mine)
        assert not any((w, a, kind) in pairs for w in other for kind in ("RAW", "WAR", "WAW"))
    layer_of_buffer = {e.buffer for e in g.edges if e.dst == attn[0] and e.kind == "RAW"}
    assert {"cache.layer0.k", "cache.layer0.v"} <= layer_of_buffer
    assert not any(name.startswith("cache.layer1") for name in layer_of_buffer)


def test_meta_and_cpu_give_the_same_edges():
    def fn(inp, st, _c):
        x = inp["x"] * 1
        x[:, ::2].mul_(3)
        return {"y": x[:, 1::2] - 1}

    gm = _graph(fn, {"x": torch.ones(6, 8)}, device="meta")
    gc = _graph(fn, {"x": torch.ones(6, 8)}, device="cpu")
    assert _edge_pairs(gm) == _edge_pairs(gc)


def test_data_edges_charge_bytes_to_their_last_writer():
    """A fused QKV output whose q and k RoPE rewrites in place: attention's q comes from RoPE, the KV write's v
    from the GEMM, and the GEMM -> attention dependency carries no bytes."""
    from tessera.capture.api import trace_model
    from tessera.graph.dataflow import data_edges

    g = trace_model("smollm2-135m", "decode", batch=2, ctx=16)
    layer0: dict[str, int] = {}
    for k in g.kernels:
        if k.layer == 0:
            layer0.setdefault(k.op.split(".")[1], k.index)  # the first of each op (QKV before gate-up)
    edges = {(s, d): b for s, d, b in data_edges(g)}
    qkv, rope, kv, attn = (layer0[n] for n in ("merged_linear", "rotary_", "kv_write", "decode_attention"))
    q, kv_width = 2 * 9 * 64 * 2, 2 * 3 * 64 * 2  # batch 2, 9 query heads, 3 KV heads, head dim 64, bf16
    assert edges[(qkv, rope)] == q + kv_width
    assert edges[(qkv, kv)] == kv_width  # v
    assert edges[(rope, kv)] == kv_width  # k, rotated
    assert edges[(rope, attn)] == q
    assert edges[(qkv, attn)] == 0
