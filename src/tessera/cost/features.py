"""What the cost model needs to know about a kernel: its cost class, block, FLOPs and bytes by kind.

Bytes are split into weights, KV cache and everything else (activations, inputs, constants, other
state) because deployment options rescale the first two, and only activations can stay resident in
a GPU's L2 between kernels.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from tessera.cost.classes import COST_CLASSES
from tessera.cost.options import CostOptions
from tessera.cost.routing import RoutingDistribution
from tessera.graph.fused_shapes import FUSED_GEMMS, op_base_name
from tessera.graph.ir import Access, Kernel, KernelGraph

GEMV_MAX_ROWS = 16  # a GEMM with at most this many rows (tokens) per matrix streams its weights: a GEMV
TENSOR_CORE_CLASSES = ("gemm", "gemv", "grouped_gemm", "attention", "conv")

_ATTENTION_SCOPES = ("attn", "attention", "mixer")  # token mixers: attention, and Mamba's SSM mixer
_FFN_SCOPES = ("mlp", "experts", "feed_forward", "ffn", "ff", "ff_context", "router", "gate", "moe")


def gemm_dims(kernel: Kernel) -> tuple[int, int, int, int] | None:
    """(batch, M rows, N columns, K depth) of a matrix-multiply kernel, None for other kernels."""
    name, s = op_base_name(kernel.op), kernel.shapes
    try:
        fused = FUSED_GEMMS.get(name)  # Tessera's fused GEMM units (no fused op shares an aten GEMM's name)
        if fused is not None:
            return fused(s)
        if name in ("mm", "matmul") and len(s[0]) == 2:
            return 1, s[0][0], s[1][1], s[0][1]
        if name == "addmm":
            return 1, s[1][0], s[2][1], s[1][1]
        if name in ("bmm", "baddbmm"):
            a, b = (s[0], s[1]) if name == "bmm" else (s[1], s[2])
            return a[0], a[1], b[2], a[2]
        if name in ("mv", "addmv"):
            m = s[0] if name == "mv" else s[1]
            return 1, 1, m[0], m[1]
        if name == "linear":
            return 1, math.prod(s[0][:-1]), s[1][0], s[1][1]
        if name == "_grouped_mm":
            return 1, s[0][0], s[1][-1], s[0][-1]
    except (IndexError, TypeError):
        return None
    return None


def cost_class(kernel: Kernel) -> str:
    """The cost class of a kernel: its op class, with GEMMs over few rows as GEMVs and norms as reductions."""
    cls = kernel.op_class
    if cls == "norm":
        return "reduction"
    if cls == "gemm":
        dims = gemm_dims(kernel)
        if dims is not None and min(dims[1], dims[2]) <= GEMV_MAX_ROWS:
            return "gemv"
    return cls if cls in COST_CLASSES else "elementwise"


def kernel_identity(kernel: Kernel) -> str | None:
    """What per-op efficiency factors a kernel takes: a Tessera fused op's base name (``merged_linear``,
    ``add_rms_norm``, ``kv_write``...), ``lm_head`` for the LM-head GEMM, None otherwise (class factors)."""
    if kernel.op.startswith("tessera."):
        return op_base_name(kernel.op)
    if kernel.op_class == "gemm" and kernel.scope.split(".")[-1] == "lm_head":
        return "lm_head"
    return None


def block_of(kernel: Kernel) -> str:
    """``attention`` (attention or SSM token mixer), ``ffn`` (MLP / experts) or ``other``, by module scope."""
    parts = kernel.scope.lower().replace("[", ".").split(".")
    if any(p in _FFN_SCOPES or p.startswith("mlp") for p in parts):
        return "ffn"
    if any(p.endswith(_ATTENTION_SCOPES) or p.startswith("attn") for p in parts):
        return "attention"
    return "other"


@dataclass(frozen=True)
class KernelFeatures:
    """A kernel as the roofline sees it, after the deployment options are applied."""

    index: int
    cost_class: str
    block: str
    flops: float
    weight_bytes: float  # weights read, in their deployed dtype
    kv_bytes: float  # KV-cache bytes read and written, in the deployed KV dtype
    other_bytes: float  # activations, inputs, outputs, constants and non-KV state
    compute_dtype: str  # the first floating-point argument dtype (the trace's)
    gemm: tuple[int, int, int, int] | None  # (batch, M, N, K) of matrix multiplies
    weight_format: str | None = None  # deployed format of its matrix weights: mxfp4, fp8, bf16... (None: none)
    op: str | None = None  # its identity for per-op factors: a fused op's name (merged_linear...), lm_head

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.other_bytes


def _nbytes(a: Access) -> int:
    return math.prod(a.sizes) * a.itemsize


def is_kv_buffer(name: str) -> bool:
    """Whether a state buffer is a KV cache (``cache.layer{i}.k`` / ``.v``), which --kv-dtype rescales."""
    return name.startswith("cache.") and name.endswith((".k", ".v"))


class FeatureExtractor:
    """Features of every kernel of one graph (accesses indexed once)."""

    def __init__(self, graph: KernelGraph, options: CostOptions = CostOptions()):
        self.graph, self.options = graph, options
        self._accesses: dict[int, list[Access]] = defaultdict(list)
        for a in graph.accesses:
            self._accesses[a.kernel].append(a)

    def features(self, kernel: Kernel) -> KernelFeatures:
        """The roofline features of one kernel of the graph."""
        cls = cost_class(kernel)
        by_kind = {"weight": 0.0, "kv": 0.0, "other": 0.0}
        stored_weight = 0.0  # weight bytes in the deployed format (matrices of GEMMs rescaled by the options)
        matrix_gemm = cls in ("gemm", "gemv", "grouped_gemm")
        formats = []
        for a in self._accesses[kernel.index]:
            buf = self.graph.buffers[a.buffer]
            kind = "weight" if buf.kind == "weight" else "kv" if is_kv_buffer(a.buffer) else "other"
            by_kind[kind] += _nbytes(a)
            if kind == "weight":
                matrix = len(buf.shape) >= 2
                stored_weight += _nbytes(a) * (self.options.weight_scale(buf.dtype) if matrix_gemm and matrix
                                               else 1.0)
                if matrix:
                    formats.append(self.options.weight_format(buf.dtype))
        touched = sum(by_kind.values())
        moved = kernel.bytes_read + kernel.bytes_written
        weight_scale = stored_weight / by_kind["weight"] if by_kind["weight"] else 1.0
        if touched > 0 and moved < touched:  # indexed ops move only the selected elements
            by_kind = {k: v * moved / touched for k, v in by_kind.items()}
        elif touched == 0:
            by_kind["other"] = float(moved)
        dims = gemm_dims(kernel)
        if cls == "grouped_gemm" and dims is not None and len(kernel.shapes) > 1 and kernel.shapes[1]:
            experts = kernel.shapes[1][0]
            rows = dims[1]  # token-expert assignments: each expert with at least one is read once
            by_kind["weight"] *= RoutingDistribution(experts).expected_active(rows) / experts
        compute_dtype = next((d for d in kernel.dtypes if d.startswith(("bfloat", "float"))
                              and not d.startswith("float8")), "float32")
        kv_dtype = next((self.graph.buffers[a.buffer].dtype for a in self._accesses[kernel.index]
                         if is_kv_buffer(a.buffer)), compute_dtype)
        # the narrowest format among its matrix weights sets the GEMM's path (MXFP4 blocks beside BF16 biases)
        fmt = next((f for f in ("mxfp4", "fp8") if f in formats), formats[0] if formats else None)
        return KernelFeatures(index=kernel.index, cost_class=cls, block=block_of(kernel), flops=float(kernel.flops),
                              weight_bytes=by_kind["weight"] * weight_scale,
                              kv_bytes=by_kind["kv"] * self.options.kv_scale(kv_dtype),
                              other_bytes=by_kind["other"], compute_dtype=compute_dtype, gemm=dims,
                              weight_format=fmt, op=kernel_identity(kernel))

    def all(self) -> list[KernelFeatures]:
        """Features of every kernel in program order."""
        return [self.features(k) for k in self.graph.kernels]
