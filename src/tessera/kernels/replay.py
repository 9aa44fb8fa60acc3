"""Faster equivalents of traced aten ops for replay: the runtime's ``Executor`` calls them in place of the
traced op (unless it runs batch-invariant). Plain functions, not registered ops, so traced graphs, their
hashes and the cost model are unchanged; each gives the traced op's result.

``aten.bmm`` of a matrix broadcast over the batch (a zero batch stride, or a batch of one): what a linear layer
traces to on a sliced activation, e.g. the LM head on a prefill's last positions (``logits_to_keep=1`` slices
``[B, S, H]`` to ``[B, 1, H]``, not contiguous, so the matmul is not folded into one GEMM). A batch of one (a
lone request's prefill) keeps the weight's own batch stride, not zero, yet is as slow: 69-94 ms against 6 ms
for smollm2-135m's LM head in bf16, a third of a one-row prefill step. In bf16 and fp16
PyTorch's CPU bmm multiplies by the expanded weight far slower than a GEMM per batch entry on the weight
itself (smollm2-135m's LM head, 49152 x 576, eight rows: 197 ms against 37 ms), which gives the same bits;
one GEMM over all the rows would be faster still, but its bits differ from bmm's (fp32, four rows or more),
so it is not used. In fp32 bmm is as fast as the per-entry GEMMs and runs as traced.

Tessera's own custom ops replay as their Python bodies (`tessera.kernels.bodies`): the same torch ops, without
the tens of microseconds torch's custom-op wrappers add to every call.
"""

from __future__ import annotations

import torch

from tessera.kernels.bodies import body


def broadcast_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``aten.bmm(a, b)``, bit for bit; in bf16 / fp16 with ``b`` one matrix broadcast over the batch (or a batch
    of one), one GEMM per batch entry on that matrix."""
    if (b.stride(0) == 0 or b.shape[0] == 1) and a.shape[0] > 0 and a.dtype in REDUCED:
        weight = b[0]
        return torch.stack([torch.mm(a[i], weight) for i in range(a.shape[0])])
    return torch.ops.aten.bmm.default(a, b)


REDUCED = (torch.bfloat16, torch.float16)  # where CPU bmm over an expanded matrix is slow


# traced op name -> its faster replay
REPLACEMENTS = {"aten.bmm.default": broadcast_bmm}


def replay_op(name: str):
    """The faster replay of the traced op ``name`` (a replacement, or a tessera op's body), or None when it has
    none."""
    return REPLACEMENTS.get(name) or body(name)
