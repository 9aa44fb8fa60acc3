"""The MoE block of a layer as a serving engine's separate kernels, and gpt-oss's native MXFP4 experts.

`moe_forward(mlp, hidden)` runs a gpt-oss (``GptOssMLP``: ``router`` + ``experts``) or Qwen3-MoE
(``Qwen3MoeSparseMoeBlock``: ``gate`` + ``experts``) block as vLLM's fused-MoE pipeline does, seven
kernels in all (`tessera.kernels.moe`):

    router GEMM (F.linear, + bias for gpt-oss)      } in the router's scope (``...mlp.router`` / ``...mlp.gate``)
    tessera::topk_gating                            }
    tessera::moe_align                              } in the experts' scope (``...mlp.experts``)
    tessera::moe_gemm | moe_mxfp4_gemm (gate/up)    }
    tessera::swigluoai_and_mul | silu_and_mul       }
    tessera::moe_gemm | moe_mxfp4_gemm (down)       }
    tessera::moe_sum                                }

It calls the router and the experts as modules, so a trace attributes each kernel to its module scope
(`prepare_moe` rewires those two modules' forwards, instance by instance, parameter names unchanged; it
runs on first use). A caller that replaces ``mlp.forward`` itself (the production decoder) calls
``moe_forward(mlp, hidden.reshape(-1, H))`` from it; `apply_moe(mlp)` instead makes ``mlp(hidden)``, as
Hugging Face's decoder layer calls it, run the same kernels and return what Hugging Face's block returns.

MXFP4: `Mxfp4Experts` holds gpt-oss experts in the checkpoint's packed format (``gate_up_proj_blocks``
uint8 [E, 2I, H/32, 16], ``gate_up_proj_scales`` uint8 [E, 2I, H/32], ``down_proj_blocks`` [E, H, I/32, 16],
``down_proj_scales`` [E, H, I/32], biases in the model dtype), `to_mxfp4_experts` quantises bf16
``GptOssExperts`` to it (on `meta`: shapes only) and `apply_mxfp4(model)` swaps every layer's experts, so
the weights a model holds are the packed bytes (gpt-oss-20b: ~10.2 GB of experts instead of ~39 GB).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

import tessera.kernels  # noqa: F401  (registers the tessera:: ops)
from tessera.kernels.mxfp4 import dequantize_weight, quantize_weight

# gpt-oss's SwiGLU constants (Hugging Face's GptOssExperts: alpha from the config, limit 7)
DEFAULT_ALPHA = 1.702
DEFAULT_LIMIT = 7.0


class Mxfp4Experts(nn.Module):
    """gpt-oss experts in MXFP4, laid out and named as in the openai/gpt-oss checkpoints.

    Its forward has Hugging Face's experts interface (hidden [T,H], top-k expert ids [T,k], top-k
    weights [T,k]) and runs the MoE kernels on the packed weights.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 alpha: float = DEFAULT_ALPHA, limit: float = DEFAULT_LIMIT, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.alpha, self.limit = alpha, limit
        e, h, i = num_experts, hidden_size, intermediate_size

        def packed(*shape, dt=torch.uint8):
            return nn.Parameter(torch.zeros(*shape, dtype=dt, device=device), requires_grad=False)

        self.gate_up_proj_blocks = packed(e, 2 * i, h // 32, 16)
        self.gate_up_proj_scales = packed(e, 2 * i, h // 32)
        self.gate_up_proj_bias = packed(e, 2 * i, dt=dtype)
        self.down_proj_blocks = packed(e, h, i // 32, 16)
        self.down_proj_scales = packed(e, h, i // 32)
        self.down_proj_bias = packed(e, h, dt=dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return experts_forward(self, hidden_states, top_k_index, top_k_weights)

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        """The bf16 weights the packed ones stand for: gate_up [E,H,2I] and down [E,I,H] (HF's layout)."""
        return (dequantize_weight(self.gate_up_proj_blocks, self.gate_up_proj_scales, dtype),
                dequantize_weight(self.down_proj_blocks, self.down_proj_scales, dtype))

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, mxfp4"


def to_mxfp4_experts(experts: nn.Module) -> Mxfp4Experts:
    """Quantise a bf16 ``GptOssExperts`` (gate_up_proj [E,H,2I], down_proj [E,I,H], biases) to MXFP4
    (OCP MX: nearest e2m1, one power-of-two scale per 32 values along the depth). On `meta`, shapes only."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    e, h, two_i = gate_up.shape
    device = gate_up.device
    out = Mxfp4Experts(e, h, two_i // 2, alpha=float(getattr(experts, "alpha", DEFAULT_ALPHA)),
                       limit=float(getattr(experts, "limit", DEFAULT_LIMIT)),
                       dtype=experts.gate_up_proj_bias.dtype, device=device)
    if device.type != "meta":
        with torch.no_grad():
            for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
                blocks, scales = quantize_weight(w.detach())
                getattr(out, f"{name}_blocks").copy_(blocks)
                getattr(out, f"{name}_scales").copy_(scales)
                getattr(out, f"{name}_bias").copy_(getattr(experts, f"{name}_bias").detach())
    return out


def _decoder_layers(model: nn.Module):
    inner = getattr(model, "model", model)
    inner = getattr(inner, "language_model", inner)
    return list(getattr(inner, "layers", []))


def apply_mxfp4(model: nn.Module) -> int:
    """Replace every layer's bf16 gpt-oss experts (``mlp.experts``) by their MXFP4 version; returns how
    many were replaced. Parameter names become the checkpoint's (``model.layers.i.mlp.experts.gate_up_proj_blocks``...)."""
    count = 0
    for layer in _decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        if experts is not None and hasattr(experts, "gate_up_proj") and hasattr(experts, "gate_up_proj_bias"):
            mlp.experts = to_mxfp4_experts(experts)
            count += 1
    return count


# ---------------------------------------------------------------------------------------------------
# The kernels of one block


def _router_module(mlp: nn.Module) -> nn.Module:
    router = getattr(mlp, "router", None)
    return router if router is not None else mlp.gate


def router_forward(router: nn.Module, hidden_states: torch.Tensor):
    """Router GEMM then `tessera::topk_gating`: (logits [T,E], top-k weights [T,k], expert ids [T,k])."""
    hidden_states = hidden_states.reshape(-1, router.weight.shape[1])
    logits = F.linear(hidden_states, router.weight, getattr(router, "bias", None))
    if hasattr(router, "norm_topk_prob"):  # Qwen3-MoE: softmax, top-k, renormalise
        weights, ids = torch.ops.tessera.topk_gating(logits, router.top_k, True, bool(router.norm_topk_prob))
    else:  # gpt-oss: top-k of the logits, softmax over them
        weights, ids = torch.ops.tessera.topk_gating(logits, router.top_k, False, False)
    return logits, weights, ids


def experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """`tessera::moe_align`, the two grouped GEMMs around the activation, `tessera::moe_sum`. -> [T,H]."""
    ops = torch.ops.tessera
    top_k = top_k_index.shape[-1]
    perm, offsets = ops.moe_align(top_k_index, experts.num_experts)
    if isinstance(experts, Mxfp4Experts):
        h = ops.moe_mxfp4_gemm(hidden_states, experts.gate_up_proj_blocks, experts.gate_up_proj_scales, offsets,
                               perm, experts.gate_up_proj_bias, top_k)
        h = ops.swigluoai_and_mul(h, experts.alpha, experts.limit)
        h = ops.moe_mxfp4_gemm(h, experts.down_proj_blocks, experts.down_proj_scales, offsets, None,
                               experts.down_proj_bias, top_k)
    elif hasattr(experts, "gate_up_proj_bias"):  # GptOssExperts: [E,H,2I] interleaved gate/up, biases
        h = ops.moe_gemm(hidden_states, experts.gate_up_proj, offsets, perm, experts.gate_up_proj_bias, top_k, True)
        h = ops.swigluoai_and_mul(h, float(experts.alpha), float(experts.limit))
        h = ops.moe_gemm(h, experts.down_proj, offsets, None, experts.down_proj_bias, top_k, True)
    else:  # Qwen3MoeExperts: [E,2I,H] concatenated gate | up, no biases
        h = ops.moe_gemm(hidden_states, experts.gate_up_proj, offsets, perm, None, top_k, False)
        h = torch.ops.tessera.silu_and_mul(h)
        h = ops.moe_gemm(h, experts.down_proj, offsets, None, None, top_k, False)
    return ops.moe_sum(h, perm, top_k_weights)


def moe_forward(mlp: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The MoE block of one layer on hidden [T,H] -> [T,H], as seven kernels in the router's and the
    experts' module scopes. On first use it rewires the router's and the experts' forwards
    (`prepare_moe`); ``mlp``'s own forward is left to the caller (see `apply_moe`)."""
    prepare_moe(mlp)
    _, weights, ids = _router_module(mlp)(hidden)
    return mlp.experts(hidden, ids, weights)


def _mlp_forward(mlp: nn.Module, hidden_states: torch.Tensor):
    """Hugging Face's block forward, on the MoE kernels: gpt-oss returns (out, router scores), Qwen3-MoE out."""
    shape = hidden_states.shape
    flat = hidden_states.reshape(-1, shape[-1])
    _, weights, ids = _router_module(mlp)(flat)
    out = mlp.experts(flat, ids, weights).reshape(shape)
    return (out, weights) if hasattr(mlp, "router") else out


def prepare_moe(mlp: nn.Module) -> nn.Module:
    """Rewire a block's router (router GEMM + `tessera::topk_gating`) and experts (the MoE kernels) in
    place (idempotent; parameters and names unchanged). Experts swapped later by `apply_mxfp4` run their
    own forward, the same kernels on MXFP4 weights."""
    router = _router_module(mlp)
    if not getattr(router, "_tessera_moe", False):
        router.forward = types.MethodType(router_forward, router)
        router._tessera_moe = True
    experts = mlp.experts
    if not isinstance(experts, Mxfp4Experts) and not getattr(experts, "_tessera_moe", False):
        experts.forward = types.MethodType(experts_forward, experts)
        experts._tessera_moe = True
    return mlp


def apply_moe(mlp: nn.Module) -> nn.Module:
    """`prepare_moe`, and ``mlp(hidden [B,S,H])`` itself runs the MoE kernels, returning what Hugging Face's
    block returns (gpt-oss: (hidden, router scores); Qwen3-MoE: hidden). Idempotent."""
    prepare_moe(mlp)
    if not getattr(mlp, "_tessera_moe", False):
        mlp.forward = types.MethodType(_mlp_forward, mlp)
        mlp._tessera_moe = True
    return mlp


def is_moe_block(mlp: nn.Module) -> bool:
    """Whether ``mlp`` is a MoE block this module runs (gpt-oss's or Qwen3-MoE's)."""
    return hasattr(mlp, "experts") and (hasattr(mlp, "router") or hasattr(mlp, "gate"))
