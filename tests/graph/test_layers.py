"""Classes of structurally identical layers (for folding placements): found from the graph alone."""

from __future__ import annotations

import copy
import json

import pytest

from tessera.capture.api import trace_model
from tessera.capture.models import CATALOG_DIR
from tessera.graph.layers import LayerStructureError, layer_structure


@pytest.fixture(scope="module")
def gptoss():
    return trace_model("gpt-oss-20b", "decode", batch=2, ctx=128)


def _config(name: str) -> dict:
    return json.loads((CATALOG_DIR / name / "config.json").read_text())


def test_uniform_layers_fold_onto_one_representative():
    g = trace_model("smollm2-135m", "decode", batch=2, ctx=64)
    s = layer_structure(g)
    layers = _config("smollm2-135m")["num_hidden_layers"]
    # layer 0 reads the embedding (from outside the layers), every later one its predecessor
    assert [c.layers for c in s.classes] == [(0,), tuple(range(1, layers))]
    assert s.folded_kernels == len(s.outside) + 2 * s.classes[0].kernels_per_layer < len(g.kernels) / 10


def test_alternating_attention_layers_are_told_apart(gptoss):
    types = _config("gpt-oss-20b")["layer_types"]
    s = layer_structure(gptoss)
    for c in s.classes:
        if c.layers != (0,):
            assert len({types[i] for i in c.layers}) == 1, c.layers  # sliding and full never share a class
    assert {types[c.layers[0]] for c in s.classes[1:]} == {"sliding_attention", "full_attention"}


def test_vision_full_attention_blocks_form_their_own_class():
    g = trace_model("qwen2.5-vl-7b", "encode")
    full = tuple(_config("qwen2.5-vl-7b")["vision_config"]["fullatt_block_indexes"])
    s = layer_structure(g)
    assert s.class_of(full[0]).layers == full
    assert s.class_of(1).layers == tuple(i for i in range(1, len(s.spans)) if i not in full)


def test_representative_kernels_match_op_and_position(gptoss):
    s = layer_structure(gptoss)
    for layer in (3, 5, 22):
        span = s.spans[layer]
        rep_layer = s.class_of(layer).layers[0]
        for k in range(span.start, span.end):
            r = s.representative(k)
            assert gptoss.kernels[r].op == gptoss.kernels[k].op and gptoss.kernels[r].layer == rep_layer
    assert s.representative(s.outside[0]) == s.outside[0]


def test_interleaved_layers_are_refused():
    g = copy.deepcopy(trace_model("smollm2-135m", "decode", batch=1, ctx=32))
    span_end = next(k.index for k in g.kernels if k.layer == 1)
    g.kernels[span_end + 3].layer = 0  # a layer-0 kernel inside layer 1
    with pytest.raises(LayerStructureError, match="layers 0 .* and 1 .* interleave"):
        layer_structure(g)
