"""The graph kinds: production by default, eager on request, and a stated fallback for model types without
fused units."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tessera.capture.api import trace_model
from tessera.capture.production import GraphKindError, apply_production
from tessera.cli.main import app

runner = CliRunner()


def _gemma_dir(tmp_path):
    """A tiny local Gemma model: a dense LLM type Tessera has no fused units for."""
    from transformers import GemmaConfig

    folder = tmp_path / "tiny-gemma"
    folder.mkdir()
    GemmaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                architectures=["GemmaForCausalLM"]).save_pretrained(folder)
    return folder


def test_an_unknown_graph_kind_is_a_clear_error():
    with pytest.raises(GraphKindError, match="--graph 'fused' is not a kernel-graph kind; use one of production, "
                                             "eager"):
        trace_model("smollm2-135m", "decode", batch=1, ctx=16, graph="fused")
    result = runner.invoke(app, ["trace", "smollm2-135m", "--graph", "fused"])
    assert result.exit_code != 0
    assert "not a kernel-graph kind" in result.output


def test_a_model_type_without_fused_units_falls_back_and_says_so(tmp_path):
    folder = _gemma_dir(tmp_path)
    graph = trace_model(str(folder), "decode", batch=1, ctx=16)
    assert graph.meta["graph"] == "production"
    assert len(graph.meta["fallbacks"]) == 1
    assert "model type 'gemma' has no fused units" in graph.meta["fallbacks"][0]
    eager = trace_model(str(folder), "decode", batch=1, ctx=16, graph="eager")
    assert [k.op for k in eager.kernels] == [k.op for k in graph.kernels]  # the fallback is the eager graph
    result = runner.invoke(app, ["trace", str(folder), "--ctx", "16", "--batch", "1"])
    assert result.exit_code == 0, result.output
    assert "fallback: model type 'gemma' has no fused units" in " ".join(result.output.split())
    summary = json.loads(runner.invoke(app, ["trace", str(folder), "--ctx", "16", "--json"]).output)
    assert summary["graph_kind"] == "production" and summary["fallbacks"]


def test_eager_leaves_the_model_as_transformers_built_it():
    from tessera.capture.build import instantiate
    from tessera.capture.phases import build_model
    from tessera.capture.tiny import tiny_config

    config = tiny_config("llm")
    model, _ = instantiate(lambda: build_model("llm", config, graph="eager"), "meta")
    report = model.tessera_fusion
    assert report.graph == "eager" and not report.fused and not report.fallbacks
    assert all("forward" not in vars(m) for m in model.modules())  # no instance forward was replaced
    with pytest.raises(GraphKindError):
        apply_production(model, config, "hf")
