"""Traced graphs kept on disk: a hit is the graph a trace gives, any change of key misses, a damaged entry is
traced again, the switch turns it off, and a local model directory is never cached."""

from __future__ import annotations

import gzip
import json

import pytest

from tessera.capture import trace_cache
from tessera.capture.api import trace_model
from tessera.capture.trace_cache import entry_path, read, trace_key, trace_model_cached, write

SHAPE = dict(batch=4, ctx=96)


def _key(**change):
    key = trace_key("smollm2-135m", "decode", seq=None, image=None, resolution=None, slots=None, graph="production",
                    **SHAPE)
    return {**key, **change}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    monkeypatch.delenv(trace_cache.ENV_SWITCH, raising=False)
    return tmp_path / "traces"


def _traced(calls: list[str]):
    return trace_model_cached("smollm2-135m", "decode", **SHAPE, on_trace=lambda: calls.append("traced"))


def test_a_hit_is_the_graph_a_trace_gives(cache):
    calls: list[str] = []
    first = _traced(calls)
    again = _traced(calls)
    assert calls == ["traced"]  # the second call read the entry
    fresh = trace_model("smollm2-135m", "decode", **SHAPE)
    assert again == first and again.hash == fresh.hash == first.hash
    assert json.loads(again.to_json()) == json.loads(first.to_json())
    assert again.to_dict() | {"meta": None} == fresh.to_dict() | {"meta": None}  # the trace time differs
    assert len(list(cache.iterdir())) == 1


def test_to_json_is_the_text_of_to_dict(cache):
    g = _traced([])
    assert json.loads(g.to_json()) == json.loads(json.dumps(g.to_dict()))


def test_any_change_of_key_misses(cache):
    g = _traced([])
    assert read(_key(), cache) == g
    for change in (dict(code="0" * 64), dict(batch=5), dict(graph="eager"), dict(phase="prefill")):
        assert read(_key(**change), cache) is None
    # an entry found under another key's file name (a hash collision, a copied file) is not taken
    entry_path(_key(), cache).rename(entry_path(_key(batch=5), cache))
    assert read(_key(batch=5), cache) is None


def test_a_damaged_entry_is_traced_again_and_rewritten(cache):
    calls: list[str] = []
    g = _traced(calls)
    path = entry_path(_key(), cache)
    path.write_bytes(path.read_bytes()[:-40])  # truncated: gzip's length and CRC no longer match
    assert read(_key(), cache) is None
    again = _traced(calls)
    assert again.hash == g.hash
    assert calls == ["traced", "traced"]
    assert read(_key(), cache) == again
    path.write_bytes(gzip.compress(b"{}\nnot json"))
    assert read(_key(), cache) is None


def test_the_switch_turns_the_cache_off(cache, monkeypatch):
    monkeypatch.setenv(trace_cache.ENV_SWITCH, "0")
    calls: list[str] = []
    _traced(calls)
    _traced(calls)
    assert calls == ["traced", "traced"]
    assert not cache.exists()


def test_a_local_model_is_not_cached(tmp_path):
    folder = tmp_path / "my-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                    "hidden_size": 64, "num_hidden_layers": 2}))
    assert trace_key(str(folder), "decode", batch=1, seq=None, ctx=8, image=None, resolution=None, slots=None,
                     graph="production") is None


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    g = trace_model("smollm2-135m", "decode", **SHAPE)
    write(_key(), g, blocked / "traces")  # its folder cannot be made: nothing written, nothing raised
    assert read(_key(), blocked / "traces") is None
