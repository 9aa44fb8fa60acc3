"""Mamba2's production graph (tessera.capture.production.mamba2) against Hugging Face's eager model.

Numerics: the tiny SSM built from the same seed as the production and the eager graph; a prefill of a
prompt that is not a multiple of the chunk (so the SSD padding is exercised) into slots that are not the
rows' indices, then greedy decode steps, each model feeding back its own argmax:

- float32 model, float32 SSM state: logits within 1e-5 (absolute) of eager at every step (measured: 5e-7),
  states within 1e-5;
- bfloat16 model, float32 SSM state (Hugging Face's cache dtype): logits within 0.05 (measured: 0.016, one
  bf16 ulp at the logits' magnitude of ~3), greedy tokens equal;
- bfloat16 model, bfloat16 SSM state (the production default, vLLM's ``mamba_ssm_cache_dtype="auto"``):
  logits within 0.05 (measured: 0.016), greedy tokens equal.
The bf16 differences come from the production kernels' dtypes (the SSD scan output and the chunk-start
states in the model dtype, as mamba_ssm writes them; Hugging Face keeps both in float32).

Structure: the kernel sequence of each layer on meta is exactly the intended one (decode 6, prefill 10).
"""

from __future__ import annotations

import pytest
import torch

from tessera.capture.build import instantiate
from tessera.capture.families.ssm import new_ssm_state
from tessera.capture.models import resolve_model
from tessera.capture.phases import StepShape, build_model, step_for
from tessera.capture.tiny import tiny_config
from tessera.capture.trace import trace

SPEC = resolve_model("mamba-codestral-7b")
BATCH, PROMPT, SLOTS, STEPS = 2, 11, 3, 6
ROW_SLOTS = torch.tensor([2, 0])

DECODE_LAYER = ["tessera.mamba_add_rms_norm", "aten.mm", "tessera.causal_conv1d_update",
                "tessera.selective_state_update", "tessera.gated_rms_norm", "aten.mm"]
PREFILL_LAYER = ["tessera.mamba_add_rms_norm", "aten.mm", "tessera.causal_conv1d", "tessera.ssd_chunk_cumsum",
                 "tessera.ssd_chunk_state", "tessera.ssd_state_passing", "tessera.ssd_bmm_chunk",
                 "tessera.ssd_chunk_scan", "tessera.gated_rms_norm", "aten.mm"]


def _build(graph: str, dtype: torch.dtype, device: str = "cpu"):
    config = tiny_config("ssm")
    return instantiate(lambda: build_model("ssm", config, dtype, graph=graph), device, seed=0)


def _generate(graph: str, dtype: torch.dtype, ssm_dtype: torch.dtype):
    """Logits of the prefill and of STEPS greedy decode steps, the tokens fed, and the final state."""
    model, values = _build(graph, dtype)
    state = new_ssm_state(model.config, SLOTS, dtype, "cpu", ssm_dtype)
    prompt = torch.randint(0, model.config.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(3))
    step = step_for(SPEC, model, values, "prefill", StepShape(BATCH, PROMPT, 32, slots=SLOTS), "cpu", state=state)
    step.inputs["input_ids"].copy_(prompt)
    step.inputs["slots"].copy_(ROW_SLOTS)
    logits = [step.fn(step.inputs, state, {})["logits"]]
    tokens = []
    decode = step_for(SPEC, model, values, "decode", StepShape(BATCH, 1, 32, slots=SLOTS), "cpu", state=state)
    for i in range(STEPS):
        token = logits[-1][:, -1].argmax(-1)
        tokens.append(token)
        decode.inputs["input_ids"].copy_(token[:, None])
        decode.inputs["positions"].fill_(PROMPT + i)
        decode.inputs["slots"].copy_(ROW_SLOTS)
        logits.append(decode.fn(decode.inputs, state, {})["logits"])
    return logits, torch.stack(tokens, 1), state


@pytest.mark.parametrize("dtype,ssm_dtype,tol", [
    (torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.float32, 0.05),
    (torch.bfloat16, torch.bfloat16, 0.05),
])
def test_production_matches_eager_through_prefill_and_greedy_decode(dtype, ssm_dtype, tol):
    eager_logits, eager_tokens, eager_state = _generate("eager", dtype, torch.float32)
    logits, tokens, state = _generate("production", dtype, ssm_dtype)
    for i, (got, want) in enumerate(zip(logits, eager_logits, strict=True)):
        assert got.shape == want.shape
        err = (got - want).abs().max().item()
        assert err <= tol, f"step {i}: logits differ by {err} (tolerance {tol})"
    assert torch.equal(tokens, eager_tokens)
    if dtype == torch.float32:
        for name, want in eager_state.items():
            torch.testing.assert_close(state[name].float(), want.float(), atol=1e-5, rtol=1e-4, msg=name)
    untouched = [s for s in range(SLOTS) if s not in ROW_SLOTS.tolist()]
    assert all(not state[name][untouched].any() for name in state), "a slot no row names was written"


def _layer_ops(graph, layer: int) -> list[str]:
    return [".".join(k.op.split(".")[:2]) for k in graph.kernels if k.layer == layer]


@pytest.mark.parametrize("phase,expected", [("decode", DECODE_LAYER), ("prefill", PREFILL_LAYER)])
def test_each_layer_runs_the_intended_kernels(phase, expected):
    model, values = _build("production", torch.bfloat16, "meta")
    g = trace(step_for(SPEC, model, values, phase, StepShape(BATCH, PROMPT if phase == "prefill" else 1, 32),
                       "meta"))
    layers = sorted({k.layer for k in g.kernels if k.layer is not None})
    assert layers == [0, 1]
    for layer in layers:
        assert _layer_ops(g, layer) == expected
    mixer = [k for k in g.kernels if k.layer == 0 and k.scope.endswith("mixer")]
    assert {k.op.split(".")[1] for k in mixer} <= {"causal_conv1d_update", "selective_state_update",
                                                   "causal_conv1d", "ssd_chunk_cumsum", "ssd_chunk_state",
                                                   "ssd_state_passing", "ssd_bmm_chunk", "ssd_chunk_scan"}
    outside = [".".join(k.op.split(".")[:2]) for k in g.kernels if k.layer is None]
    # embedding; final add + RMSNorm; LM head; logits to float32; the sampler
    assert outside == ["aten.embedding", "tessera.mamba_add_rms_norm", "aten.mm", "aten._to_copy", "tessera.sample"]
    assert g.meta["graph"] == "production" and "fallbacks" not in g.meta
    ssm = g.buffers["cache.layer0.ssm"]
    assert ssm.kind == "state" and ssm.dtype == "bfloat16"  # vLLM's mamba_ssm_cache_dtype "auto"


def test_the_eager_graph_keeps_float32_state():
    model, values = _build("eager", torch.bfloat16, "meta")
    g = trace(step_for(SPEC, model, values, "decode", StepShape(BATCH, 1, 32), "meta"))
    assert g.buffers["cache.layer0.ssm"].dtype == "float32"


@pytest.mark.parametrize("phase,batch,seq,per_layer", [("decode", 64, 1, 6), ("prefill", 1, 2048, 10)])
def test_codestral_kernel_counts_on_meta(phase, batch, seq, per_layer):
    from tessera.capture.api import trace_model

    g = trace_model("mamba-codestral-7b", phase, batch=batch, seq=seq, ctx=2048)
    layers = 64
    assert len(g.kernels) == layers * per_layer + 5  # embedding, final norm, LM head, cast, sampler
    print(f"mamba-codestral-7b {phase} batch {batch} seq {seq}: {len(g.kernels)} kernels "
          f"({per_layer} per layer)")
