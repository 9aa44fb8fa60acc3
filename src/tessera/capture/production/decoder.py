"""Production graph of decoder-only LLMs (Llama, Mistral, Qwen2, SmolLM2; GPT-oss and Qwen3-MoE attention;
the Qwen2.5-VL text decoder): the fused units a vLLM-style engine launches per layer.

Per layer, as vLLM runs it with its residual carry (a layer receives ``(hidden, residual)``)::

    [add+]RMSNorm -> QKV GEMM -> RoPE (in place on q,k) -> KV write -> attention -> o_proj
    -> add+RMSNorm -> MLP

Layer 0 runs `tessera::rms_norm` (its residual is the embedding), later layers and the final norm
`tessera::add_rms_norm`. The QKV projection is one `tessera::merged_linear` over the separate Hugging
Face weights (names unchanged); q, k and v are strided views of its output (``[B,H,S,D]`` after a
transpose, no copies), `tessera::rotary_` / `tessera::mrope_` rotate q and k in place, `tessera::kv_write`
stores K and V in the engine cache, `tessera::prefill_attention` / `tessera::decode_attention` attend
(GPT-oss: sinks and sliding windows). A dense MLP is the merged gate/up GEMM, `tessera::silu_and_mul`
(or `gelu_tanh_and_mul`) and the down GEMM: 10 kernels per Llama layer. A MoE MLP runs
`tessera.capture.production.moe.moe_forward` (router GEMM, top-k gating, alignment, two grouped GEMMs
with the activation between, weighted sum); GPT-oss's experts are held in MXFP4, its deployed format
(`apply_mxfp4`). Embedding and LM head stay one kernel each; Hugging Face's CausalLM
forward (``logits_to_keep`` slice, ``lm_head``, weight tying) is kept.

Forwards are replaced per module instance and module calls are kept (``layer(...)``,
``layer.self_attn(...)``, ``layer.mlp(...)``), so kernels land in the same scopes as in the eager graph.
The step context (`tessera.capture.ops.current_step`) gives the phase, slots, decode cache positions and
the caches; rotary positions are the ``position_ids`` the step passes (decode: ``[B,1]``; prefill: None =
0..S-1; Qwen2.5-VL: ``[3,B,S]``).
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

from tessera.capture.ops import current_step
from tessera.capture.production import FusionReport
from tessera.capture.production.moe import apply_mxfp4, moe_forward

ops = torch.ops.tessera

# RMSNorm classes whose forward is ``weight * h.to(dtype)`` (False) or ``(weight * h).to(dtype)`` (True)
_NORMS = {"LlamaRMSNorm": False, "MistralRMSNorm": False, "Qwen2RMSNorm": False, "Qwen3MoeRMSNorm": False,
          "Qwen2_5_VLRMSNorm": False, "GptOssRMSNorm": True}
_ROTARIES = {"LlamaRotaryEmbedding", "MistralRotaryEmbedding", "Qwen2RotaryEmbedding", "GptOssRotaryEmbedding",
             "Qwen3MoeRotaryEmbedding"}
_MROPE_ROTARIES = {"Qwen2_5_VLRotaryEmbedding"}
_DYNAMIC_ROPE = ("dynamic", "longrope")  # inv_freq updated per forward by HF's dynamic_rope_update
_MOE_MLPS = {"GptOssMLP", "Qwen3MoeSparseMoeBlock"}
_ACTS = {"silu": "silu_and_mul", "swish": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}
_MOE_OUTPUT_TYPES = ("gpt_oss", "qwen3_moe")


class _Unsupported(Exception):
    """A part of the model the production decoder has no fused units for (the message says which)."""


# ---------------------------------------------------------------------------------------------------
# Forwards


def _norm_args(norm: nn.Module) -> tuple[torch.Tensor, float, bool]:
    return norm.weight, float(norm.variance_epsilon), _NORMS[type(norm).__name__]


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight, eps, fp32 = _norm_args(norm)
    return ops.rms_norm(x, weight, eps, fp32)


def _add_rms_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weight, eps, fp32 = _norm_args(norm)
    return ops.add_rms_norm(x, residual, weight, eps, fp32)


def _biases(*linears: nn.Linear) -> list[torch.Tensor]:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return []
    return biases


def _attention_forward(self, hidden: torch.Tensor, positions: torch.Tensor | None, *, rotary: nn.Module,
                       rope: str, window: int) -> torch.Tensor:
    """QKV GEMM, q/k norms (Qwen3-MoE), RoPE in place, KV write, attention, o_proj. hidden [B,S,H]."""
    b, s, _ = hidden.shape
    d = self.head_dim
    qd, kd = self.q_proj.out_features, self.k_proj.out_features
    qkv = ops.merged_linear(hidden, [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight],
                            _biases(self.q_proj, self.k_proj, self.v_proj))
    q = qkv[..., :qd].view(b, s, qd // d, d)
    k = qkv[..., qd:qd + kd].view(b, s, kd // d, d)
    v = qkv[..., qd + kd:].view(b, s, kd // d, d).transpose(1, 2)
    if hasattr(self, "q_norm"):
        q, k = _rms_norm(self.q_norm, q), _rms_norm(self.k_norm, k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    scaling = float(rotary.attention_scaling)
    if rope == "mrope":
        ops.mrope_(q, k, positions, rotary.inv_freq, list(rotary.mrope_section), scaling)
    else:
        ops.rotary_(q, k, positions, rotary.inv_freq, scaling)
    ctx = current_step()
    k_cache, v_cache = ctx.kv[self.layer_idx]
    sinks = getattr(self, "sinks", None)
    if ctx.phase == "prefill":
        ops.kv_write(k, v, k_cache, v_cache, ctx.slots, None)
        out = ops.prefill_attention(q, k, v, float(self.scaling), window, sinks)
    else:
        ops.kv_write(k, v, k_cache, v_cache, ctx.slots, ctx.positions)
        out = ops.decode_attention(q, k_cache, v_cache, ctx.slots, ctx.positions, float(self.scaling), window,
                                   sinks)
    return self.o_proj(out.view(b, s, -1))


def _dense_mlp_forward(self, x: torch.Tensor, *, act: str) -> torch.Tensor:
    """Merged gate/up GEMM, gated activation, down GEMM."""
    gate_up = ops.merged_linear(x, [self.gate_proj.weight, self.up_proj.weight],
                                _biases(self.gate_proj, self.up_proj))
    return self.down_proj(getattr(ops, act)(gate_up))


def _moe_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    return moe_forward(self, x.reshape(-1, shape[-1])).view(shape)


def _layer_forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, residual) -> (mlp output, residual): vLLM's residual carry."""
    if residual is None:
        residual = hidden
        x = _rms_norm(self.input_layernorm, hidden)
    else:
        x, residual = _add_rms_norm(self.input_layernorm, hidden, residual)
    x = self.self_attn(x, positions)
    x, residual = _add_rms_norm(self.post_attention_layernorm, x, residual)
    out = self.mlp(x)
    if isinstance(out, tuple):  # Hugging Face's GPT-oss MoE block returns (hidden, router scores)
        out = out[0]
    return out, residual


def _rope_positions(position_ids: torch.Tensor | None, rope: str, embeds: torch.Tensor) -> torch.Tensor | None:
    if rope != "mrope":
        return position_ids
    b, s = embeds.shape[:2]
    if position_ids is None:
        return torch.arange(s, device=embeds.device).view(1, 1, s).expand(3, b, s)
    if position_ids.ndim == 2:
        return position_ids[None].expand(3, *position_ids.shape)
    if position_ids.shape[0] == 4:  # text positions first (HF's layout for some callers)
        return position_ids[1:]
    return position_ids


def _model_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                   use_cache=None, *, rope: str, output_type, **kwargs):
    """Embed, the layers carrying the residual, the final add+RMSNorm."""
    hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    positions = _rope_positions(position_ids, rope, hidden)
    residual = None
    for layer in self.layers[: self.config.num_hidden_layers]:
        hidden, residual = layer(hidden, residual, positions)
    hidden, _ = _add_rms_norm(self.norm, hidden, residual)
    return output_type(last_hidden_state=hidden)


# ---------------------------------------------------------------------------------------------------
# Rewiring


def _window_of(attn: nn.Module) -> int:
    if hasattr(attn, "sliding_window"):
        return int(attn.sliding_window or 0)
    return int(getattr(attn.config, "sliding_window", None) or 0)  # Mistral reads it from the config


def _check(text_model: nn.Module, rope: str) -> None:
    """Raise _Unsupported for a configuration the fused forwards would not reproduce."""
    rotary = text_model.rotary_emb
    known = _MROPE_ROTARIES if rope == "mrope" else _ROTARIES
    if type(rotary).__name__ not in known:
        raise _Unsupported(f"rotary embedding {type(rotary).__name__} with rope={rope!r}")
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if any(t in rope_type for t in _DYNAMIC_ROPE):
        raise _Unsupported(f"rope type {rope_type!r} (frequencies updated per forward)")
    for norm in [text_model.norm] + [n for layer in text_model.layers
                                     for n in (layer.input_layernorm, layer.post_attention_layernorm)]:
        if type(norm).__name__ not in _NORMS:
            raise _Unsupported(f"norm class {type(norm).__name__}")
    for layer in text_model.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(attn, name, None), nn.Linear):
                raise _Unsupported(f"attention {type(attn).__name__} without a plain {name}")
        for name in ("q_norm", "k_norm"):
            if hasattr(attn, name) and type(getattr(attn, name)).__name__ not in _NORMS:
                raise _Unsupported(f"{name} class {type(getattr(attn, name)).__name__}")


def apply_text_decoder(text_model: nn.Module, rope: str = "rope", output_type=None) -> FusionReport:
    """Rewire a decoder stack (``LlamaModel`` and kin, or Qwen2.5-VL's ``language_model`` with
    ``rope="mrope"``) in place; returns what is fused and what fell back. Nothing is changed when the
    configuration is unsupported (the report's fallback says why)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    try:
        _check(text_model, rope)
    except _Unsupported as e:
        return FusionReport("production", fallbacks=[f"{type(text_model).__name__}: {e}; the Hugging Face eager "
                                                     "forward is traced op by op"])
    report = FusionReport("production")
    dense = moe = 0
    for layer in text_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.forward = types.MethodType(functools.partial(_attention_forward, rotary=text_model.rotary_emb,
                                                          rope=rope, window=_window_of(attn)), attn)
        kind = type(mlp).__name__
        if kind in _MOE_MLPS:
            moe += 1
            mlp.forward = types.MethodType(_moe_mlp_forward, mlp)
        elif all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
            act = _ACTS.get(str(getattr(mlp.config, "hidden_act", "")))
            if act is None:
                report.fallbacks.append(f"layer {attn.layer_idx} mlp: activation {mlp.config.hidden_act!r} has "
                                        "no fused gated unit (Hugging Face forward)")
            else:
                mlp.forward = types.MethodType(functools.partial(_dense_mlp_forward, act=act), mlp)
                dense += 1
        else:
            report.fallbacks.append(f"layer {attn.layer_idx} mlp: {kind} has no fused units (Hugging Face forward)")
        layer.forward = types.MethodType(_layer_forward, layer)
    text_model.forward = types.MethodType(
        functools.partial(_model_forward, rope=rope, output_type=output_type or BaseModelOutputWithPast),
        text_model)
    n = len(text_model.layers)
    report.fused += [f"rms_norm/add_rms_norm residual carry ({n} layers + final norm)",
                     f"merged QKV GEMM ({n} layers)",
                     f"{'mrope_' if rope == 'mrope' else 'rotary_'} in place on q,k ({n} layers)",
                     f"kv_write + prefill/decode attention ({n} layers)"]
    if dense:
        report.fused.append(f"merged gate_up GEMM + gated activation ({dense} dense MLPs)")
    if moe:
        report.fused.append(f"MoE pipeline: router GEMM, top-k gating, alignment, grouped GEMMs, activation, "
                            f"weighted sum ({moe} MoE MLPs)")
    return report


def apply(model: nn.Module) -> FusionReport:
    """Rewire a transformers causal LM (``model.model`` is its decoder stack) for the production graph."""
    from transformers.modeling_outputs import BaseModelOutputWithPast, MoeModelOutputWithPast

    model_type = str(getattr(model.config, "model_type", ""))
    output_type = MoeModelOutputWithPast if model_type in _MOE_OUTPUT_TYPES else BaseModelOutputWithPast
    report = apply_text_decoder(model.model, rope="rope", output_type=output_type)
    if model_type == "gpt_oss" and not report.fallbacks:
        # GPT-oss is published and served with MXFP4 experts: its production graph holds them in that format.
        layers = apply_mxfp4(model)
        report.fused.append(f"MXFP4 experts, the deployed format ({layers} layers)")
    return report
