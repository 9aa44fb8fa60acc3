"""A KernelGraph in numbers: kernels by class, FLOPs, bytes by buffer kind, edges."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from tessera.graph.ir import KernelGraph


def summarize(graph: KernelGraph) -> dict[str, Any]:
    """Kernels and FLOPs per op class, weight/activation/state/input bytes, edges by kind, trace time."""
    by_class: dict[str, dict[str, int]] = defaultdict(lambda: {"kernels": 0, "flops": 0, "bytes": 0})
    for k in graph.kernels:
        row = by_class[k.op_class]
        row["kernels"] += 1
        row["flops"] += k.flops
        row["bytes"] += k.bytes_read + k.bytes_written
    bytes_by_kind: Counter[str] = Counter()
    for b in graph.buffers.values():
        bytes_by_kind[b.kind] += b.nbytes
    edges = Counter(e.kind for e in graph.edges)
    return {
        "model": graph.model,
        "phase": graph.phase,
        "hash": graph.hash,
        "shape": {k: graph.meta[k] for k in ("batch", "seq", "ctx", "image", "resolution") if k in graph.meta},
        "kernels": len(graph.kernels),
        "layers": len({k.layer for k in graph.kernels if k.layer is not None}),
        "flops": sum(k.flops for k in graph.kernels),
        "by_class": dict(sorted(by_class.items(), key=lambda kv: -kv[1]["flops"])),
        "weight_bytes": bytes_by_kind["weight"],
        "activation_bytes": bytes_by_kind["activation"] + bytes_by_kind["output"],
        "state_bytes": bytes_by_kind["state"],
        "input_bytes": bytes_by_kind["input"],
        "constant_bytes": bytes_by_kind["constant"],
        "buffers": len(graph.buffers),
        "accesses": len(graph.accesses),
        "edges": dict(sorted(edges.items())) | {"total": len(graph.edges)},
        "trace_seconds": graph.meta.get("trace_seconds"),
        "graph_kind": graph.meta.get("graph", "eager"),
        "fallbacks": list(graph.meta.get("fallbacks", [])),
    }
