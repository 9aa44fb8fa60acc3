"""Repeated layers of a KernelGraph: which numbered layers are structurally identical.

A planner can then place one representative layer per class and apply the placement to every layer
of the class ("folding"), so full-size models solve fast, while layers that differ (GPT-oss's
sliding-window and full attention, hybrids, a first or last layer with extra work) stay apart.

Two layers are identical when their kernels match one for one in program order: same op, same scope
with the layer number removed, same argument layouts and scalars (buffer names aside), same dtypes,
and the same dependency structure (each RAW edge into the kernel comes from the same relative
position: inside the layer, from the previous layer, or from outside the numbered layers).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass

from tessera.graph.ir import KernelGraph

# A numbered layer in a module scope ("model.layers.3.mlp"); the recorder assigns kernels' layers with it.
LAYER_RE = re.compile(r"(?:^|\.)(?:layers|blocks|transformer_blocks|single_transformer_blocks|h|block)\.(\d+)(?:\.|$)")


class LayerStructureError(ValueError):
    """A graph's numbered layers are not contiguous runs of kernels."""


@dataclass(frozen=True)
class LayerSpan:
    """The kernels of one numbered layer: indices [start, end) in program order."""

    layer: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class LayerClass:
    """Structurally identical layers; ``layers[0]`` is the representative."""

    signature: str
    layers: tuple[int, ...]
    kernels_per_layer: int


@dataclass(frozen=True)
class LayerStructure:
    """The layer spans of a graph and their classes of identical layers."""

    spans: dict[int, LayerSpan]
    classes: list[LayerClass]
    outside: tuple[int, ...]  # kernels in no numbered layer (embedding, final norm, head...)

    def class_of(self, layer: int) -> LayerClass:
        """The class a layer belongs to."""
        return next(c for c in self.classes if layer in c.layers)

    def representative(self, kernel: int) -> int:
        """The kernel at the same position in its class's representative layer (itself outside layers)."""
        for span in self.spans.values():
            if span.start <= kernel < span.end:
                rep = self.spans[self.class_of(span.layer).layers[0]]
                return rep.start + (kernel - span.start)
        return kernel

    @property
    def folded_kernels(self) -> int:
        """Kernels left once every class is folded onto its representative."""
        return len(self.outside) + sum(c.kernels_per_layer for c in self.classes)


def _strip_layer(scope: str) -> str:
    m = LAYER_RE.search(scope)
    return scope if m is None else scope[:m.start(1)] + "*" + scope[m.end(1):]


def _layout_token(value):
    """An encoded argument with buffer names removed (layouts, dtypes and scalars kept)."""
    if isinstance(value, list):
        return [_layout_token(v) for v in value]
    if isinstance(value, dict):
        if "$t" in value:
            _, dtype, offset, sizes, strides = value["$t"]
            return ["t", dtype, offset, sizes, strides]
        return {k: _layout_token(v) for k, v in sorted(value.items())}
    return value


def layer_spans(graph: KernelGraph) -> dict[int, LayerSpan]:
    """Each numbered layer's kernel range, from its first to its last kernel (kernels of no layer in
    between, such as a cache hook's copy, belong to it); raises if two layers' kernels interleave."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for k in graph.kernels:
        if k.layer is not None:
            first.setdefault(k.layer, k.index)
            last[k.layer] = k.index
    spans = {layer: LayerSpan(layer, start, last[layer] + 1) for layer, start in first.items()}
    ordered = sorted(spans.values(), key=lambda s: s.start)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.start < a.end:
            raise LayerStructureError(f"the kernels of layers {a.layer} ({a.start}-{a.end - 1}) and {b.layer} "
                                      f"({b.start}-{b.end - 1}) interleave: the graph cannot be folded by layer")
    return spans


def layer_structure(graph: KernelGraph) -> LayerStructure:
    """Group a graph's numbered layers into classes of structurally identical layers."""
    spans = layer_spans(graph)
    layer_at = {i: s.layer for s in spans.values() for i in range(s.start, s.end)}
    incoming: dict[int, set[tuple]] = defaultdict(set)
    for e in graph.edges:
        if e.kind != "RAW" or e.dst not in layer_at:
            continue
        dst_layer = layer_at[e.dst]
        src_layer = layer_at.get(e.src)
        if src_layer == dst_layer:
            incoming[e.dst].add(("same", e.src - spans[dst_layer].start))
        elif src_layer is not None and src_layer == dst_layer - 1:
            incoming[e.dst].add(("previous", e.src - spans[src_layer].start))
        elif src_layer is None:
            incoming[e.dst].add(("outside", e.src))
        else:
            incoming[e.dst].add(("layer", dst_layer - src_layer, e.src - spans[src_layer].start))
    groups: dict[str, list[int]] = defaultdict(list)
    for layer, span in sorted(spans.items()):
        tokens = []
        for k in graph.kernels[span.start:span.end]:
            tokens.append([k.op, _strip_layer(k.scope), _layout_token(k.args), _layout_token(k.kwargs),
                           [o[1:] if o else None for o in k.outputs], k.dtypes, sorted(incoming[k.index])])
        blob = json.dumps(tokens, sort_keys=True, separators=(",", ":"), default=str).encode()
        groups[hashlib.sha256(blob).hexdigest()[:16]].append(layer)
    classes = [LayerClass(sig, tuple(layers), spans[layers[0]].size) for sig, layers in groups.items()]
    classes.sort(key=lambda c: c.layers[0])
    outside = tuple(k.index for k in graph.kernels if k.index not in layer_at)
    return LayerStructure(spans, classes, outside)
