"""Faster equivalents of traced aten ops for replay: the runtime's ``Executor`` calls them in place of the
traced op (unless it runs batch-invariant). Plain functions, not registered ops, so traced graphs, their
hashes and the cost model are unchanged; each gives the traced op's result.

``aten.bmm`` of a matrix broadcast over the batch (a zero batch stride): what a linear layer traces to on a
sliced activation, e.g. the LM head on a prefill's last positions (``logits_to_keep=1`` slices
``[B, S, H]`` to ``[B, 1, H]``, not contiguous, so the matmul is not folded into one GEMM). PyTorch's CPU
bmm then multiplies by the expanded weight batch entry by batch entry, far slower than one GEMM
(smollm2-135m's LM head, 49152 x 576 bf16, one thread: 164 ms at one row and 1.8 s at eight, against
9.5 and 13.5 ms as one ``mm``, bit for bit the same).
"""

from __future__ import annotations

import torch


def broadcast_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``aten.bmm(a, b)``; one GEMM over the batch's rows when ``b`` is one matrix broadcast over it."""
    if b.stride(0) == 0 and a.shape[0] > 0:
        return torch.mm(a.reshape(-1, a.shape[-1]), b[0]).view(a.shape[0], a.shape[1], b.shape[-1])
    return torch.ops.aten.bmm.default(a, b)


# traced op name -> its faster replay
REPLACEMENTS = {"aten.bmm.default": broadcast_bmm}


def replay_op(name: str):
    """The faster replay of the traced op ``name``, or None when it has none."""
    return REPLACEMENTS.get(name)
