"""smollm2-135m with its real weights: it knows Paris, and meta-traced graphs replay it exactly."""

from __future__ import annotations

import pytest
import torch

from tessera.capture.build import instantiate
from tessera.capture.eager import EagerRunner
from tessera.capture.phases import StepShape, build_model, step_for
from tessera.capture.pretrained import load_pretrained
from tessera.capture.trace import trace
from tessera.runtime.generate import ReplayRunner, generate
from tessera.weights import load_weights

PROMPT = "The capital of France is"
CTX = 64


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from transformers import AutoTokenizer

    spec, model, values = load_pretrained("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    return spec, model, values, tokenizer


class _Recording:
    def __init__(self, runner):
        self.runner, self.logits = runner, []

    def __call__(self, phase, inputs):
        out = self.runner(phase, inputs)
        self.logits.append(out.clone())
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
