"""JSON encoding of kernel arguments: tensors become buffer views, torch enums become tagged values."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from tessera.graph.ir import TensorRef

_MEMORY_FORMATS = {str(f).removeprefix("torch."): f for f in
                   (torch.contiguous_format, torch.preserve_format, torch.channels_last, torch.channels_last_3d)}
_LAYOUTS = {str(f).removeprefix("torch."): f for f in (torch.strided, torch.sparse_coo)}


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def encode(value: Any, tensor_ref: Callable[[torch.Tensor], TensorRef]) -> Any:
    """Encode an op argument as JSON-able data; ``tensor_ref`` names the buffer view of a tensor."""
    if isinstance(value, torch.Tensor):
        return {"$t": tensor_ref(value).to_json()}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"$f": repr(value)}
    if isinstance(value, (list, tuple)):
        return [encode(v, tensor_ref) for v in value]
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"$device": True}  # re-targeted to the executing device at replay
    if isinstance(value, torch.memory_format):
        return {"$mf": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"$layout": str(value).removeprefix("torch.")}
    raise TypeError(f"cannot record an argument of type {type(value).__name__}: {value!r}")


def decode(value: Any, materialize: Callable[[TensorRef], torch.Tensor], device: torch.device) -> Any:
    """Inverse of :func:`encode`: buffer views become tensors on ``device``."""
    if isinstance(value, list):
        return [decode(v, materialize, device) for v in value]
    if isinstance(value, dict):
        if "$t" in value:
            return materialize(TensorRef.from_json(value["$t"]))
        if "$f" in value:
            return float(value["$f"])
        if "$dtype" in value:
            return dtype_from_name(value["$dtype"])
        if "$device" in value:
            return device
        if "$mf" in value:
            return _MEMORY_FORMATS[value["$mf"]]
        if "$layout" in value:
            return _LAYOUTS[value["$layout"]]
        raise ValueError(f"unknown encoded argument {value!r}")
    return value


def tensor_refs(value: Any) -> list[TensorRef]:
    """All buffer views inside an encoded argument, in order."""
    out: list[TensorRef] = []
    if isinstance(value, list):
        for v in value:
            out.extend(tensor_refs(v))
    elif isinstance(value, dict) and "$t" in value:
        out.append(TensorRef.from_json(value["$t"]))
    return out
