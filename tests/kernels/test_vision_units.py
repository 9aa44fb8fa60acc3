"""The vision tower's fused units (tessera.kernels.vision): declared accesses true, values = Hugging Face's.

Accesses are checked with `tests.kernels.access_truth.assert_accesses_true` on the views the production
tower passes (q and k as views of the fused qkv output, the segment attention's q/k/v likewise), values
against the Hugging Face Qwen2.5-VL modules / functions the units replace, bit for bit on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tessera.kernels  # noqa: F401 - registers the ops
from tessera.graph.opclass import FUSED, op_class
from tests.kernels.access_truth import assert_accesses_true

N, H, D = 12, 2, 16  # patches, heads, head dim
BF16 = torch.bfloat16


def _qkv(n: int = N) -> torch.Tensor:
    """A fused qkv projection output [N, 3*H*D] viewed [N,3,H,D]."""
    return torch.randn(n, 3 * H * D).to(BF16).view(n, 3, H, D)


def _cos_sin(n: int = N):
    pos = torch.stack([torch.arange(n) // 4, torch.arange(n) % 4], dim=-1)
    inv = 1.0 / (10000 ** (torch.arange(0, D // 2, 2, dtype=torch.float) / (D // 2)))
    return pos, inv


# ---------------------------------------------------------------------------------------------------
# Declared accesses


def test_vision_rope_cos_sin_accesses():
    pos, inv = _cos_sin()
    assert_accesses_true(torch.ops.tessera.vision_rope_cos_sin, (pos, inv))


def test_vision_rotary_accesses_on_views_of_the_qkv_output():
    qkv = _qkv()
    cos, sin = torch.ops.tessera.vision_rope_cos_sin(*_cos_sin())
    # q and k are strided views into one storage that also holds v: v must be neither read nor written
    assert_accesses_true(torch.ops.tessera.vision_rotary_, (qkv[:, 0], qkv[:, 1], cos, sin))


def test_vision_rotary_accesses_on_separate_tensors():
    cos, sin = torch.ops.tessera.vision_rope_cos_sin(*_cos_sin())
    q, k = torch.randn(N, H, D).to(BF16), torch.randn(N, H, D).to(BF16)
    assert_accesses_true(torch.ops.tessera.vision_rotary_, (q, k, cos, sin))


def test_segment_attention_accesses_on_views_of_the_qkv_output():
    """The production tower passes q/k/v as [1,H,N,D] views of the qkv output, not copies."""
    qkv = torch.randn(N + 2, 3 * H * D).to(BF16)[1:-1].view(N, 3, H, D)  # guard rows around the output
    q, k, v = (qkv[:, i].transpose(0, 1).unsqueeze(0) for i in range(3))
    assert_accesses_true(torch.ops.tessera.segment_attention, (q, k, v, [4, 8], D ** -0.5))


# ---------------------------------------------------------------------------------------------------
# Values = Hugging Face's modules


def test_rope_matches_hugging_face():
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VLVisionRotaryEmbedding,
        apply_rotary_pos_emb_vision,
    )

    vcfg = Qwen2_5_VLConfig(vision_config={"hidden_size": H * D, "num_heads": H}).vision_config
    rope = Qwen2_5_VLVisionRotaryEmbedding(vcfg)
    pos, _ = _cos_sin()
    x = torch.zeros(N, H * D)
    cos_ref, sin_ref = rope(x, pos)
    cos, sin = torch.ops.tessera.vision_rope_cos_sin(pos, rope.inv_freq)
    assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)

    qkv = _qkv()
    q_ref, k_ref = apply_rotary_pos_emb_vision(qkv[:, 0].clone(), qkv[:, 1].clone(), cos, sin)
    v_before = qkv[:, 2].clone()
    torch.ops.tessera.vision_rotary_(qkv[:, 0], qkv[:, 1], cos, sin)
    assert torch.equal(qkv[:, 0], q_ref) and torch.equal(qkv[:, 1], k_ref)
    assert torch.equal(qkv[:, 2], v_before)


def test_norms_match_hugging_face():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    norm = Qwen2_5_VLRMSNorm(32).to(BF16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
        x, res = torch.randn(N, 32).to(BF16), torch.randn(N, 32).to(BF16)
        assert torch.equal(torch.ops.tessera.rms_norm(x, norm.weight, 1e-6), norm(x))
        normed, summed = torch.ops.tessera.add_rms_norm(x, res, norm.weight, 1e-6)
        assert torch.equal(summed, res + x) and torch.equal(normed, norm(res + x))


def test_mlp_units_match_hugging_face():
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

    vcfg = Qwen2_5_VLConfig(vision_config={"hidden_size": 32, "intermediate_size": 24}).vision_config
    mlp = Qwen2_5_VLMLP(vcfg, bias=True).to(BF16)
    x = torch.randn(N, 32).to(BF16)
    with torch.no_grad():
        gate_up = torch.ops.tessera.merged_linear(
            x, [mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias])
        torch.testing.assert_close(gate_up, torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1), atol=0, rtol=0)
        act = torch.ops.tessera.silu_and_mul(gate_up)
        assert torch.equal(act, F.silu(gate_up[:, :24]) * gate_up[:, 24:])
        torch.testing.assert_close(mlp.down_proj(act), mlp(x), atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------------------------------------------
# Cost facts


def test_cost_facts_are_declared():
    classes = {"vision_rope_cos_sin": "elementwise", "vision_rotary_": "elementwise", "rms_norm": "norm",
               "add_rms_norm": "norm", "merged_linear": "gemm", "silu_and_mul": "elementwise"}
    for name, cls in classes.items():
        assert FUSED[name].op_class == cls
        assert op_class(f"tessera.{name}.default") == cls
    # gate_up of Qwen2.5-VL-7B: [N,1280] x 2 x [3420,1280] (+ biases) is one GEMM N x 6840 x 1280
    shapes = [[5184, 1280], [3420, 1280], [3420, 1280], [3420], [3420]]
    assert FUSED["merged_linear"].gemm(shapes) == (1, 5184, 6840, 1280)
    x, w = torch.empty(5184, 1280, device="meta"), [torch.empty(3420, 1280, device="meta")] * 2
    assert FUSED["merged_linear"].flops((x, w, []), {}, None) == 2 * 5184 * 6840 * 1280
