"""Mamba2 (mamba-codestral) as vLLM's MambaMixer2 runs it: a few fused kernels per layer over engine state.

Per layer, decode: residual add + RMSNorm (`tessera::mamba_add_rms_norm`), in_proj GEMM (z | xBC | dt),
`causal_conv1d_update`, `selective_state_update`, `gated_rms_norm`, out_proj GEMM: 6 kernels. Prefill:
add + RMSNorm, in_proj, `causal_conv1d`, the five SSD kernels (`ssd_chunk_cumsum`, `ssd_chunk_state`,
`ssd_state_passing`, which writes the final SSM state into the row's slot, `ssd_bmm_chunk`,
`ssd_chunk_scan`), `gated_rms_norm`, out_proj: 10 kernels (vLLM: ~12, with an initial-state gather
for a continued chunked prefill and a separate scatter of the final states, which here is part of
`ssd_state_passing`).

The residual stream is carried as vLLM carries it: a block returns (mixer output, residual) and the next
block's norm adds them (the first block's norm only copies the embeddings into the residual; the final
norm adds the last block's output). Hugging Face's residual_in_fp32 keeps the residual in float32.

The conv and SSM states are the step's engine-owned tensors (`cache.layer{i}.conv` / `.ssm`, see
`tessera.capture.families.ssm`); the decode kernels update the rows ``slots`` selects in place, the
prefill kernels write them. Parameter names and module calls are Hugging Face's.
"""

from __future__ import annotations

import types

import torch
from torch import nn

import tessera.kernels  # noqa: F401  (registers the tessera:: ops)
from tessera.capture.production import FusionReport

FUSED_UNITS = ["mamba_add_rms_norm", "causal_conv1d_update", "selective_state_update", "causal_conv1d",
               "ssd_chunk_cumsum", "ssd_chunk_state", "ssd_state_passing", "ssd_bmm_chunk", "ssd_chunk_scan",
               "gated_rms_norm"]

_ops = torch.ops.tessera


def _lm_forward(self, input_ids: torch.Tensor | None = None, cache=None, logits_to_keep: int = 0, **_kwargs):
    from transformers.models.mamba2.modeling_mamba2 import Mamba2CausalLMOutput

    hidden = self.backbone(input_ids, cache=cache, logits_to_keep=logits_to_keep).last_hidden_state
    logits = self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()
    return Mamba2CausalLMOutput(logits=logits)


def _backbone_forward(self, input_ids: torch.Tensor | None = None, cache=None, logits_to_keep: int = 0,
                      **_kwargs):
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Output

    hidden, residual = self.embeddings(input_ids), None
    for block in self.layers:
        hidden, residual = block(hidden, residual, cache=cache)
    if logits_to_keep:  # only the kept positions reach the final norm and the LM head
        hidden, residual = hidden[:, -logits_to_keep:], residual[:, -logits_to_keep:]
    hidden = self.norm_f(hidden, residual, cast_input=False)
    return Mamba2Output(last_hidden_state=hidden)


def _block_forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None, cache=None,
                   **_kwargs):
    normed, residual = self.norm(hidden_states, residual, return_residual=True)
    return self.mixer(normed, cache=cache), residual


def _norm_forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None,
                  cast_input: bool = True, return_residual: bool = False, *, residual_fp32: bool):
    normed, residual = _ops.mamba_add_rms_norm(hidden_states, residual, self.weight, self.variance_epsilon,
                                               residual_fp32, cast_input)
    return (normed, residual) if return_residual else normed


def _gated_norm_forward(self, hidden_states: torch.Tensor, gate: torch.Tensor):
    return _ops.gated_rms_norm(hidden_states, gate, self.weight, self.group_size, self.variance_epsilon)


def _mixer_forward(self, hidden_states: torch.Tensor, cache=None, **_kwargs):
    b, s, _ = hidden_states.shape
    inner, conv_dim, heads = self.intermediate_size, self.conv_dim, self.num_heads
    gn = self.n_groups * self.ssm_state_size
    if cache is None or not hasattr(cache, "state"):
        raise RuntimeError("the production Mamba2 mixer runs inside a Tessera step: it needs the step's slot cache "
                           "(engine-owned conv / SSM state, see tessera.capture.families.ssm)")
    conv_state = cache.state[f"cache.layer{self.layer_idx}.conv"]
    ssm_state = cache.state[f"cache.layer{self.layer_idx}.ssm"]
    slots = cache.slots
    weight = self.conv1d.weight.squeeze(1)
    silu = self.activation in ("silu", "swish")
    if not silu and self.activation not in (None, "identity"):
        raise NotImplementedError(f"Mamba2 conv activation {self.activation!r}: the fused conv supports SiLU only")
    zxbcdt = self.in_proj(hidden_states)  # [B, S, inner + conv_dim + heads]
    z, xbc, dt = zxbcdt[..., :inner], zxbcdt[..., inner:inner + conv_dim], zxbcdt[..., inner + conv_dim:]
    if cache.phase == "decode":
        xbc = _ops.causal_conv1d_update(xbc[:, 0], conv_state, slots, weight, self.conv1d.bias, silu)
        y = _ops.selective_state_update(ssm_state, xbc[:, :inner], dt[:, 0], self.A_log, xbc[:, inner:inner + gn],
                                        xbc[:, inner + gn:], self.D, self.dt_bias, slots)
        y = self.norm(y, z[:, 0])
        return self.out_proj(y).unsqueeze(1)
    chunk = self.chunk_size
    xbc = _ops.causal_conv1d(xbc, weight, self.conv1d.bias, conv_state, slots, silu, chunk)  # [B, S', conv_dim]
    nc = xbc.shape[1] // chunk
    x = xbc[..., :inner].view(b, nc, chunk, heads, self.head_dim)
    B = xbc[..., inner:inner + gn].view(b, nc, chunk, self.n_groups, self.ssm_state_size)
    C = xbc[..., inner + gn:].view(b, nc, chunk, self.n_groups, self.ssm_state_size)
    dt_min, dt_max = (float(v) for v in self.time_step_limit)
    dt, dA_cumsum = _ops.ssd_chunk_cumsum(dt, self.dt_bias, self.A_log, chunk, dt_min, dt_max)
    states = _ops.ssd_chunk_state(B, x, dt, dA_cumsum)
    states = _ops.ssd_state_passing(states, dA_cumsum, ssm_state, slots)
    CB = _ops.ssd_bmm_chunk(C, B)
    y = _ops.ssd_chunk_scan(x, CB, dt, dA_cumsum, C, states, self.D)  # [B, nc, L, H, P]
    y = self.norm(y.view(b, nc * chunk, inner)[:, :s], z)
    return self.out_proj(y)


def apply(model: nn.Module) -> FusionReport:
    """Rewire a Hugging Face ``Mamba2ForCausalLM`` in place for the production graph."""
    from transformers.models.mamba2.modeling_mamba2 import (
        Mamba2Block,
        Mamba2Mixer,
        Mamba2Model,
        Mamba2RMSNorm,
        MambaRMSNormGated,
    )

    residual_fp32 = bool(getattr(model.config, "residual_in_fp32", True))
    model.forward = types.MethodType(_lm_forward, model)
    for mod in model.modules():
        if isinstance(mod, Mamba2Model):
            mod.forward = types.MethodType(_backbone_forward, mod)
        elif isinstance(mod, Mamba2Block):
            mod.forward = types.MethodType(_block_forward, mod)
        elif isinstance(mod, Mamba2RMSNorm):
            mod.forward = types.MethodType(lambda self, *a, **k: _norm_forward(self, *a, residual_fp32=residual_fp32,
                                                                               **k), mod)
        elif isinstance(mod, MambaRMSNormGated):
            mod.forward = types.MethodType(_gated_norm_forward, mod)
        elif isinstance(mod, Mamba2Mixer):
            mod.forward = types.MethodType(_mixer_forward, mod)
    return FusionReport("production", fused=list(FUSED_UNITS))
