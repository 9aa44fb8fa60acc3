"""Kernel classes (what bounds a kernel: GEMM, attention, elementwise...) and FLOP counts."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from tessera.graph.fused_shapes import FUSED_GEMMS, op_base_name

OP_CLASSES = ("gemm", "grouped_gemm", "attention", "conv", "embedding", "reduction", "norm", "scan",
              "copy", "elementwise")

_BY_NAME = {
    "gemm": {"mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "addmv", "mv", "dot"},
    "grouped_gemm": {"_grouped_mm", "grouped_mm", "grouped_mm_fallback"},
    "attention": {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "prefill_attention", "decode_attention",
                  "segment_attention"},
    "conv": {"convolution", "_convolution", "conv1d", "conv2d", "conv3d", "cudnn_convolution",
             "_slow_conv2d_forward", "upsample_nearest2d", "upsample_bilinear2d"},
    "embedding": {"embedding", "index_select", "gather", "index"},
    "norm": {"native_layer_norm", "native_group_norm", "rms_norm", "_fused_rms_norm", "layer_norm",
             "group_norm"},
    "reduction": {"sum", "mean", "amax", "amin", "max", "min", "var_mean", "var", "std", "_softmax",
                  "_log_softmax", "softmax", "topk", "sort", "argmax", "argmin", "argsort", "histc", "norm",
                  "linalg_vector_norm", "prod", "all", "any", "logsumexp"},
    "scan": {"cumsum", "cumprod", "_cummax_helper", "_cummin_helper"},
    "copy": {"_to_copy", "copy_", "clone", "cat", "stack", "index_put_", "index_put", "index_copy_",
             "index_copy", "scatter", "scatter_", "scatter_add", "scatter_add_", "slice_scatter",
             "select_scatter", "constant_pad_nd", "repeat", "roll", "flip", "masked_scatter",
             "masked_scatter_", "fill_", "zero_", "zeros", "ones", "full", "zeros_like", "ones_like",
             "full_like", "arange", "index_add_", "index_add", "_unsafe_index", "repeat_interleave",
             "new_zeros", "new_ones", "new_full", "tril", "triu", "split_with_sizes_copy"},
}
_CLASS_OF = {name: cls for cls, names in _BY_NAME.items() for name in names}


@dataclass(frozen=True)
class FusedOpInfo:
    """What the cost model needs to know about a fused (custom) op, declared next to its definition.

    ``flops(args, kwargs, out)`` counts its floating-point operations from the op's arguments at trace
    time; ``gemm(shapes)`` gives (batch, M, N, K) of a matrix-multiply unit from the shapes of its tensor
    arguments in order, as a recorded kernel lists them (declared in :mod:`tessera.graph.fused_shapes`, which
    the cost model reads without importing torch); ``traffic(args, kwargs, out)`` gives (bytes read,
    bytes written) of a unit that touches only part of an argument it is given whole (a cache write through
    slot indices), where the default (every argument read whole, mutated ones written whole) overstates it.
    """

    op_class: str
    flops: Callable[[tuple, dict, Any], int] | None = None
    gemm: Callable[[list[list[int]]], tuple[int, int, int, int]] | None = None
    traffic: Callable[[tuple, dict, Any], tuple[int, int]] | None = None


FUSED: dict[str, FusedOpInfo] = {}


def register_fused(name: str, op_class: str, *, flops: Callable[[tuple, dict, Any], int] | None = None,
                   traffic: Callable[[tuple, dict, Any], tuple[int, int]] | None = None) -> None:
    """Declare the class, FLOP formula and (optionally) memory traffic of the fused op ``name`` (its base name,
    e.g. ``merged_linear``), with its GEMM shape from :data:`tessera.graph.fused_shapes.FUSED_GEMMS` (a GEMM
    or grouped GEMM op must have one there); a second registration of the same name must agree with the first."""
    if op_class not in OP_CLASSES:
        raise ValueError(f"fused op {name!r}: unknown op class {op_class!r} (one of {', '.join(OP_CLASSES)})")
    gemm = FUSED_GEMMS.get(name)
    if op_class in ("gemm", "grouped_gemm") and gemm is None:
        raise ValueError(f"fused {op_class} op {name!r} has no GEMM shape: declare it in tessera.graph.fused_shapes")
    info = FusedOpInfo(op_class, flops, gemm, traffic)
    if name in FUSED and FUSED[name].op_class != op_class:
        raise ValueError(f"fused op {name!r} registered twice with different classes")
    FUSED[name] = info


def op_class(op: str) -> str:
    """The class of a kernel by its op name (elementwise when nothing more specific applies)."""
    name = op_base_name(op)
    info = FUSED.get(name)
    return info.op_class if info is not None else _CLASS_OF.get(name, "elementwise")


def _numel(t) -> int:
    return math.prod(t.shape) if isinstance(t, torch.Tensor) else 0


def causal_pairs(sq: int, sk: int, window: int = 0, offset: int | None = None) -> int:
    """Allowed (query, key) pairs of causal attention: query i (at key position ``offset + i``, default
    ``sk - sq``: the queries are the last ``sq`` positions) sees keys up to its own position, and with a
    sliding ``window`` > 0 only the last ``window`` of them: sum over i of min(offset + i + 1, window, sk)."""
    offset = max(sk - sq, 0) if offset is None else offset
    cap = min(window, sk) if window and window > 0 else sk
    total = 0
    # positions p = offset + i + 1 for i in 0..sq-1; min(p, cap): an arithmetic run, then a flat part
    first, last = offset + 1, offset + sq
    ramp_end = min(last, cap)
    if ramp_end >= first:
        total += (first + ramp_end) * (ramp_end - first + 1) // 2
    flat = last - max(ramp_end, first - 1)
    if flat > 0:
        total += flat * cap
    return total


def _attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pairs: int | None = None) -> int:
    """2 x (d + dv) FLOPs per (query, key) pair per batch row and head; ``pairs`` of one (row, head),
    default all sq x sk."""
    b, h, sq, d = q.shape
    sk, dv = k.shape[-2], v.shape[-1]
    pairs = sq * sk if pairs is None else pairs
    return 2 * b * h * pairs * (d + dv)


def _arg(func, args, kwargs, name: str, default=None):
    """An op argument by schema name, positional or keyword."""
    if name in kwargs:
        return kwargs[name]
    try:
        names = [a.name for a in func._schema.arguments]
    except AttributeError:
        return default
    if name in names and names.index(name) < len(args):
        return args[names.index(name)]
    return default


_SDPA = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_cudnn_attention")


def attention_flops(func, args, kwargs) -> int | None:
    """FLOPs of an attention kernel counting only the (query, key) pairs its mask allows (causal,
    sliding window); None for ops that are not attention."""
    name = op_base_name(str(func))
    if name == "prefill_attention":  # causal, optional sliding window (kernels/attention.py)
        q, k, v = args[0], args[1], args[2]
        window = _arg(func, args, kwargs, "window", 0) or 0
        return _attention_flops(q, k, v, causal_pairs(q.shape[-2], k.shape[-2], int(window)))
    if name == "decode_attention":  # one query per row against ctx cached keys (window > 0: the last window)
        q, k_cache, v_cache = args[0], args[1], args[2]
        window = int(_arg(func, args, kwargs, "window", 0) or 0)
        ctx = k_cache.shape[-2]
        keys = min(ctx, window) if window > 0 else ctx
        return _attention_flops(q, k_cache, v_cache, q.shape[-2] * keys)
    if name in _SDPA:
        q, k, v = args[0], args[1], args[2]
        if _arg(func, args, kwargs, "is_causal", False):  # torch's is_causal: top-left aligned (key j <= query i)
            return _attention_flops(q, k, v, causal_pairs(q.shape[-2], k.shape[-2], offset=0))
        return _attention_flops(q, k, v)
    return None


def flops_of(func, args, kwargs, out) -> int:
    """Floating-point operations of one kernel (multiply-add = 2), from shapes only."""
    name = op_base_name(str(func))
    try:
        info = FUSED.get(name)
        if info is not None and info.flops is not None:
            return int(info.flops(args, kwargs, out))
        attention = attention_flops(func, args, kwargs)
        if attention is not None:
            return attention
        if name == "segment_attention":  # block-diagonal: only within-segment pairs
            q, v, lengths = args[0], args[2], args[3]
            return 2 * q.shape[0] * q.shape[1] * sum(n * n for n in lengths) * (q.shape[-1] + v.shape[-1])
        if name in ("_grouped_mm",):
            a, w = args[0], args[1]
            return 2 * a.shape[0] * a.shape[-1] * w.shape[-1]
        from torch.utils.flop_counter import flop_registry

        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a FLOP estimate must never break a trace
        pass
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    cls = op_class(str(func))
    if cls in ("copy", "embedding"):
        return 0
    if cls in ("reduction", "norm", "scan"):
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        return max((_numel(t) for t in ins), default=0) * (5 if cls == "norm" else 1)
    return sum(_numel(o) for o in outs)


# Ops whose indices select a part of a tensor argument: the bytes they move are those of the selected
# elements (the dependency analysis still treats the whole argument as touched, since the indices
# are only known at run time).
_INDEXED_WRITES = {"index_put_", "index_put", "index_copy_", "index_copy", "scatter_", "scatter",
                   "scatter_add_", "scatter_add", "index_add_", "index_add"}
_INDEXED_READS = {"embedding", "index_select", "index", "gather", "_unsafe_index"}


def indexed_traffic(func, args, out, kwargs: dict | None = None) -> tuple[int, int] | None:
    """(bytes read, bytes written) of an indexed op from its selected elements (or a fused op's declared
    traffic); None for other ops."""
    name = op_base_name(str(func))
    info = FUSED.get(name)
    if info is not None:
        return info.traffic(args, kwargs or {}, out) if info.traffic is not None else None
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]

    def nbytes(t):
        return _numel(t) * t.element_size()

    if name in _INDEXED_WRITES and tensors:
        moved = sum(nbytes(t) for t in tensors[1:])  # indices and values/source, not the whole target
        values = max((nbytes(t) for t in tensors[1:] if t.is_floating_point()), default=0)
        return moved, values
    if name in _INDEXED_READS and outs:
        written = sum(nbytes(o) for o in outs)
        indices = sum(nbytes(t) for t in tensors if not t.is_floating_point())
        return written + indices, written
    return None
