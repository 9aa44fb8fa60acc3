"""MoE kernels and the MXFP4 format: round trips against transformers' dequantiser, declared accesses,
fake (meta) shapes and cost facts."""

from __future__ import annotations

import pytest
import torch

import tessera.kernels  # noqa: F401  (registers the tessera:: ops)
from tessera.graph.opclass import FUSED
from tessera.kernels import mxfp4
from tests.kernels.access_truth import assert_accesses_true

ops = torch.ops.tessera


# ---------------------------------------------------------------------------------------------------
# MXFP4 format


def _exact_mxfp4(e=3, n=40, groups=3, seed=0):
    """Random checkpoint-layout blocks/scales whose every block has a magnitude 4 or 6 (so the OCP scale
    choice recovers the same scale byte)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (e, n, groups, 32), generator=g, dtype=torch.uint8)
    top = torch.randint(6, 8, (e, n, groups), generator=g, dtype=torch.uint8)  # magnitude 4.0 or 6.0
    sign = torch.randint(0, 2, (e, n, groups), generator=g, dtype=torch.uint8) << 3
    where = torch.randint(0, 32, (e, n, groups, 1), generator=g)
    codes.scatter_(-1, where, (top | sign)[..., None])
    blocks = mxfp4.pack_nibbles(codes)
    scales = torch.randint(110, 140, (e, n, groups), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_dequantise_matches_transformers_reference():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _exact_mxfp4()
    ours = mxfp4.dequantize_weight(blocks, scales, torch.bfloat16)
    ref = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16)
    assert ours.shape == ref.shape == (3, 96, 40)  # [E, K, N]
    assert torch.equal(ours, ref)


def test_quantise_then_reference_dequantise_is_our_dequantise():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(2, 64, 48, dtype=torch.bfloat16) * 3
    blocks, scales = mxfp4.quantize_weight(w)
    assert blocks.shape == (2, 48, 2, 16) and scales.shape == (2, 48, 2)
    assert blocks.dtype == scales.dtype == torch.uint8
    ref = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16)
    assert torch.equal(mxfp4.dequantize_weight(blocks, scales), ref)
    # the error is at most half the widest e2m1 step (2 scales), or the saturation above 6 (< 2 scales)
    step = torch.ldexp(torch.ones(()), (scales.int() - 127).float())  # the block's scale
    err = (ref.float() - w.float()).abs().transpose(1, 2).reshape(2, 48, 2, 32)
    assert (err <= 2 * step[..., None]).all()


def test_representable_values_survive_a_round_trip_unchanged():
    blocks, scales = _exact_mxfp4(seed=1)
    values = mxfp4.dequantize_weight(blocks, scales, torch.float32)
    b2, s2 = mxfp4.quantize_weight(values)
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)  # byte for byte
    assert torch.equal(mxfp4.dequantize_weight(b2, s2, torch.float32), values)
    # representable values whose block has a smaller magnitude get another scale, but the same values
    small = values / 4
    assert torch.equal(mxfp4.dequantize_weight(*mxfp4.quantize_weight(small), torch.float32), small)


def test_rounding_is_to_nearest_ties_to_even_and_saturates():
    mags = torch.tensor([0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.0, 7.9])
    expect = torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0])
    got = mxfp4.decode_e2m1(mxfp4.encode_e2m1(mags))
    assert torch.equal(got, expect)
    assert torch.equal(mxfp4.decode_e2m1(mxfp4.encode_e2m1(-mags)), -expect)
    # brute force: every element is the nearest multiple of its block's scale in the e2m1 grid
    x = torch.randn(4, 64) * 10
    blocks, scales = mxfp4.quantize_blocks(x)
    deq = mxfp4.dequantize_blocks(blocks, scales, torch.float32)
    scale = torch.ldexp(torch.ones(()), (scales.int() - 127).float()).repeat_interleave(32, dim=-1)
    grid = torch.tensor(mxfp4.FP4_VALUES)[None, None, :] * scale[..., None]
    nearest = (grid - x[..., None]).abs().min(dim=-1).values
    assert torch.allclose((deq - x).abs(), nearest, atol=1e-6)


def test_meta_quantise_gives_shapes_only():
    w = torch.empty(32, 2880, 5760, dtype=torch.bfloat16, device="meta")
    blocks, scales = mxfp4.quantize_weight(w)
    assert blocks.device.type == "meta" and blocks.shape == (32, 5760, 90, 16) and scales.shape == (32, 5760, 90)
    assert mxfp4.dequantize_weight(blocks, scales).shape == (32, 2880, 5760)
    assert mxfp4.packed_shapes(32, 2880, 5760) == ((32, 5760, 90, 16), (32, 5760, 90))


# ---------------------------------------------------------------------------------------------------
# The ops: declared accesses, fake shapes, numerics of the pieces


T, H, N, E, K = 6, 64, 48, 4, 2


def _routing(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g).to(torch.bfloat16)
    weights, ids = ops.topk_gating(logits, K, False, False)
    perm, offsets = ops.moe_align(ids, E)
    return logits, weights, ids, perm, offsets


def _case(name: str):
    g = torch.Generator().manual_seed(1)
    logits, weights, ids, perm, offsets = _routing()
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    rows = torch.randn(T * K, N, generator=g).to(torch.bfloat16)
    rows_h = torch.randn(T * K, H, generator=g).to(torch.bfloat16)
    w_t = torch.randn(E, H, N, generator=g).to(torch.bfloat16)  # [E,K,N]
    w_n = torch.randn(E, N, H, generator=g).to(torch.bfloat16)  # [E,N,K]
    bias = torch.randn(E, N, generator=g).to(torch.bfloat16)
    blocks, scales = mxfp4.quantize_weight(w_t)
    wide = torch.randn(T * K, 2 * N + 8, generator=g).to(torch.bfloat16)[:, 4:4 + 2 * N]  # a strided view
    cases = {
        "topk_gating_gptoss": (ops.topk_gating, (logits, K, False, False)),
        "topk_gating_qwen3": (ops.topk_gating, (logits, K, True, True)),
        "topk_gating_qwen3_unnormalised": (ops.topk_gating, (logits, K, True, False)),
        "moe_align": (ops.moe_align, (ids, E)),
        "moe_gemm_gather_transposed_bias": (ops.moe_gemm, (x, w_t, offsets, perm, bias, K, True)),
        "moe_gemm_gather_linear": (ops.moe_gemm, (x, w_n, offsets, perm, None, K, False)),
        "moe_gemm_sorted_rows": (ops.moe_gemm, (rows_h, w_n, offsets, None, None, K, False)),
        "moe_mxfp4_gemm_gather": (ops.moe_mxfp4_gemm, (x, blocks, scales, offsets, perm, bias, K)),
        "moe_mxfp4_gemm_sorted": (ops.moe_mxfp4_gemm, (x.repeat(2, 1), blocks, scales, offsets, None, bias, K)),
        "swigluoai_and_mul": (ops.swigluoai_and_mul, (wide, 1.702, 7.0)),
        "moe_sum": (ops.moe_sum, (rows, perm, weights)),
    }
    return cases[name]


CASES = ["topk_gating_gptoss", "topk_gating_qwen3", "topk_gating_qwen3_unnormalised", "moe_align",
         "moe_gemm_gather_transposed_bias", "moe_gemm_gather_linear", "moe_gemm_sorted_rows",
         "moe_mxfp4_gemm_gather", "moe_mxfp4_gemm_sorted", "swigluoai_and_mul", "moe_sum"]


@pytest.mark.parametrize("name", CASES)
def test_declared_accesses_are_true(name):
    op, args = _case(name)
    assert_accesses_true(op, args)


@pytest.mark.parametrize("name", CASES)
def test_fake_shapes_match_the_cpu_body(name):
    op, args = _case(name)
    real = op(*args)
    meta = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
    real = real if isinstance(real, tuple) else (real,)
    meta = meta if isinstance(meta, tuple) else (meta,)
    assert [(t.shape, t.dtype) for t in real] == [(t.shape, t.dtype) for t in meta]


def test_align_sorts_assignments_by_expert():
    _, _, ids, perm, offsets = _routing()
    flat = ids.reshape(-1)
    assert sorted(perm.tolist()) == list(range(T * K))
    assert torch.equal(flat[perm], torch.sort(flat).values)
    assert offsets.tolist() == torch.cumsum(torch.bincount(flat, minlength=E), 0).tolist()


def test_grouped_gemm_equals_per_row_reference():
    op, args = _case("moe_gemm_gather_transposed_bias")
    x, w, offsets, perm, bias = args[:5]
    out = op(*args)
    expert = torch.repeat_interleave(torch.arange(E), torch.diff(offsets, prepend=offsets.new_zeros(1)).long())
    for r in range(T * K):
        e = int(expert[r])
        ref = x[perm[r] // K] @ w[e] + bias[e]
        assert torch.equal(out[r], ref)
    x, blocks, scales, offsets, perm, bias, _ = _case("moe_mxfp4_gemm_gather")[1]
    deq = mxfp4.dequantize_weight(blocks, scales)
    out = ops.moe_mxfp4_gemm(x, blocks, scales, offsets, perm, bias, K)
    assert torch.equal(out, ops.moe_gemm(x, deq, offsets, perm, bias, K, True))


def test_moe_sum_weights_unpermutes_and_sums():
    _, weights, ids, perm, offsets = _routing()
    rows = torch.randn(T * K, H).to(torch.bfloat16)
    out = ops.moe_sum(rows, perm, weights)
    unsorted = torch.empty_like(rows)
    unsorted[perm] = rows
    ref = (unsorted.float().view(T, K, H) * weights.float()[..., None]).sum(1)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_cost_facts():
    for name, cls in (("topk_gating", "reduction"), ("moe_align", "scan"), ("moe_gemm", "grouped_gemm"),
                      ("moe_mxfp4_gemm", "grouped_gemm"), ("swigluoai_and_mul", "elementwise"),
                      ("moe_sum", "reduction")):
        assert FUSED[name].op_class == cls
    # shapes are the tensor arguments in order; the weight (its E leading) is the second
    gemm = FUSED["moe_gemm"].gemm
    assert gemm([[T, H], [E, H, N], [E], [T * K], [E, N]]) == (1, T * K, N, H)  # gathering, transposed
    assert gemm([[T * K, N], [E, H, N], [E]]) == (1, T * K, H, N)  # sorted rows, [E,N,K]
    mx = FUSED["moe_mxfp4_gemm"].gemm
    assert mx([[T, 2880], [32, 5760, 90, 16], [32, 5760, 90], [32], [T * 4], [32, 5760]]) == (1, T * 4, 5760, 2880)
    assert mx([[T * 4, 2880], [32, 2880, 90, 16], [32, 2880, 90], [32], [32, 2880]]) == (1, T * 4, 2880, 2880)
    x, w, offsets, perm, bias = _case("moe_gemm_gather_transposed_bias")[1][:5]
    out = ops.moe_gemm(x, w, offsets, perm, bias, K, True)
    assert FUSED["moe_gemm"].flops((x, w, offsets, perm, bias, K, True), {}, out) == 2 * T * K * N * H
