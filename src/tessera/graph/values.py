"""Raw values of constant buffers, stored in the graph as base64 of their bytes."""

from __future__ import annotations

import base64

import torch

# Constants larger than this are not embedded in graph files (they belong in the weights).
MAX_CONSTANT_BYTES = 64 * 1024 * 1024


def pack_values(t: torch.Tensor) -> str:
    """Base64 of a host tensor's bytes in contiguous order."""
    t = t.detach().to("cpu").contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes > MAX_CONSTANT_BYTES:
        raise ValueError(f"constant of {nbytes} bytes is too large to embed in a graph "
                         f"(limit {MAX_CONSTANT_BYTES}); make it a persistent buffer so it is a weight")
    return base64.b64encode(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").decode("ascii")


def unpack_values(data: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Inverse of :func:`pack_values`."""
    raw = bytearray(base64.b64decode(data))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).clone()
