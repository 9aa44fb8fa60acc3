"""Tessera's own fused kernels and the hooks that route Hugging Face models through them.

Attention over the engine-owned KV cache is one kernel per layer, like the fused attention kernels of
vLLM or SGLang: `tessera::prefill_attention` (causal, over the new tokens) and
`tessera::decode_attention` (one query per row against that row's cache slot, masked by the row's
own position, so rows at different context lengths share one step). Both support grouped-query
attention, sliding windows and attention sinks (GPT-oss). They are `torch.library` custom ops, so a
trace records each as a single kernel, on `meta` as on a real device.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------
# Fused attention kernels


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


@torch.library.custom_op("tessera::prefill_attention", mutates_args=())
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


@torch.library.custom_op("tessera::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, scale: float, window: int,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """One query per row against its cache slot, keys 0..position. q [B,H,1,D] -> [B,1,H,D]."""
    k = k_cache.index_select(0, slots)
    v = v_cache.index_select(0, slots)
    j = torch.arange(k.shape[2], device=q.device)
    allowed = j[None, :] <= positions[:, None]
    if window > 0:
        allowed &= j[None, :] > positions[:, None] - window
    out = _sdpa_with_sinks(q, k, v, allowed[:, None, None, :], scale, sinks)
    return out.transpose(1, 2).contiguous()


@decode_attention.register_fake
def _(q, k_cache, v_cache, slots, positions, scale, window, sinks):
    b, h, s, d = q.shape
    return q.new_empty(b, s, h, v_cache.shape[-1])


# ---------------------------------------------------------------------------------------------------
# The step context: what the attention and state hooks of the current step read


@dataclass
class StepContext:
    """Per-step data the model's attention layers need: phase, rows' positions and slots, the caches."""

    phase: str  # "prefill" | "decode"
    slots: torch.Tensor  # [B] cache slot of each row
    positions: torch.Tensor | None  # decode: [B] position of each row's new token
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (k_cache, v_cache) [slots,KVH,ctx,D]


_CURRENT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("tessera_step", default=None)


class step_context:
    """Make ``ctx`` the current step context for the duration of a ``with`` block."""

    def __init__(self, ctx: StepContext):
        self.ctx = ctx

    def __enter__(self) -> StepContext:
        self._token = _CURRENT.set(self.ctx)
        return self.ctx

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._token)


def current_step() -> StepContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("tessera attention called outside a Tessera step (no step context set)")
    return ctx


def tessera_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sliding_window=None, s_aux=None, **kwargs):
    """Hugging Face attention-interface function: write K/V into the engine cache, then attend."""
    ctx = current_step()
    k_cache, v_cache = ctx.kv[module.layer_idx]
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    window = int(sliding_window or 0)
    if ctx.phase == "prefill":
        s = key.shape[2]
        k_cache[:, :, :s].index_put_((ctx.slots,), key)
        v_cache[:, :, :s].index_put_((ctx.slots,), value)
        out = torch.ops.tessera.prefill_attention(query, key, value, scale, window, s_aux)
    else:
        k_cache[ctx.slots, :, ctx.positions] = key[:, :, 0]
        v_cache[ctx.slots, :, ctx.positions] = value[:, :, 0]
        out = torch.ops.tessera.decode_attention(query, k_cache, v_cache, ctx.slots, ctx.positions, scale,
                                                 window, s_aux)
    return out, None


# ---------------------------------------------------------------------------------------------------
# MoE experts: one grouped GEMM per projection, with static shapes on every device


def tessera_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """Experts forward as two grouped GEMMs over tokens sorted by expert (no data-dependent shapes)."""
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.shape
    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    x = hidden_states[perm // num_top_k]
    weights_g = sample_weights[perm]
    counts = torch.histc(expert_ids_g.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)

    def grouped_linear(inp, weight, bias):
        w = weight if self.is_transposed else weight.transpose(-2, -1)
        out = torch._grouped_mm(inp.to(w.dtype), w, offs=offsets)
        if bias is not None:
            out = out + bias[expert_ids_g]
        return out

    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    h = grouped_linear(x, up, up_bias)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    h = grouped_linear(h, self.down_proj, self.down_proj_bias if self.has_bias else None)
    h = h * weights_g.unsqueeze(-1)
    inv_perm = torch.argsort(perm)
    out = h[inv_perm].view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return out.to(hidden_states.dtype)


def register_hf_hooks() -> None:
    """Register Tessera's attention and experts implementations with transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register("tessera", tessera_attention)
    ExpertsInterface.register("tessera", tessera_experts)
