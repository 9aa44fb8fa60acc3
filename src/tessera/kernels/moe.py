"""Mixture-of-experts kernels, as a serving engine launches them (vLLM's fused-MoE pipeline).

One MoE block is: the router GEMM (a plain linear, not here), `tessera::topk_gating` (the k experts
of each token and their weights), `tessera::moe_align` (the token-expert assignments sorted by
expert: a permutation and per-expert offsets, static shapes), a first grouped expert GEMM
(`tessera::moe_gemm` on bf16 weights, `tessera::moe_mxfp4_gemm` on MXFP4 weights) that gathers its
rows through the permutation, the activation (`tessera::swigluoai_and_mul` for gpt-oss,
`tessera::silu_and_mul` for Qwen3-MoE), the second grouped GEMM (no gather: its rows are already
sorted) and `tessera::moe_sum` (weights each row by its top-k weight, un-permutes and sums the k rows
of every token).

Shapes: T tokens, H hidden, E experts, k experts per token, M = T*k assignment rows. Every op's output
shapes follow from its argument shapes, so a trace on `meta` needs no data. The grouped GEMMs take the
expert weight as their SECOND tensor argument (its leading dimension is E), which the cost model reads
to count the experts whose weights a step streams.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.graph.fused_shapes import moe_gemm_dims, moe_mxfp4_gemm_dims
from tessera.graph.opclass import register_fused
from tessera.kernels.bodies import custom_op
from tessera.kernels.mxfp4 import dequantize_weight

# ---------------------------------------------------------------------------------------------------
# Routing


@custom_op("tessera::topk_gating", mutates_args=())
def topk_gating(logits: torch.Tensor, top_k: int, softmax_first: bool,
                renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The k experts of each token and their weights. logits [T,E] -> (weights [T,k] in logits' dtype,
    expert ids [T,k] int64).

    ``softmax_first=False`` (gpt-oss): top-k of the logits, then a softmax over the k values.
    ``softmax_first=True`` (Qwen3-MoE): softmax over all experts in fp32, top-k, then (``renormalize``)
    divide by the sum of the k probabilities.
    """
    if not softmax_first:
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


@topk_gating.register_fake
def _(logits, top_k, softmax_first, renormalize):
    t = logits.shape[0]
    return logits.new_empty(t, top_k), logits.new_empty(t, top_k, dtype=torch.long)


@custom_op("tessera::moe_align", mutates_args=())
def moe_align(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the token-expert assignments by expert. expert_ids [T,k] -> (perm [T*k] int64, offsets [E]
    int32).

    ``perm[r]`` is the flat assignment index (token * k + j) of sorted row r; rows of one expert are
    consecutive, in token order; ``offsets[e]`` is the end row of expert e (inclusive prefix sum of the
    per-expert counts), as ``torch._grouped_mm`` takes them.
    """
    flat = expert_ids.reshape(-1)
    perm = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return perm, torch.cumsum(counts, 0, dtype=torch.int32)


@moe_align.register_fake
def _(expert_ids, num_experts):
    m = expert_ids.numel()
    return (expert_ids.new_empty(m, dtype=torch.long),
            expert_ids.new_empty(num_experts, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------------
# Grouped expert GEMMs


def _grouped(x: torch.Tensor, weight_of, offsets: torch.Tensor, perm: torch.Tensor | None, top_k: int,
             bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """out[r] = x_row(r) @ W[expert(r)] (+ b[expert(r)]), expert by expert; x_row(r) = x[perm[r] // k]
    with a permutation (the first GEMM), x[r] without (the second)."""
    rows = x[torch.div(perm, top_k, rounding_mode="floor")] if perm is not None else x
    out = x.new_empty(rows.shape[0], n)
    ends = offsets.tolist()
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            y = weight_of(e, rows[start:end])
            out[start:end] = y + bias[e] if bias is not None else y
        start = end
    return out


@custom_op("tessera::moe_gemm", mutates_args=())
def moe_gemm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, perm: torch.Tensor | None,
             bias: torch.Tensor | None, top_k: int, transposed: bool) -> torch.Tensor:
    """Grouped GEMM over rows sorted by expert (bf16 weights). -> [M, N].

    x [T,K] with ``perm`` [M] (rows gathered as x[perm // top_k]) or [M,K] already sorted without;
    weight [E,K,N] if ``transposed`` (``x @ W[e]``, gpt-oss) else [E,N,K] (``F.linear``, Qwen3-MoE);
    offsets [E] end rows of each expert (`moe_align`); bias [E,N] or None.
    """
    n = weight.shape[2] if transposed else weight.shape[1]

    def apply(e, rows):
        return rows @ weight[e] if transposed else F.linear(rows, weight[e])

    return _grouped(x, apply, offsets, perm, top_k, bias, n)


@moe_gemm.register_fake
def _(x, weight, offsets, perm, bias, top_k, transposed):
    m = perm.shape[0] if perm is not None else x.shape[0]
    return x.new_empty(m, weight.shape[2] if transposed else weight.shape[1])


@custom_op("tessera::moe_mxfp4_gemm", mutates_args=())
def moe_mxfp4_gemm(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                   perm: torch.Tensor | None, bias: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """Grouped GEMM on MXFP4 weights (gpt-oss's native format). -> [M, N].

    blocks [E,N,K/32,16] and scales [E,N,K/32] (`tessera.kernels.mxfp4`) hold W [E,K,N]; the body
    dequantises them to x's dtype, as Marlin does on Ampere/Ada, and computes ``x_row @ W[e] + b[e]``.
    x, perm, offsets, bias as in `moe_gemm`.
    """
    w = dequantize_weight(blocks, scales, x.dtype)
    return _grouped(x, lambda e, rows: rows @ w[e], offsets, perm, top_k, bias, blocks.shape[1])


@moe_mxfp4_gemm.register_fake
def _(x, blocks, scales, offsets, perm, bias, top_k):
    m = perm.shape[0] if perm is not None else x.shape[0]
    return x.new_empty(m, blocks.shape[1])


# ---------------------------------------------------------------------------------------------------
# Activations and the weighted un-permuting sum


@custom_op("tessera::swigluoai_and_mul", mutates_args=())
def swigluoai_and_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU on INTERLEAVED gate/up columns. x [M, 2I] -> [M, I]:
    gate = x[:, 0::2] clamped above at ``limit``, up = x[:, 1::2] clamped to +-``limit``,
    out = (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = x[..., 0::2], x[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@swigluoai_and_mul.register_fake
def _(x, alpha, limit):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@custom_op("tessera::moe_sum", mutates_args=())
def moe_sum(x: torch.Tensor, perm: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weight the expert rows by their top-k weights, un-permute and sum each token's k rows.

    x [M,H] rows sorted by expert, perm [M] (`moe_align`), weights [T,k] -> [T,H] in x's dtype. A token's
    k rows are added in expert order, in x's dtype (what Hugging Face's expert loop computes).
    """
    t, k = weights.shape
    weighted = x * weights.reshape(-1)[perm].unsqueeze(-1)
    rows = torch.empty_like(perm)
    rows[perm] = torch.arange(perm.shape[0], device=perm.device)  # assignment -> its sorted row
    rows = rows.view(t, k).sort(dim=-1).values  # sorted rows are in expert order
    out = weighted[rows[:, 0]]
    for j in range(1, k):
        out = out + weighted[rows[:, j]]
    return out


@moe_sum.register_fake
def _(x, perm, weights):
    return x.new_empty(weights.shape[0], x.shape[1])


# ---------------------------------------------------------------------------------------------------
# Cost facts: shapes are the ops' tensor arguments in order (None arguments are absent)


def _gemm_flops(dims):
    def flops(args, kwargs, out) -> int:
        shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
        _, m, n, k = dims(shapes)
        return 2 * m * n * k
    return flops


register_fused("topk_gating", "reduction")
register_fused("moe_align", "scan")
register_fused("moe_gemm", "grouped_gemm", flops=_gemm_flops(moe_gemm_dims))
register_fused("moe_mxfp4_gemm", "grouped_gemm", flops=_gemm_flops(moe_mxfp4_gemm_dims))
register_fused("swigluoai_and_mul", "elementwise", flops=lambda args, kwargs, out: 6 * out.numel())
register_fused("moe_sum", "reduction", flops=lambda args, kwargs, out: 2 * args[0].numel())
