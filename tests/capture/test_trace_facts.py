"""Facts kept beside a cached trace: equal to computing them, read back by a later run without computing,
recomputed when their file is damaged or names another graph, never stored for a graph the cache did not give."""

from __future__ import annotations

import gzip
import json

import pytest

from tessera.capture import trace_cache, trace_facts
from tessera.capture.api import trace_model
from tessera.capture.trace_cache import trace_model_cached
from tessera.graph.dataflow import colocation, data_edges
from tessera.graph.layers import LayerStructureError, layer_structure

SHAPE = dict(batch=4, ctx=96)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    monkeypatch.delenv(trace_cache.ENV_SWITCH, raising=False)
    return tmp_path / "trace-facts"


def _cached():
    return trace_model_cached("smollm2-135m", "decode", **SHAPE)


def _all(graph):
    return trace_facts.graph_edges(graph), trace_facts.graph_colocation(graph), trace_facts.graph_layers(graph)


def _refuse(monkeypatch):
    """Make computing any fact fail, so that only a read can give it."""
    def boom(*_a, **_k):
        raise AssertionError("computed, not read")
    for name in ("data_edges", "colocation", "layer_structure"):
        monkeypatch.setattr(trace_facts, name, boom)


def test_facts_equal_computing_them_and_a_later_run_reads_them(cache, monkeypatch):
    graph = _cached()
    edges, pairs, layers = _all(graph)
    assert edges == data_edges(graph) and pairs == colocation(graph, data_edges(graph))
    assert layers == layer_structure(graph) and list(layers.spans) == list(layer_structure(graph).spans)
    assert sorted(p.name.split(".")[1] for p in cache.iterdir()) == ["colocation", "edges", "layers"]
    again = _cached()  # a later run: another graph object read from the trace cache
    assert again is not graph
    _refuse(monkeypatch)
    assert _all(again) == (edges, pairs, layers)
    assert all(isinstance(b, float) for _, _, b in trace_facts.graph_edges(again))


def test_a_damaged_or_foreign_file_is_computed_again_and_rewritten(cache):
    graph = _cached()
    edges = trace_facts.graph_edges(graph)
    path = next(cache.glob("*.edges.json.gz"))
    path.write_bytes(path.read_bytes()[:-10])
    assert trace_facts.graph_edges(_cached()) == edges
    assert json.loads(gzip.decompress(path.read_bytes()))["graph"] == graph.hash  # rewritten whole
    path.write_bytes(gzip.compress(json.dumps({"graph": "another", "value": [[0, 1, 2.0]]}).encode()))
    assert trace_facts.graph_edges(_cached()) == edges


def test_a_graph_the_cache_did_not_give_is_computed_and_not_stored(cache):
    graph = trace_model("smollm2-135m", "decode", **SHAPE)
    assert trace_facts.graph_edges(graph) == data_edges(graph)
    assert trace_facts.graph_layers(graph) == layer_structure(graph)
    assert not cache.exists()


def test_a_layer_structure_error_is_kept_and_raised_again(cache, monkeypatch):
    graph = _cached()

    def interleaved(_graph):
        raise LayerStructureError("the kernels of layers 0 and 1 interleave")
    monkeypatch.setattr(trace_facts, "layer_structure", interleaved)
    with pytest.raises(LayerStructureError, match="interleave"):
        trace_facts.graph_layers(graph)
    _refuse(monkeypatch)
    with pytest.raises(LayerStructureError, match="layers 0 and 1 interleave"):
        trace_facts.graph_layers(_cached())  # read back from the file
