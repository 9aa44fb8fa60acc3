"""Which engine-owned state a step reads: the state rows a runtime must bring to a step's worker before it runs.

A traced kernel reads every argument it mutates (the trace's default access), which overstates the fused ops
that only write state through indices: ``kv_write`` puts the new tokens' K and V into their cache rows and reads
none of the rows' earlier contents, so a prefill, whose only state access is that write, reads no state at all
and needs none of its rows' earlier values wherever they are (a decode's attention does read its rows). Without
torch, like :mod:`tessera.graph.fused_shapes`.
"""

from __future__ import annotations

from tessera.graph.fused_shapes import op_base_name
from tessera.graph.ir import KernelGraph

# fused ops whose state arguments are written through slot indices and never read (`tessera.kernels.cache`)
WRITE_ONLY_STATE_OPS = frozenset({"kv_write"})


def state_read(graph: KernelGraph) -> frozenset[str]:
    """The state buffers of ``graph`` whose earlier contents some kernel reads."""
    state = set(graph.state)
    return frozenset(a.buffer for a in graph.accesses
                     if a.mode == "read" and a.buffer in state
                     and op_base_name(graph.kernels[a.kernel].op) not in WRITE_ONLY_STATE_OPS)
