"""Fused kernels of the Qwen2.5-VL vision tower (the encode phase), as vLLM runs it.

Vision-specific units:

- `tessera::vision_rope_cos_sin`: the axial 2-D rotary table of all patches, once per encode:
  (row, column) positions [N,2] and the inverse frequencies [D/4] -> cos, sin [N,D] (float32), laid out
  as Hugging Face's ``Qwen2_5_VLVisionRotaryEmbedding`` lays them out (h, w, h, w quarters).
- `tessera::vision_rotary_`: the vision RoPE of one block, in place on q and k (views [N,H,D] of the
  fused qkv projection's output), rotate-half over the whole head dim with per-patch cos/sin [N,D].
  One kernel where Hugging Face's eager forward runs about ten (casts, two rotate_half slices, cat,
  muls, adds, casts back).

The rest of a vision block runs the dense units (`rms_norm`, `add_rms_norm`, `merged_linear`,
`silu_and_mul`), which compute exactly what Hugging Face's vision modules compute.
"""

from __future__ import annotations

import torch

from tessera.graph.opclass import register_fused
from tessera.kernels.bodies import custom_op

# ---------------------------------------------------------------------------------------------------
# Rotary embedding


@custom_op("tessera::vision_rope_cos_sin", mutates_args=())
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


@custom_op("tessera::vision_rotary_", mutates_args=("q", "k"))
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
# Cost facts


register_fused("vision_rope_cos_sin", "elementwise",
               flops=lambda args, kwargs, out: 4 * out[0].numel())
register_fused("vision_rotary_", "elementwise",
               flops=lambda args, kwargs, out: 3 * (args[0].numel() + args[1].numel()))
