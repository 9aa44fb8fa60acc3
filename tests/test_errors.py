"""Bad input gets a clear, specific error: what was wrong, where, and what to do."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tessera.capture.step import Step
from tessera.capture.trace import DataDependentOpError, trace
from tessera.cli.main import app

runner = CliRunner()


def _cli(*args):
    return runner.invoke(app, list(args))


def test_unknown_model_lists_the_catalog():
    r = _cli("trace", "llama-9000", "--phase", "decode")
    assert r.exit_code == 2
    for name in ("llama-3.1-8b", "gpt-oss-20b", "mamba-codestral-7b", "qwen2.5-vl-7b", "sd3.5-medium",
                 "qwen3-235b-a22b", "smollm2-135m"):
        assert name in r.output
    assert "llama-9000" in r.output


def test_model_name_is_checked_before_anything_else():
    r = _cli("trace", "nope-model", "--phase", "bogus", "--image", "garbage", "--batch", "0")
    assert r.exit_code == 2
    assert "nope-model" in r.output and "bogus" not in r.output


def test_malformed_config_names_file_and_field(tmp_path):
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama",')
    r = _cli("trace", str(bad), "--phase", "decode")
    assert r.exit_code == 2
    assert str(bad / "config.json") in r.output and "line" in r.output

    cfg = json.loads((__import__("tessera.capture.models", fromlist=["x"]).CATALOG_DIR
                      / "smollm2-135m" / "config.json").read_text())
    cfg["hidden_size"] = -5
    (bad / "config.json").write_text(json.dumps(cfg))
    r = _cli("trace", str(bad), "--phase", "decode")
    assert r.exit_code == 2
    assert "hidden_size" in r.output and str(bad / "config.json") in r.output


def test_impossible_shapes_are_rejected():
    r = _cli("trace", "smollm2-135m", "--phase", "decode", "--ctx", "100000")
    assert r.exit_code == 2 and "max_position_embeddings" in r.output and "8192" in r.output
    r = _cli("trace", "smollm2-135m", "--phase", "prefill", "--seq", "4096", "--ctx", "1024")
    assert r.exit_code == 2 and "--ctx" in r.output
    r = _cli("trace", "smollm2-135m", "--phase", "decode", "--batch", "0")
    assert r.exit_code == 2 and "--batch" in r.output


def test_wrong_phase_names_the_family_phases():
    r = _cli("trace", "smollm2-135m", "--phase", "step")
    assert r.exit_code == 2 and "prefill, decode" in r.output
    r = _cli("trace", "sd3.5-medium", "--phase", "prefill")
    assert r.exit_code == 2 and "encode, step, decode" in r.output


class _Router(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # a Python `if` on a tensor value: data-dependent
            return x * 2
        return x


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_data_dependent_op_names_op_module_and_static_alternative(device):
    router = torch.nn.Sequential(torch.nn.Identity(), _Router())
    step = Step(model="unit", family="test", phase="unit", modules={"net": router},
                fn=lambda inp, st, c: {"y": router(inp["x"])}, inputs={"x": torch.ones(4, device=device)},
                state={})
    with pytest.raises(DataDependentOpError) as e:
        trace(step)
    msg = str(e.value)
    assert "_local_scalar_dense" in msg and "net.1" in msg and "static" in msg


def test_bad_image_and_resolution_sizes():
    r = _cli("trace", "qwen2.5-vl-7b", "--phase", "encode", "--image", "504by504")
    assert r.exit_code == 2 and "WIDTHxHEIGHT" in r.output
    r = _cli("trace", "sd3.5-medium", "--phase", "decode", "--resolution", "0")
    assert r.exit_code == 2 and "positive" in r.output


def test_graph_file_errors(tmp_path):
    from tessera.graph.ir import GraphFormatError, KernelGraph

    p = tmp_path / "g.json"
    p.write_text("{not json")
    with pytest.raises(GraphFormatError, match="line 1"):
        KernelGraph.load(p)
    p.write_text(json.dumps({"version": 99, "kernels": []}))
    with pytest.raises(GraphFormatError, match="version 99"):
        KernelGraph.load(p)
    with pytest.raises(GraphFormatError, match="cannot read"):
        KernelGraph.load(tmp_path / "missing.json")


def test_full_size_model_on_cpu_is_refused_with_advice():
    r = _cli("trace", "llama-3.1-8b", "--phase", "decode", "--device", "cpu")
    assert r.exit_code == 2 and "meta" in r.output and "8,030,261,248" in r.output
