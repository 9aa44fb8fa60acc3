"""Hooks that route Hugging Face models through Tessera's kernels and engine-owned state.

The attention-interface function writes K/V into the engine cache of the current step and calls the
fused attention kernels of :mod:`tessera.kernels`; the experts function runs MoE experts as grouped
GEMMs with static shapes.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch

import tessera.kernels  # noqa: F401  (registers the tessera:: ops)

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
