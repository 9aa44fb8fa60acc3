"""Production graphs of decoder LLMs (tessera.capture.production.decoder) against Hugging Face eager.

Numerics: the same weights built as graph="eager" and graph="production" run a prefill and several decode
steps (batch 2, rows in swapped cache slots at different positions for the tiny models). Tolerance: the
largest absolute logit difference must stay within ``TOL`` (1%) of the largest absolute logit, and the
greedy tokens must be equal. On the CPU the fused bodies reproduce Hugging Face's operations in the same
dtypes, so the measured difference is 0 (bit-identical logits) for the tiny Llama, the tiny GPT-oss
(attention side; its MoE MLP keeps the Hugging Face forward until `moe_forward` exists), the tiny
Qwen2.5-VL text decoder and smollm2-135m with its real weights.

Kernel counts: a production Llama decode layer is exactly the 10 fused units of a vLLM layer.
"""

from __future__ import annotations

import pytest
import torch

from tessera.capture.build import instantiate
from tessera.capture.families.llm import llm_step, new_kv_cache
from tessera.capture.models import resolve_model
from tessera.capture.phases import StepShape, build_model, step_for
from tessera.capture.production import fusion_of
from tessera.capture.production.moe import Mxfp4Experts
from tessera.capture.tiny import tiny_config
from tessera.capture.trace import trace

TOL = 0.01  # max |logits diff| <= TOL * max |logit|
NEW_TOKENS = 8
LLAMA_LAYER = ["add_rms_norm", "merged_linear", "rotary_", "kv_write", "decode_attention", "mm", "add_rms_norm",
               "merged_linear", "silu_and_mul", "mm"]


def _pair(family: str, config):
    """The same weights as an eager and a production model. Where production holds weights in a packed format
    (GPT-oss's MXFP4 experts), the eager model gets the bf16 values the packed weights stand for."""
    eager, values = instantiate(lambda: build_model(family, config, graph="eager"), "cpu", seed=0)
    prod, _ = instantiate(lambda: build_model(family, config, graph="production"), "cpu", seed=1)
    shared = {k: v for k, v in eager.state_dict().items() if k in prod.state_dict()}
    missing, _ = prod.load_state_dict(shared, strict=False)
    with torch.no_grad():
        for e_mod, p_mod in zip(eager.modules(), prod.modules(), strict=True):
            if isinstance(p_mod, Mxfp4Experts):
                gate_up, down = p_mod.dequantized()
                e_mod.gate_up_proj.copy_(gate_up)
                e_mod.down_proj.copy_(down)
    assert all(m.endswith(("_blocks", "_scales")) for m in missing), missing
    return eager, prod, values


def _generate(model, values, family: str, prompt: torch.Tensor, ctx: int, slots: torch.Tensor,
              new_tokens: int = NEW_TOKENS) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill ``prompt`` [B,S] into cache rows ``slots``, then greedy decode; (logits per step, tokens)."""
    batch, seq = prompt.shape
    dtype = next(model.parameters()).dtype
    state = new_kv_cache(model.config, int(slots.max()) + 1, ctx, dtype, "cpu")
    common = dict(model_name="m", family=family, batch=batch, ctx=ctx, device="cpu", state=state,
                  slots=int(slots.max()) + 1)
    with torch.no_grad():
        step = llm_step(model, values, phase="prefill", seq=seq, inputs={"input_ids": prompt, "slots": slots},
                        **common)
        logits = [step.run()["logits"]]
        tokens = [logits[-1][:, -1].argmax(-1)]
        for t in range(new_tokens - 1):
            inputs = {"input_ids": tokens[-1][:, None], "positions": torch.full((batch,), seq + t), "slots": slots}
            logits.append(llm_step(model, values, phase="decode", seq=1, inputs=inputs, **common).run()["logits"])
            tokens.append(logits[-1][:, -1].argmax(-1))
    return logits, [t.tolist() for t in tokens]


def _assert_close(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    worst = 0.0
    for a, b in zip(ref, got, strict=True):
        diff = float((a.float() - b.float()).abs().max())
        scale = float(a.float().abs().max())
        assert diff <= TOL * scale, (diff, scale)
        worst = max(worst, diff / scale)
    return worst


@pytest.mark.parametrize("family", ["llm", "moe"])
def test_tiny_production_matches_eager(family):
    config = tiny_config(family)
    eager, prod, values = _pair(family, config)
    report = fusion_of(prod)
    assert report.graph == "production" and any("merged QKV" in f for f in report.fused)
    if family == "moe":  # attention fused; the MoE MLP is reported wherever it goes
        assert any("MoE" in f for f in report.fused + report.fallbacks)
    prompt = torch.randint(3, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    slots = torch.tensor([1, 0])
    ref_logits, ref_tokens = _generate(eager, values, family, prompt, 32, slots)
    logits, tokens = _generate(prod, values, family, prompt, 32, slots)
    assert tokens == ref_tokens
    _assert_close(ref_logits, logits)


def _variant(kind: str):
    from transformers import MistralConfig, Qwen2Config, Qwen3MoeConfig

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, dtype="bfloat16")
    if kind == "qwen2":  # q/k/v biases, tied embeddings
        return Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "mistral":  # sliding window shorter than the generated sequence
        return MistralConfig(**common, head_dim=16, sliding_window=4)
    # Qwen3-MoE: per-head q/k RMSNorms; layer 0 dense (mlp_only_layers), layer 1 MoE
    return Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          mlp_only_layers=[0], decoder_sparse_step=1)


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "qwen3_moe"])
def test_other_decoders_match_eager(kind):
    config = _variant(kind)
    eager, prod, values = _pair("llm", config)
    report = fusion_of(prod)
    assert any("merged gate_up" in f for f in report.fused)
    prompt = torch.randint(3, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(4))
    slots = torch.tensor([1, 0])
    ref_logits, ref_tokens = _generate(eager, values, "llm", prompt, 32, slots)
    logits, tokens = _generate(prod, values, "llm", prompt, 32, slots)
    assert tokens == ref_tokens
    _assert_close(ref_logits, logits)


def test_production_llama_decode_layer_is_ten_fused_units():
    spec = resolve_model("smollm2-135m")
    config = tiny_config("llm")
    meta, values = instantiate(lambda: build_model("llm", config), "meta")
    g = trace(step_for(spec, meta, values, "decode", StepShape(batch=2, seq=6, ctx=16), device="meta"))
    names = [k.op.split(".")[1] for k in g.kernels]
    layers = config.num_hidden_layers
    # layer 0 norms the embedding (its residual); later layers add the carried residual first
    assert names == ["embedding", "rms_norm"] + (LLAMA_LAYER * layers)[1:] + ["add_rms_norm", "mm", "sample"]
    assert [k.layer for k in g.kernels[1:-3]] == [i for i in range(layers) for _ in LLAMA_LAYER]
    qkv = g.kernels[2]
    assert qkv.op_class == "gemm" and qkv.scope == "model.layers.0.self_attn"
    assert [k.scope for k in g.kernels if k.op.endswith("silu_and_mul.default")] == \
        [f"model.layers.{i}.mlp" for i in range(layers)]


def test_production_llama_prefill_has_the_same_layer():
    spec = resolve_model("smollm2-135m")
    meta, values = instantiate(lambda: build_model("llm", tiny_config("llm")), "meta")
    g = trace(step_for(spec, meta, values, "prefill", StepShape(batch=2, seq=6, ctx=16), device="meta"))
    names = [k.op.split(".")[1] for k in g.kernels]
    prefill_layer = [n if n != "decode_attention" else "prefill_attention" for n in LLAMA_LAYER]
    # the LM head on the last position of each row (a strided [B,1,H] view) is one bmm; the sampler ends the step
    assert names == ["embedding", "rms_norm"] + (prefill_layer * 2)[1:] + ["add_rms_norm", "bmm", "sample"]


def test_unsupported_rope_falls_back_to_eager():
    config = tiny_config("llm")
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    meta, _ = instantiate(lambda: build_model("llm", config), "meta")
    report = fusion_of(meta)
    assert report.fused == [] and "dynamic" in report.fallbacks[0]


def test_tiny_qwen2_5_vl_text_decoder_matches_eager():
    from tessera.capture.families.vlm import image_grid, vlm_step
    from tessera.capture.production.decoder import apply_text_decoder

    config = tiny_config("vlm")
    eager, values = instantiate(lambda: build_model("vlm", config, graph="eager"), "cpu", seed=0)
    prod, _ = instantiate(lambda: build_model("vlm", config, graph="eager"), "cpu", seed=1)
    prod.load_state_dict(eager.state_dict())
    report = apply_text_decoder(prod.model.language_model, rope="mrope")
    assert not report.fallbacks and any("mrope_" in f for f in report.fused)
    image, batch, seq, ctx = (56, 56), 2, 10, 24
    grid = image_grid(config.vision_config, image)
    g = torch.Generator().manual_seed(5)
    results = {}
    for name, model in (("eager", eager), ("production", prod)):
        common = dict(model_name="m", batch=batch, seq=seq, ctx=ctx, image=image, device="cpu")
        pre = vlm_step(model, values, phase="prefill", **common)
        if not results:
            ids = pre.inputs["input_ids"]
            text = ids == 0
            ids[text] = torch.randint(0, 400, (int(text.sum()),), generator=g)
            embeds = torch.randn(pre.inputs["image_embeds"].shape, generator=g).bfloat16()
            saved = (ids.clone(), embeds)
        pre.inputs["input_ids"].copy_(saved[0])
        pre.inputs["image_embeds"].copy_(saved[1])
        with torch.no_grad():
            logits = [pre.run()["logits"]]
            tokens = [logits[-1][:, -1].argmax(-1)]
            delta = pre.meta["rope_delta"]
            for t in range(4):
                inputs = {"input_ids": tokens[-1][:, None], "positions": torch.full((batch,), seq + t + delta),
                          "cache_positions": torch.full((batch,), seq + t), "slots": torch.arange(batch)}
                dec = vlm_step(model, values, phase="decode", inputs=inputs, state=pre.state, **common)
                logits.append(dec.run()["logits"])
                tokens.append(logits[-1][:, -1].argmax(-1))
        results[name] = (logits, [t.tolist() for t in tokens])
    assert grid.tokens == 4
    assert results["production"][1] == results["eager"][1]
    _assert_close(results["eager"][0], results["production"][0])


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_path):
    from tessera.capture.pretrained import load_pretrained

    spec, eager, values = load_pretrained("smollm2-135m", graph="eager")
    _, prod, _ = load_pretrained("smollm2-135m", graph="production")
    return eager, prod, values


def test_smollm2_production_matches_eager(smollm2_pair, smollm2_path):
    from transformers import AutoTokenizer

    eager, prod, values = smollm2_pair
    assert prod.lm_head.weight.data_ptr() == prod.model.embed_tokens.weight.data_ptr()  # still tied
    assert not fusion_of(prod).fallbacks
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompt = torch.tensor([tok("The capital of France is").input_ids])
    slots = torch.tensor([0])
    ref_logits, ref_tokens = _generate(eager, values, "llm", prompt, 64, slots)
    logits, tokens = _generate(prod, values, "llm", prompt, 64, slots)
    assert tokens == ref_tokens
    assert tok.decode([t[0] for t in tokens]).strip().startswith("Paris")
    _assert_close(ref_logits, logits)
