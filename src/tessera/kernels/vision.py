"""Fused kernels of the Qwen2.5-VL vision tower (the encode phase), as vLLM runs it.

Vision-specific units:

- `tessera::vision_rope_cos_sin`: the axial 2-D rotary table of all patches, once per encode:
  (row, column) positions [N,2] and the inverse frequencies [D/4] -> cos, sin [N,D] (float32), laid out
  as Hugging Face's ``Qwen2_5_VLVisionRotaryEmbedding`` lays them out (h, w, h, w quarters).
- `tessera::vision_rotary_`: the vision RoPE of one block, in place on q and k (views [N,H,D] of the
  fused qkv projection's output), rotate-half over the whole head dim with per-patch cos/sin [N,D].
  One kernel where Hugging Face's eager forward runs about ten (casts, two rotate_half slices, cat,
  muls, adds, casts back).

Units that duplicate the dense ops of `tessera.kernels` (norm / linear / activation), defined here under
private ``vision_`` names so the vision tower does not depend on them; they compute exactly what Hugging
Face's eager modules compute (same casts, same rounding points), so the production tower matches the
eager one closely:

- `tessera::vision_rms_norm` (= ``rms_norm``): ``weight * (x * rsqrt(mean(x^2) + eps))`` in float32,
  cast back before the weight multiply.
- `tessera::vision_add_rms_norm` (= ``add_rms_norm``, functional): ``residual + x`` and its RMSNorm, both
  returned (vLLM's fused add+RMSNorm, without the in-place update).
- `tessera::vision_merged_linear` (= ``merged_linear``): several weights (and biases) of one input as one
  GEMM, outputs concatenated along the last dim (the MLP's gate and up projections).
- `tessera::vision_silu_and_mul` (= ``silu_and_mul``): ``silu(x[..., :I]) * x[..., I:]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tessera.graph.opclass import register_fused

# ---------------------------------------------------------------------------------------------------
# Rotary embedding


@torch.library.custom_op("tessera::vision_rope_cos_sin", mutates_args=())
def vision_rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Axial rotary table. position_ids [N,2] (row, column), inv_freq [D/4] -> cos, sin [N,D] float32."""
    freqs = position_ids[..., None].float() * inv_freq.float()  # [N,2,D/4]
    freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # [N,D/2]
    freqs = torch.cat([freqs, freqs], dim=-1)  # [N,D]
    return freqs.cos(), freqs.sin()


@vision_rope_cos_sin.register_fake
def _(position_ids, inv_freq):
    n, d = position_ids.shape[0], 4 * inv_freq.shape[0]
    return (position_ids.new_empty(n, d, dtype=torch.float32), position_ids.new_empty(n, d, dtype=torch.float32))


@torch.library.custom_op("tessera::vision_rotary_", mutates_args=("q", "k"))
def vision_rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE over the whole head dim, in place. q, k [N,H,D] (any strides), cos/sin [N,D]."""
    c, s = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    for t in (q, k):
        x = t.float()
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        t.copy_((x * c + rotated * s).to(t.dtype))


@vision_rotary_.register_fake
def _(q, k, cos, sin):
    return None


# ---------------------------------------------------------------------------------------------------
# Norms (duplicates of the dense rms_norm / add_rms_norm)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@torch.library.custom_op("tessera::vision_rms_norm", mutates_args=())
def vision_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. x [..., C], weight [C] -> [..., C] (the weight's dtype promotion)."""
    return _rms(x, weight, eps).contiguous()


@vision_rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("tessera::vision_add_rms_norm", mutates_args=())
def vision_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add and RMSNorm. x, residual [..., C] -> (rms_norm(residual + x), residual + x)."""
    summed = residual + x
    return _rms(summed, weight, eps).contiguous(), summed.contiguous()


@vision_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    summed = torch.promote_types(x.dtype, residual.dtype)
    return (x.new_empty(x.shape, dtype=torch.promote_types(summed, weight.dtype)),
            x.new_empty(x.shape, dtype=summed))


# ---------------------------------------------------------------------------------------------------
# Merged projection and activation (duplicates of the dense merged_linear / silu_and_mul)


@torch.library.custom_op("tessera::vision_merged_linear", mutates_args=())
def vision_merged_linear(x: torch.Tensor, weights: list[torch.Tensor],
                         biases: list[torch.Tensor]) -> torch.Tensor:
    """One GEMM for several projections of x. x [..., K], weights [N_i, K], biases [N_i] (one per weight,
    or none) -> [..., sum N_i]."""
    weight = torch.cat(list(weights), dim=0)
    bias = torch.cat(list(biases), dim=0) if biases else None
    return F.linear(x, weight, bias)


@vision_merged_linear.register_fake
def _(x, weights, biases):
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))


@torch.library.custom_op("tessera::vision_silu_and_mul", mutates_args=())
def vision_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:] [..., I]."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


@vision_silu_and_mul.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


# ---------------------------------------------------------------------------------------------------
# Cost facts


def _merged_linear_gemm(shapes: list[list[int]]) -> tuple[int, int, int, int]:
    x = shapes[0]
    return 1, math.prod(x[:-1]), sum(s[0] for s in shapes[1:] if len(s) == 2), x[-1]


def _merged_linear_flops(args, kwargs, out) -> int:
    x, weights = args[0], args[1]
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    n = sum(w.shape[0] for w in weights)
    return 2 * m * n * k + (m * n if args[2] else 0)


register_fused("vision_rope_cos_sin", "elementwise",
               flops=lambda args, kwargs, out: 4 * out[0].numel())
register_fused("vision_rotary_", "elementwise",
               flops=lambda args, kwargs, out: 3 * (args[0].numel() + args[1].numel()))
register_fused("vision_rms_norm", "norm", flops=lambda args, kwargs, out: 4 * args[0].numel())
register_fused("vision_add_rms_norm", "norm", flops=lambda args, kwargs, out: 5 * args[0].numel())
register_fused("vision_merged_linear", "gemm", flops=_merged_linear_flops, gemm=_merged_linear_gemm)
register_fused("vision_silu_and_mul", "elementwise", flops=lambda args, kwargs, out: 5 * out.numel())
