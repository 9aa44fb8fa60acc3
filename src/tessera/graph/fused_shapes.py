"""The GEMM shape of each of Tessera's fused matrix-multiply ops, from a recorded kernel's argument shapes.

The cost model reads these for every fused GEMM in a traced graph; they are functions of shapes alone, so
this module imports no torch and planning from cached graphs never loads it. The ops themselves live in
:mod:`tessera.kernels`, whose ``register_fused`` declarations take their GEMM shapes from here
(`tessera.graph.opclass.register_fused`); ``tests/graph/test_fused_shapes.py`` checks that every fused op
registered with a GEMM shape has it from this table.
"""

from __future__ import annotations

import math
from collections.abc import Callable

Dims = tuple[int, int, int, int]  # (batch, M rows, N columns, K depth)


def op_base_name(op: str) -> str:
    """``aten.mm.default`` -> ``mm``; ``tessera.decode_attention.default`` -> ``decode_attention``."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 else op


def merged_linear_dims(shapes: list[list[int]]) -> Dims:
    """(1, rows, sum N, K) from [x, w_0.., b_0..] shapes (weights are the 2-D ones after x)."""
    x = shapes[0]
    n = sum(s[0] for s in shapes[1:] if len(s) == 2)
    return 1, math.prod(x[:-1]), n, x[-1]


def _moe_rows(shapes: list[list[int]], perm_at: int) -> int:
    """M: the permutation's length (1-D at ``perm_at``) when the GEMM gathers, else x's rows."""
    if len(shapes) > perm_at and len(shapes[perm_at]) == 1:
        return shapes[perm_at][0]
    return shapes[0][0]


def moe_gemm_dims(shapes: list[list[int]]) -> Dims:
    """(1, rows, N, K) of ``moe_gemm`` from [x, w [E, N, K] or [E, K, N], ..., permutation] shapes."""
    x, w = shapes[0], shapes[1]
    k = x[-1]
    n = w[2] if w[1] == k else w[1]
    return 1, _moe_rows(shapes, 3), n, k


def moe_mxfp4_gemm_dims(shapes: list[list[int]]) -> Dims:
    """(1, rows, N, K) of ``moe_mxfp4_gemm`` from [x, blocks [E, N, K/32, 16], ..., permutation] shapes."""
    blocks = shapes[1]
    return 1, _moe_rows(shapes, 4), blocks[1], blocks[2] * blocks[3] * 2


def ssd_chunk_state_dims(s: list[list[int]]) -> Dims:
    """Per (row, chunk, head): (dt x)^T [P, L] @ decayed B [L, N]."""
    (_, _, _, _, n), (b, nc, L, h, p) = s[0], s[1]
    return b * nc * h, p, n, L


def ssd_bmm_chunk_dims(s: list[list[int]]) -> Dims:
    """Per (row, chunk, group): C [L, N] @ B^T [N, L]."""
    b, nc, L, g, n = s[0]
    return b * nc * g, L, L, n


def ssd_chunk_scan_dims(s: list[list[int]]) -> Dims:
    """Per (row, chunk, head): [CB*decay | C] [L, L+N] @ [dt x ; state^T]."""
    (b, nc, L, h, p), n = s[0], s[4][-1]
    return b * nc * h, L, p, L + n


FUSED_GEMMS: dict[str, Callable[[list[list[int]]], Dims]] = {
    "merged_linear": merged_linear_dims,
    "moe_gemm": moe_gemm_dims,
    "moe_mxfp4_gemm": moe_mxfp4_gemm_dims,
    "ssd_chunk_state": ssd_chunk_state_dims,
    "ssd_bmm_chunk": ssd_bmm_chunk_dims,
    "ssd_chunk_scan": ssd_chunk_scan_dims,
}
