"""Bytes per element of a dtype by its name as graphs store it (``bfloat16``, ``float8_e4m3fn``...), without
importing torch: the planner reads cached graphs and profiles, and loading torch for this alone took a second
or more of every `tessera plan`. A name outside the table is asked of torch (``tests/graph/test_dtypes.py``
checks the table against torch's own itemsizes)."""

from __future__ import annotations

ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the dtype named ``name`` (torch's name without ``torch.``); ValueError for a name
    that is not a dtype."""
    size = ITEMSIZE.get(name)
    if size is None:
        from tessera.graph.codec import dtype_from_name  # a rarer dtype: torch knows it

        size = dtype_from_name(name).itemsize
    return size
