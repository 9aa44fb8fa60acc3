"""Merged projections: several weight matrices that read the same input, run as one GEMM.

`tessera::merged_linear` is vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``: the Q, K and V
projections (or an MLP's gate and up projections) of one layer as a single GEMM whose output is the
concatenation of theirs. The Hugging Face weights stay separate parameters (their state-dict names are
unchanged); the op reads them all. Its body runs each projection and concatenates, so its numbers are
exactly those of the separate projections.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tessera.graph.opclass import register_fused
from tessera.kernels.bodies import custom_op


@custom_op("tessera::merged_linear", mutates_args=())
def merged_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """x [..,K] @ cat(weights [N_i,K]).T (+ cat(biases [N_i])) -> [.., sum N_i], one GEMM.

    ``biases`` is empty (no bias) or one bias per weight (torch.library schemas have no optional lists).
    """
    if not biases:
        parts = [F.linear(x, w) for w in weights]
    else:
        parts = [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    return torch.cat(parts, dim=-1)


@merged_linear.register_fake
def _(x, weights, biases):
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))


def _merged_flops(args, kwargs, out) -> int:
    x, weights = args[0], args[1]
    biases = args[2] if len(args) > 2 else kwargs.get("biases")
    rows, k = math.prod(x.shape[:-1]), x.shape[-1]
    n = sum(w.shape[0] for w in weights)
    return 2 * rows * k * n + (rows * n if biases else 0)


register_fused("merged_linear", "gemm", flops=_merged_flops)
