"""Fused attention kernels.

Attention over the engine-owned KV cache is one kernel per layer, like the fused attention kernels of
vLLM or SGLang: `tessera::prefill_attention` (causal, over the new tokens) and
`tessera::decode_attention` (one query per row against that row's cache slot, masked by the row's
own position, so rows at different context lengths share one step). Both support grouped-query
attention, sliding windows and attention sinks (GPT-oss). Being custom ops, a trace records each as a
single kernel, on `meta` as on a real device, and a replay calls the same op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.graph.opclass import register_fused
from tessera.kernels.bodies import custom_op


def _sdpa_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA with a boolean mask; sinks add a per-head logit to the softmax denominator only."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    # A sink is an extra key whose score is the per-head sink logit and whose value is zero.
    heads = q.shape[1]
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    bias = bias.expand(*bias.shape[:1], heads, *bias.shape[2:]) if bias.shape[1] == 1 else bias
    sink_col = sinks.to(q.dtype).view(1, heads, 1, 1).expand(bias.shape[0], heads, bias.shape[2], 1)
    bias = torch.cat([bias, sink_col], dim=-1)
    zeros = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])
    return F.scaled_dot_product_attention(q, torch.cat([k, zeros], 2), torch.cat([v, zeros], 2),
                                          attn_mask=bias, scale=scale, enable_gqa=True)


@custom_op("tessera::prefill_attention", mutates_args=())
def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int,
                      sinks: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of S new tokens. q [B,H,S,D], k/v [B,KVH,S,D] -> [B,S,H,D]."""
    s = q.shape[2]
    if window <= 0 and sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        i = torch.arange(s, device=q.device)
        allowed = i[None, :] <= i[:, None]
        if window > 0:
            allowed &= i[None, :] > i[:, None] - window
        out = _sdpa_with_sinks(q, k, v, allowed[None, None], scale, sinks)
    return out.transpose(1, 2).contiguous()


@prefill_attention.register_fake
def _(q, k, v, scale, window, sinks):
    b, h, s, d = q.shape
    return q.new_empty(b, s, h, v.shape[-1])


@custom_op("tessera::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, scale: float, window: int,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """One query per row against its cache slot, keys 0..position. q [B,H,1,D] -> [B,1,H,D]."""
    n = k_cache.shape[2]
    if q.device.type == "cpu" and positions.numel():
        # on a CPU, read the cache only up to the step's furthest position: the positions after it are masked
        # for every row, so the result is the same, for the work of the contexts served rather than of the
        # whole cache (a GPU keeps the static length its graphs are captured at)
        n = min(n, int(positions.max()) + 1)
    k = k_cache[:, :, :n].index_select(0, slots)
    v = v_cache[:, :, :n].index_select(0, slots)
    j = torch.arange(k.shape[2], device=q.device)
    allowed = j[None, :] <= positions[:, None]
    if window > 0:
        allowed &= j[None, :] > positions[:, None] - window
    rows, heads, kv_heads = q.shape[0], q.shape[1], k.shape[1]
    if q.device.type == "cpu" and sinks is None and heads != kv_heads:
        # on a CPU, the query heads that share a KV head go as that head's queries: SDPA then packs each KV
        # head once rather than once per query head (5x faster at 16 rows of smollm2-135m, bf16)
        group = heads // kv_heads
        grouped = q.reshape(rows, kv_heads, group, q.shape[-1])
        out = F.scaled_dot_product_attention(grouped, k, v, scale=scale,
                                             attn_mask=allowed[:, None, None, :].expand(rows, 1, group, -1))
        return out.reshape(rows, 1, heads, out.shape[-1])
    out = _sdpa_with_sinks(q, k, v, allowed[:, None, None, :], scale, sinks)
    return out.transpose(1, 2).contiguous()


@decode_attention.register_fake
def _(q, k_cache, v_cache, slots, positions, scale, window, sinks):
    b, h, s, d = q.shape
    return q.new_empty(b, s, h, v_cache.shape[-1])


@custom_op("tessera::segment_attention", mutates_args=())
def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                      scale: float) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of a packed sequence (vision windows).

    q/k/v [B,H,S,D] with S = sum(lengths) -> [B,S,H,D]. One kernel whatever the number of segments.
    """
    mask = None
    if len(lengths) > 1:
        ids = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                      torch.tensor(lengths, device=q.device))
        mask = ids[:, None] == ids[None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).contiguous()


@segment_attention.register_fake
def _(q, k, v, lengths, scale):
    b, h, s, d = q.shape
    return q.new_empty(b, s, h, v.shape[-1])


def _decode_traffic(args, kwargs, out) -> tuple[int, int]:
    """Each row reads its own cache slot (K and V), not the whole cache the op is given; with a sliding
    window only the window's last ``window`` positions of it (as its FLOPs count, graph.opclass)."""
    q, k_cache, v_cache, slots, positions = args[:5]
    rows = slots.numel()
    per_row = (k_cache[0].numel() * k_cache.element_size() + v_cache[0].numel() * v_cache.element_size())
    window = int((args[6] if len(args) > 6 else kwargs.get("window", 0)) or 0)
    ctx = k_cache.shape[2]
    if 0 < window < ctx:
        per_row = per_row * window // ctx
    read = q.numel() * q.element_size() + rows * per_row + (slots.numel() + positions.numel()) * slots.element_size()
    sinks = args[7] if len(args) > 7 else kwargs.get("sinks")
    if sinks is not None:
        read += sinks.numel() * sinks.element_size()
    return read, out.numel() * out.element_size()


# FLOPs of the attention ops are counted by name in tessera.graph.opclass (causal pairs, windows).
register_fused("decode_attention", "attention", traffic=_decode_traffic)
