"""Rotary position embeddings applied in place to q and k (vLLM's ``rotary_embedding``, ``triton_mrope``).

Both ops take q [B,H,S,D] and k [B,KVH,S,D] (typically strided views of the fused QKV projection's
output, so no copy is made) and rotate them in place; cos/sin are computed inside from the rotary
module's ``inv_freq`` and the positions, as Hugging Face's rotary embedding computes them: ``freqs =
positions * inv_freq`` in fp32, ``cos = cos(freqs) * scaling`` cast to the activation dtype, then
``x1 * cos - x2 * sin`` / ``x2 * cos + x1 * sin`` on the two halves of the head dimension in the activation
dtype, the same operations in the same dtypes as ``apply_rotary_pos_emb`` (bit-identical results).
"""

from __future__ import annotations

import math

import torch

from tessera.graph.opclass import register_fused
from tessera.kernels.bodies import custom_op


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [B,H,S,D] rotated in place by cos/sin [B,S,D/2] (already in x's dtype)."""
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x[..., :half], x[..., half:]
    first = x1 * cos - x2 * sin
    second = x2 * cos + x1 * sin
    x1.copy_(first)
    x2.copy_(second)


def _cos_sin(freqs: torch.Tensor, scaling: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


@custom_op("tessera::rotary_", mutates_args=("q", "k"))
def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None, inv_freq: torch.Tensor,
            scaling: float) -> None:
    """Rotate q [B,H,S,D] and k [B,KVH,S,D] in place; positions [B,S] (None: 0..S-1), inv_freq [D/2]."""
    s = q.shape[2]
    if positions is None:
        positions = torch.arange(s, device=q.device)[None]
    freqs = positions[..., None].float() * inv_freq.to(device=q.device, dtype=torch.float)
    cos, sin = _cos_sin(freqs, scaling, q.dtype)
    _rotate_(q, cos, sin)
    _rotate_(k, cos, sin)


@rotary_.register_fake
def _(q, k, positions, inv_freq, scaling):
    return None


@custom_op("tessera::mrope_", mutates_args=("q", "k"))
def mrope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
           sections: list[int], scaling: float) -> None:
    """Multimodal RoPE (Qwen2-VL / Qwen2.5-VL) in place: positions [3,B,S] (temporal, height, width);
    frequency band i of ``sections`` (over D/2) takes its angle from position row i % 3."""
    freqs = positions.expand(3, -1, -1)[..., None].float() * inv_freq.to(device=q.device, dtype=torch.float)
    cos, sin = _cos_sin(freqs, scaling, torch.float32)  # [3,B,S,D/2] in fp32 like HF, cast after the pick
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(list(sections), dim=-1))], dim=-1).to(q.dtype)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(list(sections), dim=-1))], dim=-1).to(q.dtype)
    _rotate_(q, cos, sin)
    _rotate_(k, cos, sin)


@mrope_.register_fake
def _(q, k, positions, inv_freq, sections, scaling):
    return None


def _rope_flops(args, kwargs, out) -> int:
    q, k = args[0], args[1]
    return 3 * (math.prod(q.shape) + math.prod(k.shape))  # 2 multiplies + 1 add per element


register_fused("rotary_", "elementwise", flops=_rope_flops)
register_fused("mrope_", "elementwise", flops=_rope_flops)
