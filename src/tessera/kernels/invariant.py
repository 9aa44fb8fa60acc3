"""Batch-invariant GEMMs and decode attention: every output row computed by its own one-row call.

A BLAS GEMM picks its blocking (and so the order in which it adds the K products) by the shape of the
whole call, so the same input row can give results a rounding step apart at 1 row and at 8 rows (bf16:
one step of 2^-8 relative, enough to flip a greedy token where the top two logits nearly tie). These
replacements for ``aten.mm``, ``aten.addmm``, ``aten.linear`` and ``tessera::merged_linear`` run one GEMM of
one row per output row, and ``tessera::decode_attention`` one row's attention at a time (its key length is the
step's furthest row's on a CPU), so a row's bits depend only on that row, never on which rows share the
step. The runtime's ``Executor(batch_invariant=True)`` calls them in place of the traced ops; they are plain
functions (not registered ops), so traced graphs, their hashes and the cost model are unchanged.

The price is a GEMV per row instead of one GEMM: each row re-reads the weights (measured in the README's
known limits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M,K] @ b [K,N]``, row by row."""
    out = a.new_empty(a.shape[0], b.shape[1])
    for i in range(a.shape[0]):
        torch.mm(a[i:i + 1], b, out=out[i:i + 1])
    return out


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1) -> torch.Tensor:
    """``beta bias + alpha a [M,K] @ b [K,N]``, row by row (``bias`` [N], [1,N] or [M,N])."""
    out = a.new_empty(a.shape[0], b.shape[1])
    per_row = bias.dim() == 2 and bias.shape[0] == a.shape[0] and a.shape[0] != 1
    for i in range(a.shape[0]):
        torch.addmm(bias[i:i + 1] if per_row else bias, a[i:i + 1], b, beta=beta, alpha=alpha, out=out[i:i + 1])
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..,K] @ weight [N,K].T (+ bias)``, one row of ``x`` at a time."""
    rows = x.reshape(-1, x.shape[-1])
    out = x.new_empty(rows.shape[0], weight.shape[0])
    for i in range(rows.shape[0]):
        out[i:i + 1] = F.linear(rows[i:i + 1], weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def merged_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """`tessera::merged_linear` (the concatenated projections of ``weights``), one row of ``x`` at a time."""
    rows = x.reshape(-1, x.shape[-1])
    n = sum(w.shape[0] for w in weights)
    out = x.new_empty(rows.shape[0], n)
    pairs = list(zip(weights, biases, strict=True)) if biases else [(w, None) for w in weights]
    for i in range(rows.shape[0]):
        row, at = rows[i:i + 1], 0
        for w, b in pairs:
            out[i:i + 1, at:at + w.shape[0]] = F.linear(row, w, b)
            at += w.shape[0]
    return out.view(*x.shape[:-1], n)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, scale: float, window: int, sinks: torch.Tensor | None) -> torch.Tensor:
    """`tessera::decode_attention`, one row at a time. On a CPU the op reads the cache up to the step's
    furthest row, and SDPA's bits depend on how many keys it is given (rows at positions 3 and 300: the row
    at 3 differs from itself alone); row by row, each reads up to its own position, as it does alone."""
    from tessera.kernels.bodies import body

    op = body("tessera.decode_attention.default")
    return torch.cat([op(q[i:i + 1], k_cache, v_cache, slots[i:i + 1], positions[i:i + 1], scale, window, sinks)
                      for i in range(q.shape[0])])


# traced op name -> its batch-invariant replacement
REPLACEMENTS = {
    "aten.mm.default": mm,
    "aten.addmm.default": addmm,
    "aten.linear.default": linear,
    "tessera.merged_linear.default": merged_linear,
    "tessera.decode_attention.default": decode_attention,
}


def invariant_op(name: str):
    """The batch-invariant replacement of the traced op ``name``, or None when it has none (it is already
    computed per row, or is not a GEMM)."""
    return REPLACEMENTS.get(name)
