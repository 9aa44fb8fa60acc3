"""RMSNorm and the residual-carrying add + RMSNorm of decoder layers.

`tessera::rms_norm` is one normalisation kernel; `tessera::add_rms_norm` is vLLM's
``fused_add_rms_norm``: the residual add and the norm of its sum in one kernel, returning both the
normalised activations and the new residual. The bodies reproduce Hugging Face's RMSNorm bit for bit:
the variance in fp32, then either ``weight * h.to(input_dtype)`` (Llama, Mistral, Qwen2, Qwen3-MoE,
Qwen2.5-VL) or, with ``fp32_scale``, ``(weight * h).to(input_dtype)`` (GPT-oss). The residual sum is
taken in the model dtype, as the eager ``residual + hidden_states`` does.
"""

from __future__ import annotations

import math

import torch

from tessera.graph.opclass import register_fused
from tessera.kernels.bodies import custom_op


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_scale: bool) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if fp32_scale:
        return (weight * h).to(dtype)
    return weight * h.to(dtype)


@custom_op("tessera::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_scale: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension. x [..,H], weight [H] -> [..,H]."""
    return _rms(x, weight, eps, fp32_scale)


@rms_norm.register_fake
def _(x, weight, eps, fp32_scale=False):
    return torch.empty(x.shape, dtype=torch.result_type(weight, x) if not fp32_scale else x.dtype,
                       device=x.device)


@custom_op("tessera::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 fp32_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """summed = x + residual; (RMSNorm(summed), summed). x, residual [..,H], weight [H]."""
    summed = residual + x
    return _rms(summed, weight, eps, fp32_scale), summed


@add_rms_norm.register_fake
def _(x, residual, weight, eps, fp32_scale=False):
    summed = torch.empty(x.shape, dtype=torch.result_type(residual, x), device=x.device)
    normed = torch.empty(x.shape, dtype=torch.result_type(weight, summed) if not fp32_scale else summed.dtype,
                         device=x.device)
    return normed, summed


def _norm_flops(args, kwargs, out) -> int:
    return 4 * math.prod(args[0].shape)  # square, mean, scale, weight


def _add_norm_flops(args, kwargs, out) -> int:
    return 5 * math.prod(args[0].shape)  # + the residual add


register_fused("rms_norm", "norm", flops=_norm_flops)
register_fused("add_rms_norm", "norm", flops=_add_norm_flops)
