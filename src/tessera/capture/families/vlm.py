"""Encode, prefill and decode steps of vision-language models (Qwen2.5-VL) over an engine-owned KV cache.

The image size is part of the step, like the sequence length: the vision grid (patches per side, the
rotary position of every patch, the attention windows, the order tokens are permuted into for
windowed attention) is computed on the host before the step and handed to it as constants. The
vision tower therefore runs here with host-known shapes: every block attends with one
`tessera::segment_attention` kernel over the host-known window (or image) lengths, counted for the
within-segment pairs only. In the production graph (`tessera.capture.production.qwen2_5_vl`) the
tower's modules run Tessera's fused vision units (about 10 kernels a block); with ``graph="eager"`` they
run Hugging Face's forwards op by op (about 40 a block). The text decoder is Hugging Face's, routed through
Tessera's attention kernels; its multimodal rotary positions (``position_ids`` [3,B,S]) are inputs
computed on the host for the known prompt layout (`mrope_position_ids`).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from tessera.capture.families.llm import kv_of, new_kv_cache, sampled, step_meta, with_sampler_inputs
from tessera.capture.ops import StepContext, register_hf_hooks, step_context
from tessera.capture.step import Step
from tessera.errors import PhaseError, ShapeError
from tessera.limits import IMAGE_SIDE

VLM_PHASES = ("encode", "prefill", "decode")
ATTN_IMPLEMENTATION = {"": "sdpa", "text_config": "tessera", "vision_config": "sdpa"}
"""Text decoder through Tessera's cache-aware kernels; the vision tower (and HF's own vision forward,
used as a reference) through SDPA."""


# ---------------------------------------------------------------------------------------------------
# Config and model


def build_vlm(config, dtype: torch.dtype = torch.bfloat16,
              attn_implementation: str | dict[str, str] | None = None) -> nn.Module:
    """A transformers Qwen2.5-VL model whose text decoder attends through Tessera's kernels.

    ``attn_implementation`` overrides the per-sub-config choice (e.g. ``"sdpa"`` for a plain Hugging
    Face reference model that runs without a step context). The model gets its own copy of ``config``:
    transformers records the attention choice in the config object the model keeps, so two models
    built from one shared config would otherwise switch each other's attention.
    """
    from transformers import Qwen2_5_VLForConditionalGeneration

    register_hf_hooks()
    impl = ATTN_IMPLEMENTATION if attn_implementation is None else attn_implementation
    return Qwen2_5_VLForConditionalGeneration._from_config(copy.deepcopy(config), dtype=dtype,
                                                            attn_implementation=impl)


# ---------------------------------------------------------------------------------------------------
# The vision grid, on the host

_IMAGE_RE = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\d+)\s*$")


def parse_image_size(text: str) -> tuple[int, int]:
    """``"504x504"`` -> (width, height) in pixels."""
    m = _IMAGE_RE.match(text)
    if m and max(len(m.group(1)), len(m.group(2))) > 9:  # int() of thousands of digits is itself refused
        IMAGE_SIDE.check(10**9, f"image size {text[:32]!r}")
    if not m or int(m.group(1)) <= 0 or int(m.group(2)) <= 0:
        raise ShapeError(f"image size {text!r} is not WIDTHxHEIGHT in pixels (e.g. 504x504)")
    for side in (int(m.group(1)), int(m.group(2))):
        IMAGE_SIDE.check(side, f"image size {text!r}")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class ImageGrid:
    """How one image of ``width`` x ``height`` pixels is cut into patches (t, h, w) and merged tokens."""

    width: int
    height: int
    t: int
    h: int
    w: int
    merge: int
    patch_dim: int  # channels * temporal_patch * patch * patch: one row of pixel_values

    @property
    def patches(self) -> int:
        return self.t * self.h * self.w

    @property
    def tokens(self) -> int:
        """Merged tokens the image becomes in the text sequence."""
        return self.patches // (self.merge * self.merge)


def image_grid(vision_config, image: tuple[int, int]) -> ImageGrid:
    """The patch grid of an image (width, height) as the Qwen2.5-VL processor would cut it.

    Raises:
        ValueError: a side is not a positive multiple of patch size x spatial merge size.
    """
    width, height = image
    patch, merge = int(vision_config.patch_size), int(vision_config.spatial_merge_size)
    unit = patch * merge
    if width <= 0 or height <= 0 or width % unit or height % unit:
        near = f"{max(unit, round(width / unit) * unit)}x{max(unit, round(height / unit) * unit)}"
        raise ShapeError(f"image size {width}x{height} is not a multiple of {unit} pixels (patch {patch} x "
                         f"spatial merge {merge}) on both sides; the processor resizes to such a size, "
                         f"e.g. {near}")
    temporal = int(vision_config.temporal_patch_size)
    return ImageGrid(width=width, height=height, t=1, h=height // patch, w=width // patch, merge=merge,
                     patch_dim=int(vision_config.in_channels) * temporal * patch * patch)


def vision_tables(vision_config, grid: ImageGrid, images: int = 1) -> tuple[dict[str, torch.Tensor], dict]:
    """Host tables of the vision tower for ``images`` images of ``grid``: step constants and JSON meta.

    Constants: ``vision.position_ids`` [N,2] (row, column of each patch, in window order),
    ``vision.window_index`` / ``vision.reverse_index`` [N/merge²] (merged-token permutation into window
    order and back). The segment lengths of windowed and full-attention layers are host lists in the
    meta (``window_lengths``, ``image_lengths``).
    """
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_position_ids,
        get_vision_window_index,
    )

    grid_thw = torch.tensor([[grid.t, grid.h, grid.w]] * images)
    unit = grid.merge * grid.merge
    positions = get_vision_position_ids(grid_thw, grid.merge)
    window_index, cu_window = get_vision_window_index(
        grid_thw, spatial_merge_size=grid.merge, window_size=int(vision_config.window_size),
        patch_size=int(vision_config.patch_size))
    cu_seqlens = get_vision_cu_seqlens(grid_thw).tolist()
    cu_window = cu_window.tolist()
    n = positions.shape[0]
    consts = {
        "vision.position_ids": positions.reshape(n // unit, unit, 2)[window_index].reshape(n, 2).contiguous(),
        "vision.window_index": window_index.long(),
        "vision.reverse_index": torch.argsort(window_index).long(),
    }
    meta = {"image": [grid.width, grid.height], "images": images, "grid_thw": grid_thw.tolist(),
            "patches": n, "image_tokens": grid.tokens, "cu_seqlens": cu_seqlens,
            "cu_window_seqlens": cu_window,
            "window_lengths": [b - a for a, b in zip(cu_window, cu_window[1:], strict=False)],
            "image_lengths": [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:], strict=False)]}
    return consts, meta


def mrope_position_ids(config, grid: ImageGrid, seq: int, image_start: int) -> tuple[torch.Tensor, int]:
    """Multimodal rotary positions [3,S] of a prompt whose image tokens start at ``image_start``, and the
    rope delta (decode position of cache index i is ``i + delta``), as ``get_rope_index`` computes them."""
    tokens = grid.tokens
    end = image_start + tokens
    if image_start < 0 or end > seq:
        raise ShapeError(f"the image's {tokens} tokens at {image_start}..{end - 1} do not fit in a prompt of "
                         f"{seq} tokens (use --seq of at least {end})")
    llm_h, llm_w = grid.h // grid.merge, grid.w // grid.merge
    pos = torch.empty(3, seq, dtype=torch.long)
    pos[:, :image_start] = torch.arange(image_start)
    hh, ww = torch.meshgrid(torch.arange(llm_h), torch.arange(llm_w), indexing="ij")
    pos[0, image_start:end] = image_start
    pos[1, image_start:end] = hh.flatten() + image_start
    pos[2, image_start:end] = ww.flatten() + image_start
    after = image_start + max(grid.h, grid.w) // grid.merge
    pos[:, end:] = torch.arange(seq - end) + after
    delta = int(pos.max()) + 1 - seq
    return pos, delta


# ---------------------------------------------------------------------------------------------------
# The vision tower with host-known grids


def _vision_attention(attn: nn.Module, hidden_states: torch.Tensor, cu_seqlens=None,
                      position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                      segments: list[int] | None = None, **_kwargs) -> torch.Tensor:
    """Qwen2.5-VL vision self-attention as one fused kernel over all segments (windows or images)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    n = hidden_states.shape[0]
    q, k, v = attn.qkv(hidden_states).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = torch.ops.tessera.segment_attention(q, k, v, list(segments or [n]), float(attn.scaling))
    return attn.proj(out.view(n, -1))


def vision_tower(visual: nn.Module, pixel_values: torch.Tensor, consts: dict[str, torch.Tensor],
                 window_lengths: list[int], image_lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The vision tower's modules on host-known grids: patch embed, window order, blocks (each attending
    within its windows, or within each image in the full-attention blocks), merger, original order.
    [patches, C*T*P*P] pixels -> (hidden states before the merger [patches, vision hidden], merged tokens
    [tokens, text hidden]). The eager and the production towers differ only in their modules' forwards."""
    hidden = visual.patch_embed(pixel_values)
    n, dim = hidden.shape
    unit = visual.spatial_merge_unit
    hidden = hidden.view(n // unit, unit, dim).index_select(0, consts["vision.window_index"]).view(n, dim)
    cos, sin = visual.rotary_pos_emb(hidden, consts["vision.position_ids"])
    for i, block in enumerate(visual.blocks):
        segments = image_lengths if i in visual.fullatt_block_indexes else window_lengths
        hidden = block(hidden, cu_seqlens=None, position_embeddings=(cos, sin), segments=segments)
    return hidden, visual.merger(hidden).index_select(0, consts["vision.reverse_index"])


def _vision_forward(visual: nn.Module, pixel_values: torch.Tensor, consts: dict[str, torch.Tensor],
                    window_lengths: list[int], image_lengths: list[int]) -> torch.Tensor:
    """The vision tower on host-known grids: [patches, C*T*P*P] pixels -> [tokens, text hidden]."""
    return vision_tower(visual, pixel_values, consts, window_lengths, image_lengths)[1]


@contextmanager
def _static_vision(visual: nn.Module) -> Iterator[None]:
    """Within the block, ``visual(pixels, consts)`` runs the host-grid vision forward.

    The modules are still called (not their functions), so a trace attributes kernels to the tower's
    and each block's module scope; the Hugging Face forwards are restored on exit. A tower rewired for
    the production graph (`tessera.capture.production.qwen2_5_vl`) already takes the host-grid
    arguments and is left as it is.
    """
    if getattr(visual, "tessera_production", False):  # set by production.qwen2_5_vl.apply_vision
        yield
        return
    patched = [visual] + [block.attn for block in visual.blocks]
    visual.forward = functools.partial(_vision_forward, visual)
    for block in visual.blocks:
        block.attn.forward = functools.partial(_vision_attention, block.attn)
    try:
        yield
    finally:
        for mod in patched:
            del mod.forward


# ---------------------------------------------------------------------------------------------------
# Steps


def _on(values: dict[str, torch.Tensor], device: str | torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in values.items()}


def encode_step(model: nn.Module, constant_values: dict[str, torch.Tensor], *, model_name: str, batch: int,
                image: tuple[int, int], device: str | torch.device = "meta",
                inputs: dict[str, torch.Tensor] | None = None) -> Step:
    """The vision tower on ``batch`` images of size ``image`` (width, height).

    Input ``pixel_values`` [batch*patches, C*T*P*P] (the processor's layout); output ``image_embeds``
    [batch*tokens, text hidden], the images one after the other.
    """
    visual = model.model.visual
    grid = image_grid(visual.config, image)
    tables, meta = vision_tables(visual.config, grid, batch)
    dtype = next(model.parameters()).dtype
    if inputs is None:
        pixels = torch.zeros(batch * grid.patches, grid.patch_dim, dtype=dtype, device=device)
        inputs = {"pixel_values": pixels}

    def fn(inp, _st, consts):
        with _static_vision(visual):
            return {"image_embeds": visual(inp["pixel_values"], consts, meta["window_lengths"],
                                           meta["image_lengths"])}

    return Step(model=model_name, family="vlm", phase="encode", modules={"": model}, fn=fn, inputs=inputs,
                state={}, constants=_on(tables, device), constant_values=dict(constant_values) | tables,
                meta={"batch": batch} | meta)


def prompt_inputs(config, grid: ImageGrid, batch: int, seq: int, image_start: int,
                  device: str | torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Prefill inputs for a prompt of ``seq`` tokens with the image's tokens at ``image_start``: token ids
    (zeros around the vision start / image / vision end tokens), zero image embeddings, host positions."""
    positions, _ = mrope_position_ids(config, grid, seq, image_start)
    end = image_start + grid.tokens
    ids = torch.zeros(batch, seq, dtype=torch.long)
    ids[:, image_start:end] = config.image_token_id
    if image_start > 0:
        ids[:, image_start - 1] = config.vision_start_token_id
    if end < seq:
        ids[:, end] = config.vision_end_token_id
    hidden = config.text_config.hidden_size
    return {"input_ids": ids.to(device),
            "image_embeds": torch.zeros(batch * grid.tokens, hidden, dtype=dtype, device=device),
            "position_ids": positions[:, None, :].expand(3, batch, seq).contiguous().to(device),
            "slots": torch.arange(batch, device=device)}


def decode_inputs(batch: int, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Placeholder decode inputs: token ids [B,1], rope ``positions`` [B], ``cache_positions`` [B], slots."""
    zeros = functools.partial(torch.zeros, batch, dtype=torch.long, device=device)
    return {"input_ids": zeros().view(batch, 1), "positions": zeros(), "cache_positions": zeros(),
            "slots": torch.arange(batch, device=device)}


def _text_step(model: nn.Module, constant_values: dict[str, torch.Tensor], *, model_name: str, phase: str,
               batch: int, seq: int, ctx: int, grid: ImageGrid, image_start: int, device: str | torch.device,
               state: dict[str, torch.Tensor] | None, inputs: dict[str, torch.Tensor] | None,
               slots: int | None = None) -> Step:
    config = model.config
    dtype = next(model.parameters()).dtype
    _, delta = mrope_position_ids(config, grid, seq, image_start)
    if phase == "prefill" and seq > ctx:
        raise ShapeError(f"a prompt of {seq} tokens does not fit in a context of {ctx}")
    if state is None:
        state = new_kv_cache(config.text_config, slots or batch, ctx, dtype, device)
    if inputs is None:
        inputs = (prompt_inputs(config, grid, batch, seq, image_start, device, dtype) if phase == "prefill"
                  else decode_inputs(batch, device))
    inputs = with_sampler_inputs(inputs, batch, device)
    start, end = image_start, image_start + grid.tokens

    def prefill(inp, st, _consts):
        embeds = model.model.language_model.embed_tokens(inp["input_ids"])
        embeds[:, start:end].copy_(inp["image_embeds"].view(batch, grid.tokens, -1))
        with step_context(StepContext(phase="prefill", slots=inp["slots"], positions=None, kv=kv_of(st))):
            out = model(inputs_embeds=embeds, position_ids=inp["position_ids"], use_cache=False,
                        logits_to_keep=1)
        return sampled(out.logits, inp)

    def decode(inp, st, _consts):
        position_ids = inp["positions"].view(1, batch, 1).expand(3, batch, 1)
        sctx = StepContext(phase="decode", slots=inp["slots"], positions=inp["cache_positions"], kv=kv_of(st))
        with step_context(sctx):
            out = model(input_ids=inp["input_ids"], position_ids=position_ids, use_cache=False,
                        logits_to_keep=1)
        return sampled(out.logits, inp)

    meta = step_meta(batch, seq if phase == "prefill" else 1, ctx, slots) | {
        "image": [grid.width, grid.height], "image_start": image_start, "image_tokens": grid.tokens,
        "prompt": seq, "rope_delta": delta}
    return Step(model=model_name, family="vlm", phase=phase, modules={"": model},
                fn=prefill if phase == "prefill" else decode, inputs=inputs, state=state,
                constant_values=dict(constant_values), meta=meta)


def vlm_step(model: nn.Module, constant_values: dict[str, torch.Tensor], *, model_name: str, phase: str,
             batch: int, seq: int, ctx: int, image: tuple[int, int], device: str | torch.device = "meta",
             inputs: dict[str, torch.Tensor] | None = None, state: dict[str, torch.Tensor] | None = None,
             image_start: int = 1, slots: int | None = None) -> Step:
    """One step of a Qwen2.5-VL model for images of ``image`` = (width, height) pixels.

    - ``encode``: the vision tower on ``batch`` images: ``pixel_values`` -> ``image_embeds``.
    - ``prefill``: a prompt of ``seq`` tokens (image tokens included, at ``image_start``) per row:
      ``input_ids`` [B,S], ``image_embeds`` [B*tokens, hidden], ``position_ids`` [3,B,S], ``slots`` [B]
      -> last-position ``logits`` [B,1,V]; K/V written to positions 0..S-1 of each row's cache slot.
    - ``decode``: ``input_ids`` [B,1], rope ``positions`` [B] (cache index + the prompt's rope delta),
      ``cache_positions`` [B], ``slots`` [B] -> ``logits`` [B,1,V].

    ``seq`` is the prompt length of the prefill the decode follows (it fixes the rope delta in
    ``meta``); ``ctx`` is the cache length per slot; the cache has ``slots`` rows (default B).
    """
    if phase not in VLM_PHASES:
        raise PhaseError(f"phase {phase!r} is not a phase of a vision-language model "
                         f"(use {', '.join(VLM_PHASES)})")
    if phase == "encode":
        return encode_step(model, constant_values, model_name=model_name, batch=batch, image=image,
                           device=device, inputs=inputs)
    grid = image_grid(model.config.vision_config, image)
    return _text_step(model, constant_values, model_name=model_name, phase=phase, batch=batch, seq=seq,
                      ctx=ctx, grid=grid, image_start=image_start, device=device, state=state, inputs=inputs,
                      slots=slots)
