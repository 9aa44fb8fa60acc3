"""smollm2-135m with its real weights (tessera.capture.smollm2): the GGUF conversion and its cache, then
the model knows Paris, and meta-traced graphs replay it exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tessera.capture import smollm2 as smollm2_module
from tessera.capture.build import instantiate
from tessera.capture.eager import EagerRunner
from tessera.capture.phases import StepShape, build_model, step_for
from tessera.capture.pretrained import load_pretrained
from tessera.capture.smollm2 import smollm2_dir
from tessera.capture.trace import trace
from tessera.paths import default_cache_dir
from tessera.runtime.generate import ReplayRunner, generate
from tessera.weights import load_weights
from tests.capture.test_models import EXPECTED, n_params

PROMPT = "The capital of France is"
CTX = 64


# ---------------------------------------------------------------------------------------------------
# The conversion (run once into the cache by conftest's session fixture `smollm2_path`; about a minute
# the first time, then instant)


def test_smollm2_folder_layout(smollm2_path):
    smollm2 = smollm2_path
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert (smollm2 / "tokenizer.json").is_file()
    with torch.device("meta"):
        names = set(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smollm2)).state_dict())
    with safe_open(smollm2 / "model.safetensors", "pt") as f:
        assert set(f.keys()) == names - {"lm_head.weight"}
        assert f.metadata()["tied"] == "lm_head.weight=model.embed_tokens.weight"
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    assert smollm2_dir() == smollm2  # the second call finds the cache


def test_smollm2_knows_the_capital_of_france(smollm2_path):
    smollm2 = smollm2_path
    model = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert n_params(model) == EXPECTED["smollm2-135m"][2]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(out[0, inputs.input_ids.shape[1] :]).startswith(" Paris")


def test_cache_dir_follows_tessera_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("TESSERA_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "tessera"


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    def crash(gguf_dir, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2_module, "_convert_smollm2", crash)
    with pytest.raises(KeyboardInterrupt):
        smollm2_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------
# The converted model in Tessera


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    spec, model, values = load_pretrained("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    return spec, model, values, tokenizer


class _Recording:
    def __init__(self, runner):
        self.runner, self.logits = runner, []

    def __call__(self, phase, inputs):
        out = self.runner(phase, inputs)
        self.logits.append(out["logits"].clone())
        return out


def test_smollm2_answers_paris(smollm2):
    spec, model, values, tok = smollm2
    ids = tok(PROMPT).input_ids
    new = generate(EagerRunner(spec, model, values, slots=1, ctx=CTX), ids, 4)
    assert tok.decode(new).strip().startswith("Paris")


def test_meta_traced_prefill_and_decode_replay_equal_eager(smollm2, smollm2_path):
    spec, model, values, tok = smollm2
    ids = tok(PROMPT).input_ids
    meta, meta_values = instantiate(lambda: build_model("llm", model.config), "meta")
    graphs = {phase: trace(step_for(spec, meta, meta_values, phase,
                                    StepShape(batch=1, seq=len(ids), ctx=CTX), device="meta"))
              for phase in ("prefill", "decode")}
    names = sorted({n for g in graphs.values() for n in g.weight_names()})
    weights = load_weights(smollm2_path / "model.safetensors", names)
    eager = _Recording(EagerRunner(spec, model, values, slots=1, ctx=CTX))
    state = {k: torch.zeros_like(v) for k, v in step_for(
        spec, model, values, "decode", StepShape(batch=1, seq=1, ctx=CTX), device="cpu").state.items()}
    replay = _Recording(ReplayRunner(graphs, weights, state))
    expected = generate(eager, ids, 6)
    got = generate(replay, ids, 6)
    assert got == expected
    assert len(replay.logits) == len(eager.logits) >= 2
    for a, b in zip(replay.logits, eager.logits, strict=True):
        assert torch.equal(a, b)
    for name, t in state.items():
        assert torch.equal(t, eager.runner.state[name]), name
