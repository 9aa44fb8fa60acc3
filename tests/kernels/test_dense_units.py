"""The dense decoder units (tessera.kernels.linear / norm / rotary / activation / cache): their declared
accesses are true (tests/kernels/access_truth.py) and their numbers equal Hugging Face's eager code bit for
bit, on the strided views the production decoder passes them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tessera.kernels  # noqa: F401
from tessera.graph.opclass import FUSED
from tests.kernels.access_truth import assert_accesses_true

ops = torch.ops.tessera
B, S, H, KVH, D = 2, 5, 4, 2, 16


def _qkv(dtype=torch.bfloat16, s=S, seed=0):
    """q [B,H,S,D], k/v [B,KVH,S,D] as transposed views of one fused [B,S,(H+2KVH)*D] projection output."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, s, (H + 2 * KVH) * D, generator=g).to(dtype)
    q = qkv[..., :H * D].view(B, s, H, D).transpose(1, 2)
    k = qkv[..., H * D:(H + KVH) * D].view(B, s, KVH, D).transpose(1, 2)
    v = qkv[..., (H + KVH) * D:].view(B, s, KVH, D).transpose(1, 2)
    return qkv, q, k, v


# ---------------------------------------------------------------------------------------------------
# Declared accesses


@pytest.mark.parametrize("bias", [False, True])
def test_merged_linear_accesses(bias):
    x = torch.randn(B, S, 32).bfloat16()
    ws = [torch.randn(n, 32).bfloat16() for n in (16, 8, 8)]
    bs = [torch.randn(n).bfloat16() for n in (16, 8, 8)] if bias else []
    assert_accesses_true(ops.merged_linear, (x, ws, bs))


@pytest.mark.parametrize("fp32_scale", [False, True])
def test_norm_accesses(fp32_scale):
    x, r, w = torch.randn(B, S, 32).bfloat16(), torch.randn(B, S, 32).bfloat16(), torch.randn(32).bfloat16()
    assert_accesses_true(ops.rms_norm, (x, w, 1e-5, fp32_scale))
    assert_accesses_true(ops.add_rms_norm, (x, r, w, 1e-5, fp32_scale))
    _, q, _, _ = _qkv()
    assert_accesses_true(ops.rms_norm, (q.transpose(1, 2), torch.randn(D).bfloat16(), 1e-6), embed=False)


@pytest.mark.parametrize("decode", [False, True])
def test_rotary_accesses_on_views_of_the_qkv_output(decode):
    s = 1 if decode else S
    _, q, k, _ = _qkv(s=s)
    positions = torch.tensor([[7], [3]]) if decode else None
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    # q and k are views of one storage whose v part they do not touch: nothing to embed
    assert_accesses_true(ops.rotary_, (q, k, positions, inv_freq, 1.0), embed=False)


def test_mrope_accesses_on_views_of_the_qkv_output():
    _, q, k, _ = _qkv()
    positions = torch.randint(0, 20, (3, B, S))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    assert_accesses_true(ops.mrope_, (q, k, positions, inv_freq, [2, 3, 3], 1.0), embed=False)


@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_gated_activation_accesses(op):
    assert_accesses_true(getattr(ops, op), (torch.randn(B, S, 64).bfloat16(),))


@pytest.mark.parametrize("decode", [False, True])
def test_kv_write_accesses(decode):
    s = 1 if decode else S
    _, _, k, v = _qkv(s=s)
    kc, vc = torch.randn(3, KVH, 12, D).bfloat16(), torch.randn(3, KVH, 12, D).bfloat16()
    positions = torch.tensor([9, 2]) if decode else None
    assert_accesses_true(ops.kv_write, (k, v, kc, vc, torch.tensor([2, 0]), positions))


# ---------------------------------------------------------------------------------------------------
# What they compute


def test_merged_linear_equals_separate_projections_and_declares_one_gemm():
    x = torch.randn(B, S, 32).bfloat16()
    ws = [torch.randn(n, 32).bfloat16() for n in (16, 8, 8)]
    bs = [torch.randn(n).bfloat16() for n in (16, 8, 8)]
    out = ops.merged_linear(x, ws, bs)
    assert torch.equal(out, torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs, strict=True)], -1))
    info = FUSED["merged_linear"]
    assert info.op_class == "gemm"
    assert info.gemm([[B, S, 32], [16, 32], [8, 32], [8, 32], [16], [8], [8]]) == (1, B * S, 32, 32)
    assert info.flops((x, ws, bs), {}, out) == 2 * B * S * 32 * 32 + B * S * 32


def test_norms_equal_hugging_face():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, r = torch.randn(B, S, 32).bfloat16(), torch.randn(B, S, 32).bfloat16()
    for cls, fp32 in ((LlamaRMSNorm, False), (GptOssRMSNorm, True)):
        norm = cls(32, eps=1e-5).bfloat16()
        norm.weight.data.copy_(torch.randn(32))
        assert torch.equal(ops.rms_norm(x, norm.weight, 1e-5, fp32), norm(x))
        normed, summed = ops.add_rms_norm(x, r, norm.weight, 1e-5, fp32)
        assert torch.equal(summed, r + x)
        assert torch.equal(normed, norm(r + x))


@pytest.mark.parametrize("model", ["llama", "gpt_oss"])
def test_rotary_equals_hugging_face(model):
    import importlib

    from transformers import GptOssConfig, LlamaConfig

    mod = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    if model == "llama":
        cfg = LlamaConfig(hidden_size=H * D, num_attention_heads=H, head_dim=D)
        rotary = mod.LlamaRotaryEmbedding(cfg)
    else:
        cfg = GptOssConfig(hidden_size=H * D, num_attention_heads=H, head_dim=D, rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 4,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False})
        rotary = mod.GptOssRotaryEmbedding(cfg)
    for positions in (None, torch.tensor([[11], [4]])):
        s = S if positions is None else 1
        qkv, q, k, _ = _qkv(s=s)
        pos_ids = torch.arange(s)[None] if positions is None else positions
        cos, sin = rotary(qkv, pos_ids)
        q_ref, k_ref = mod.apply_rotary_pos_emb(q, k, cos, sin)
        ops.rotary_(q, k, positions, rotary.inv_freq, float(rotary.attention_scaling))
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_mrope_equals_hugging_face_qwen2_5_vl():
    from transformers import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as mod

    cfg = Qwen2_5_VLTextConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=KVH,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                "mrope_section": [2, 3, 3]})
    rotary = mod.Qwen2_5_VLRotaryEmbedding(cfg)
    positions = torch.randint(0, 40, (3, B, S))
    qkv, q, k, _ = _qkv()
    cos, sin = rotary(qkv, positions)
    q_ref, k_ref = mod.apply_rotary_pos_emb(q, k, cos, sin)
    ops.mrope_(q, k, positions, rotary.inv_freq, list(rotary.mrope_section), float(rotary.attention_scaling))
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_gated_activations_equal_hugging_face():
    from transformers.activations import ACT2FN

    x = torch.randn(B, S, 64).bfloat16()
    gate, up = x[..., :32], x[..., 32:]
    assert torch.equal(ops.silu_and_mul(x), ACT2FN["silu"](gate) * up)
    assert torch.equal(ops.gelu_tanh_and_mul(x), ACT2FN["gelu_pytorch_tanh"](gate) * up)


def test_kv_write_prefill_and_decode():
    _, _, k, v = _qkv()
    kc, vc = torch.zeros(3, KVH, 12, D).bfloat16(), torch.zeros(3, KVH, 12, D).bfloat16()
    ops.kv_write(k, v, kc, vc, torch.tensor([2, 0]), None)
    assert torch.equal(kc[2, :, :S], k[0]) and torch.equal(vc[0, :, :S], v[1])
    assert not kc[1].any() and not kc[:, :, S:].any()
    _, _, k1, v1 = _qkv(s=1, seed=1)
    ops.kv_write(k1, v1, kc, vc, torch.tensor([2, 0]), torch.tensor([S, 9]))
    assert torch.equal(kc[2, :, S], k1[0, :, 0]) and torch.equal(vc[0, :, 9], v1[1, :, 0])
    assert torch.equal(kc[2, :, :S], k[0])  # the prompt stays
