"""Gated activations of an MLP's merged gate/up projection: [.., 2F] -> [.., F] in one kernel.

`tessera::silu_and_mul` (vLLM ``SiluAndMul``) and `tessera::gelu_tanh_and_mul` (``GeluAndMul``
approximate="tanh"); the gate is the first half. The bodies are ``act(gate) * up`` in the input dtype,
exactly Hugging Face's ``act_fn(gate_proj(x)) * up_proj(x)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tessera.graph.opclass import register_fused
from tessera.kernels.bodies import custom_op


@custom_op("tessera::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..,:F]) * x[..,F:] -> [..,F]."""
    f = x.shape[-1] // 2
    return F.silu(x[..., :f]) * x[..., f:]


@silu_and_mul.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@custom_op("tessera::gelu_tanh_and_mul", mutates_args=())
def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x[..,:F]) * x[..,F:] -> [..,F]."""
    f = x.shape[-1] // 2
    return F.gelu(x[..., :f], approximate="tanh") * x[..., f:]


@gelu_tanh_and_mul.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


def _act_flops(per_element: int):
    def flops(args, kwargs, out) -> int:
        return per_element * math.prod(args[0].shape) // 2
    return flops


register_fused("silu_and_mul", "elementwise", flops=_act_flops(5))
register_fused("gelu_tanh_and_mul", "elementwise", flops=_act_flops(9))
