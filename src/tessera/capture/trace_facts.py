"""What the planner reads off a traced graph, kept beside its trace-cache entry: the data edges and co-location
pairs (`tessera.graph.dataflow`) and the classes of identical layers (`tessera.graph.layers`). They are pure
functions of the graph and of `tessera.graph`'s code, both of which the entry's key holds, so a later run reads
them (a few milliseconds) instead of walking the graph's accesses and edges again (about 0.07 s each for
qwen3-235b-a22b's decode graph, for every one of a plan's 16 graphs).

Files are gzip'd JSON under ``<cache>/trace-facts``, named after the entry and the fact, written atomically
and holding the graph's hash (a file that does not parse, or names another graph, is computed again and
rewritten). A graph that did not come through the trace cache (the cache off, a local model, a graph built in
memory) has its facts computed, never stored. In one process each graph's facts are computed or read once.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import weakref
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessera.capture.trace_cache import cache_folder, entry_of
from tessera.graph.dataflow import colocation, data_edges
from tessera.graph.ir import KernelGraph
from tessera.graph.layers import LayerClass, LayerSpan, LayerStructure, LayerStructureError, layer_structure
from tessera.paths import atomic_write

_MEMO: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}  # id(graph) -> (the graph, fact name -> value)


def facts_folder() -> Path:
    """Where facts of cached traces are kept: ``<cache>/trace-facts``."""
    return cache_folder().parent / "trace-facts"


def graph_edges(graph: KernelGraph) -> list[tuple[int, int, float]]:
    """`tessera.graph.dataflow.data_edges` of ``graph``, read from beside its cache entry where it has one."""
    return _fact(graph, "edges", lambda: data_edges(graph), _pairs_with_bytes, _plain)


def graph_colocation(graph: KernelGraph) -> list[tuple[int, int]]:
    """`tessera.graph.dataflow.colocation` of ``graph`` (over its data edges), likewise kept."""
    return _fact(graph, "colocation", lambda: colocation(graph, graph_edges(graph)), _pairs, _plain)


def graph_layers(graph: KernelGraph) -> LayerStructure:
    """`tessera.graph.layers.layer_structure` of ``graph``, likewise kept; raises its `LayerStructureError` for a
    graph whose layers interleave (that too is kept)."""
    found = _fact(graph, "layers", lambda: _structure_or_error(graph), _decode_layers, _encode_layers)
    if isinstance(found, LayerStructureError):
        raise LayerStructureError(str(found))
    return found


def _structure_or_error(graph: KernelGraph) -> LayerStructure | LayerStructureError:
    try:
        return layer_structure(graph)
    except LayerStructureError as e:
        return e


def _fact(graph: KernelGraph, name: str, compute: Callable[[], Any], decode: Callable[[Any], Any],
          encode: Callable[[Any], Any]) -> Any:
    gid = id(graph)
    known = _MEMO.get(gid)
    if known is None or known[0]() is not graph:
        known = (weakref.ref(graph, lambda _ref: _MEMO.pop(gid, None)), {})
        _MEMO[gid] = known
    memo = known[1]
    if name in memo:
        return memo[name]
    entry = entry_of(graph)
    path = None if entry is None else facts_folder() / f"{entry.name.split('.')[0]}.{name}.json.gz"
    value = _read(path, graph.hash, decode) if path is not None else None
    if value is None:
        value = compute()
        if path is not None:
            blob = gzip.compress(json.dumps({"graph": graph.hash, "value": encode(value)}).encode(), compresslevel=1)
            with contextlib.suppress(OSError):
                atomic_write(path, blob)
    memo[name] = value
    return value


def _read(path: Path, graph_hash: str, decode: Callable[[Any], Any]) -> Any:
    try:
        stored = json.loads(gzip.decompress(path.read_bytes()))
        if stored["graph"] != graph_hash:
            return None
        return decode(stored["value"])
    except (OSError, EOFError, zlib.error, gzip.BadGzipFile, ValueError, KeyError, TypeError, IndexError):
        return None


def _plain(value: Any) -> Any:
    return value


def _pairs_with_bytes(value: Any) -> list[tuple[int, int, float]]:
    return [(int(s), int(d), float(b)) for s, d, b in value]


def _pairs(value: Any) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in value]


def _encode_layers(value: LayerStructure | LayerStructureError) -> dict[str, Any]:
    if isinstance(value, LayerStructureError):
        return {"error": str(value)}
    return {"spans": [[s.layer, s.start, s.end] for s in value.spans.values()],
            "classes": [[c.signature, list(c.layers), c.kernels_per_layer] for c in value.classes],
            "outside": list(value.outside)}


def _decode_layers(value: dict[str, Any]) -> LayerStructure | LayerStructureError:
    if "error" in value:
        return LayerStructureError(str(value["error"]))
    spans = {int(layer): LayerSpan(int(layer), int(start), int(end)) for layer, start, end in value["spans"]}
    classes = [LayerClass(str(sig), tuple(int(x) for x in layers), int(size)) for sig, layers, size in value["classes"]]
    return LayerStructure(spans, classes, tuple(int(k) for k in value["outside"]))
