"""Qwen2.5-VL production graph: the vision tower fused as vLLM runs it, the text decoder as the dense one.

The vision tower runs once per image (the encode step) on host-known grids (`families.vlm`): window order,
rotary positions and attention segment lengths are step constants / host lists. Its kernels:

- ``patch_embed``: the Conv3d over non-overlapping patches as ONE GEMM [N, C*T*P*P] x [C*T*P*P, E];
- window-reorder gather (one ``index_select``), the rotary table once (`tessera::vision_rope_cos_sin`);
- per block (10 kernels): ``norm1`` RMSNorm, ``attn.qkv`` GEMM + bias, vision RoPE in place on the q, k
  views of the qkv output (`tessera::vision_rotary_`), `tessera::segment_attention` over the host-known
  window (or image) lengths, ``attn.proj`` GEMM, ``norm2`` = residual add + RMSNorm in one kernel, the
  MLP's gate and up projections as one GEMM, SiluAndMul, ``down_proj`` GEMM, residual add;
- merger: RMSNorm, Linear, GELU, Linear; the inverse gather.

Module calls and parameter names are kept (kernels land in ``model.visual.blocks.<i>.attn`` etc.; weights
load by Hugging Face name). The text decoder is rewired by the dense decoder's
``apply_text_decoder(text_model, rope="mrope")`` when it is available; otherwise it keeps its Hugging Face
forward (attention through Tessera's kernels) and the report says so.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import nn

import tessera.kernels  # noqa: F401 - registers the tessera:: ops
from tessera.capture.production import FusionReport

VISION_UNITS = ["patch_embed GEMM", "vision_rope_cos_sin", "rms_norm", "vision_rotary_",
                "segment_attention", "add_rms_norm", "merged_linear", "silu_and_mul"]


# ---------------------------------------------------------------------------------------------------
# Module forwards


def _rms_norm_forward(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.tessera.rms_norm(x, norm.weight, float(norm.variance_epsilon))


def _add_rms_norm_forward(norm: nn.Module, x: torch.Tensor,
                          residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x)``, or with ``residual`` (residual + x, its norm) as (normed, new residual)."""
    if residual is None:
        return _rms_norm_forward(norm, x)
    return torch.ops.tessera.add_rms_norm(x, residual, norm.weight, float(norm.variance_epsilon))


def _patch_embed_forward(embed: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Conv3d with stride == kernel over [N, C*T*P*P] patch rows == one GEMM against the flattened kernel."""
    weight = embed.proj.weight
    return F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1))


def _rotary_forward(rope: nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if float(rope.attention_scaling) != 1.0:
        raise NotImplementedError("vision rotary embedding with attention scaling != 1")
    return torch.ops.tessera.vision_rope_cos_sin(position_ids, rope.inv_freq)


def _attention_forward(attn: nn.Module, hidden_states: torch.Tensor, cu_seqlens=None,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                       segments: list[int] | None = None, **_kwargs) -> torch.Tensor:
    """qkv GEMM, RoPE in place on the q/k views of its output, one attention kernel, proj GEMM."""
    n = hidden_states.shape[0]
    qkv = attn.qkv(hidden_states).view(n, 3, attn.num_heads, -1)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    cos, sin = position_embeddings
    torch.ops.tessera.vision_rotary_(q, k, cos, sin)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = torch.ops.tessera.segment_attention(q, k, v, list(segments or [n]), float(attn.scaling))
    return attn.proj(out.view(n, -1))


def _mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """gate and up projections as one GEMM, SiluAndMul, down GEMM."""
    biases = [mlp.gate_proj.bias, mlp.up_proj.bias]
    gate_up = torch.ops.tessera.merged_linear(
        x, [mlp.gate_proj.weight, mlp.up_proj.weight], [] if biases[0] is None else biases)
    return mlp.down_proj(torch.ops.tessera.silu_and_mul(gate_up))


def _block_forward(block: nn.Module, hidden_states: torch.Tensor, cu_seqlens=None,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                   segments: list[int] | None = None, **_kwargs) -> torch.Tensor:
    """vLLM's vision block: norm1, attention, fused add + norm2, MLP, residual add."""
    attn_out = block.attn(block.norm1(hidden_states), position_embeddings=position_embeddings, segments=segments)
    normed, residual = block.norm2(attn_out, residual=hidden_states)
    return residual + block.mlp(normed)


def vision_forward(visual: nn.Module, pixel_values: torch.Tensor, consts: dict[str, torch.Tensor] | None = None,
                   window_lengths: list[int] | None = None, image_lengths: list[int] | None = None,
                   grid_thw: torch.Tensor | None = None, **_kwargs):
    """The production vision tower on host-known grids: [patches, C*T*P*P] -> [tokens, text hidden].

    Called as the encode step calls it (``consts`` and the host segment lengths from
    `families.vlm.vision_tables`), or as Hugging Face's model calls its tower (``grid_thw`` on the host,
    all images of one size): then the host tables are computed here and a ``BaseModelOutputWithPooling``
    is returned.
    """
    hf_call = consts is None
    if hf_call:
        consts, window_lengths, image_lengths = _host_tables(visual, grid_thw, pixel_values.device)
    from tessera.capture.families.vlm import vision_tower

    hidden, merged = vision_tower(visual, pixel_values, consts, window_lengths, image_lengths)
    if not hf_call:
        return merged
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=merged)


def _host_tables(visual: nn.Module, grid_thw: torch.Tensor | None, device) -> tuple[dict, list[int], list[int]]:
    from tessera.capture.families.vlm import ImageGrid, vision_tables

    rows = grid_thw.tolist() if grid_thw is not None else []
    if not rows or any(r != rows[0] for r in rows) or rows[0][0] != 1:
        raise NotImplementedError(f"the production vision tower runs images of one size (grid t=1); got grid_thw "
                                  f"{rows}")
    cfg = visual.config
    _, h, w = rows[0]
    patch, merge = int(cfg.patch_size), int(cfg.spatial_merge_size)
    grid = ImageGrid(width=w * patch, height=h * patch, t=1, h=h, w=w, merge=merge,
                     patch_dim=int(cfg.in_channels) * int(cfg.temporal_patch_size) * patch * patch)
    tables, meta = vision_tables(cfg, grid, len(rows))
    return ({k: v.to(device) for k, v in tables.items()}, meta["window_lengths"], meta["image_lengths"])


def _bind(module: nn.Module, fn) -> None:
    module.forward = types.MethodType(fn, module)


def apply_vision(visual: nn.Module) -> list[str]:
    """Rewire the vision tower in place; the fused units it now runs."""
    visual.forward = functools.partial(vision_forward, visual)
    _bind(visual.patch_embed, _patch_embed_forward)
    _bind(visual.rotary_pos_emb, _rotary_forward)
    for block in visual.blocks:
        _bind(block, _block_forward)
        _bind(block.norm1, _rms_norm_forward)
        _bind(block.norm2, _add_rms_norm_forward)
        _bind(block.attn, _attention_forward)
        _bind(block.mlp, _mlp_forward)
    _bind(visual.merger.ln_q, _rms_norm_forward)
    visual.tessera_production = True
    return [f"vision: {u}" for u in VISION_UNITS]


def is_production_vision(visual: nn.Module) -> bool:
    """Whether `apply_vision` rewired this tower (its forward then takes the host-grid arguments itself)."""
    return bool(getattr(visual, "tessera_production", False))


# ---------------------------------------------------------------------------------------------------
# The model


def apply(model: nn.Module) -> FusionReport:
    """Rewire a built ``Qwen2_5_VLForConditionalGeneration`` in place: vision tower and text decoder."""
    report = FusionReport("production", fused=apply_vision(model.model.visual))
    try:
        from tessera.capture.production.decoder import apply_text_decoder

        text = apply_text_decoder(model.model.language_model, rope="mrope")
    except (ImportError, AttributeError) as e:
        report.fallbacks.append(f"text decoder: tessera.capture.production.decoder.apply_text_decoder is not "
                                f"available ({type(e).__name__}: {e}); the Qwen2.5-VL text model keeps its Hugging "
                                f"Face forward with Tessera's attention kernels")
        return report
    if isinstance(text, FusionReport):
        report.fused += [f"text: {u}" for u in text.fused]
        report.fallbacks += [f"text: {f}" for f in text.fallbacks]
    elif isinstance(text, (list, tuple)):
        report.fused += [f"text: {u}" for u in text]
    return report
