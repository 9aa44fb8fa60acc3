"""The MoE block as an engine's seven kernels (capture.production.moe): numerics against Hugging Face's
blocks (gpt-oss bf16 and MXFP4, Qwen3-MoE), the kernels of a production gpt-oss layer, MXFP4 weight bytes.

Tolerances: the kernels compute what Hugging Face's expert loop computes, op for op in bf16 (same
matmuls per expert, bias added after the matmul, the k rows of a token summed in expert order), so on
the CPU the outputs are bit-identical in practice; the tests assert them within bf16 rounding
(atol 1e-2, rtol 1.6e-2) so that a different matmul blocking cannot fail them.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tessera.capture.build import instantiate
from tessera.capture.families.llm import llm_step
from tessera.capture.phases import build_model
from tessera.capture.production.moe import (
    Mxfp4Experts,
    apply_moe,
    apply_mxfp4,
    moe_forward,
    to_mxfp4_experts,
)
from tessera.capture.tiny import tiny_config
from tessera.capture.trace import trace

ATOL, RTOL = 1e-2, 1.6e-2
MOE_OPS = ["aten.addmm.default", "tessera.topk_gating.default", "tessera.moe_align.default",
           "tessera.moe_mxfp4_gemm.default", "tessera.swigluoai_and_mul.default",
           "tessera.moe_mxfp4_gemm.default", "tessera.moe_sum.default"]


def tiny_qwen3_moe_config(norm_topk_prob: bool = True):
    """A 2-layer, 64-wide Qwen3-MoE: 8 experts of width 32, top-2."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, decoder_sparse_step=1,
        max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")


def _randomise(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.2).to(p.dtype))
    return module


def _gpt_oss_mlp(seed: int = 0):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = tiny_config("moe")
    config._experts_implementation = "eager"
    return _randomise(GptOssMLP(config).to(torch.bfloat16), seed)


def _qwen3_block(norm_topk_prob: bool, seed: int = 0):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = tiny_qwen3_moe_config(norm_topk_prob)
    config._experts_implementation = "eager"
    return _randomise(Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16), seed)


def _tokens(t: int = 24, h: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------------------------------
# Numerics against Hugging Face's blocks


def test_gpt_oss_block_matches_hugging_face():
    ref = _gpt_oss_mlp()
    mlp = copy.deepcopy(ref)
    x = _tokens()
    with torch.no_grad():
        expected, expected_scores = ref(x[None])
        _close(moe_forward(mlp, x), expected[0])
        assert "forward" not in vars(mlp)  # moe_forward leaves the block's own forward to its caller
        apply_moe(mlp)
        out, scores = mlp(x[None])  # the rewired block keeps Hugging Face's return value
    _close(out, expected)
    assert torch.equal(scores, expected_scores)
    assert [n for n, _ in mlp.named_parameters()] == [n for n, _ in ref.named_parameters()]


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_block_matches_hugging_face(norm_topk_prob):
    ref = _qwen3_block(norm_topk_prob)
    block = copy.deepcopy(ref)
    x = _tokens()
    with torch.no_grad():
        expected = ref(x[None])
        _close(moe_forward(block, x), expected[0])
        _close(block(x[None]), expected)


def test_mxfp4_block_matches_hugging_face_on_round_tripped_weights():
    """MXFP4 experts against Hugging Face's bf16 experts holding the same (dequantised) values."""
    ref = _gpt_oss_mlp()
    mlp = copy.deepcopy(ref)
    mlp.experts = to_mxfp4_experts(ref.experts)
    assert isinstance(mlp.experts, Mxfp4Experts)
    gate_up, down = mlp.experts.dequantized(torch.bfloat16)
    with torch.no_grad():
        assert (gate_up - ref.experts.gate_up_proj).abs().max() > 0  # the quantisation did something
        ref.experts.gate_up_proj.copy_(gate_up)
        ref.experts.down_proj.copy_(down)
        x = _tokens()
        expected, _ = ref(x[None])
        _close(moe_forward(mlp, x), expected[0])
    names = [n for n, _ in mlp.experts.named_parameters()]
    assert names == ["gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
                     "down_proj_scales", "down_proj_bias"]
    assert mlp.experts.gate_up_proj_blocks.dtype == torch.uint8
    assert not mlp.experts.gate_up_proj_blocks.requires_grad


def _logits(model, constants, ids):
    step = llm_step(model, constants, model_name="tiny", family="moe", phase="prefill", batch=ids.shape[0],
                    seq=ids.shape[1], ctx=32, device="cpu")
    step.inputs["input_ids"].copy_(ids)
    return step.run()["logits"]


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_whole_model_with_moe_kernels_matches_eager(family):
    """A tiny model whose every block runs the MoE kernels, against the eager Hugging Face model (logits
    of the last position and the greedy token)."""
    config = tiny_config("moe") if family == "gpt_oss" else tiny_qwen3_moe_config()
    model, constants = instantiate(lambda: build_model("moe", config, torch.bfloat16, graph="eager"), "cpu")
    _randomise(model)
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    expected = _logits(model, constants, ids)
    for layer in model.model.layers:
        apply_moe(layer.mlp)
    got = _logits(model, constants, ids)
    _close(got, expected)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


# ---------------------------------------------------------------------------------------------------
# Kernels of a production layer, weights in MXFP4


def _gpt_oss_20b_mxfp4():
    from tessera.capture.models import load_config, resolve_model

    config = load_config(resolve_model("gpt-oss-20b"))

    def factory():
        model = build_model("moe", config, torch.bfloat16, graph="eager")
        for layer in model.model.layers:
            apply_moe(layer.mlp)
        assert apply_mxfp4(model) == config.num_hidden_layers
        return model

    return instantiate(factory, "meta")


@pytest.fixture(scope="module")
def gpt_oss_20b():
    return _gpt_oss_20b_mxfp4()


def test_gpt_oss_20b_layer_moe_is_seven_kernels(gpt_oss_20b):
    model, constants = gpt_oss_20b
    for phase, batch, seq in (("decode", 16, 1), ("prefill", 2, 16)):
        graph = trace(llm_step(model, constants, model_name="gpt-oss-20b", family="moe", phase=phase,
                               batch=batch, seq=seq, ctx=64))
        for layer in (0, 1):
            moe = [k for k in graph.kernels if k.layer == layer and ".mlp" in k.scope]
            assert [k.op for k in moe] == MOE_OPS, phase
            scopes = [k.scope for k in moe]
            assert scopes == [f"model.layers.{layer}.mlp.router"] * 2 + [f"model.layers.{layer}.mlp.experts"] * 5
        gemms = [k for k in graph.kernels if k.layer == 0 and k.op == "tessera.moe_mxfp4_gemm.default"]
        t = batch * seq
        # the weight (blocks [E, N, K/32, 16]) is the second tensor argument: the cost model's expert count
        assert [k.shapes[1] for k in gemms] == [[32, 5760, 90, 16], [32, 2880, 90, 16]]
        assert [k.flops for k in gemms] == [2 * t * 4 * 5760 * 2880, 2 * t * 4 * 2880 * 2880]


def test_gpt_oss_20b_mxfp4_weight_bytes(gpt_oss_20b):
    model, _ = gpt_oss_20b
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert all(p.device.type == "meta" for p in model.parameters())
    # reference (production-kernels.md §2): 10.15 GB of experts (+ 13 MB of bf16 biases), ~13.8 GB in all
    assert 10.10e9 < experts < 10.20e9, experts
    assert 13.7e9 < total < 13.9e9, total
    names = {n for n, _ in model.named_parameters()}
    assert {"model.layers.3.mlp.experts.gate_up_proj_blocks", "model.layers.3.mlp.experts.gate_up_proj_scales",
            "model.layers.3.mlp.experts.down_proj_blocks", "model.layers.3.mlp.experts.down_proj_bias"} <= names
    assert "model.layers.3.mlp.experts.gate_up_proj" not in names


def test_meta_and_cpu_traces_have_the_same_kernels():
    config = tiny_config("moe")

    def factory():
        model = build_model("moe", config, torch.bfloat16, graph="eager")
        for layer in model.model.layers:
            apply_moe(layer.mlp)
        apply_mxfp4(model)
        return model

    graphs = []
    for device in ("meta", "cpu"):
        model, constants = instantiate(factory, device)
        graphs.append(trace(llm_step(model, constants, model_name="tiny", family="moe", phase="decode",
                                     batch=3, seq=1, ctx=16, device=device)))
    meta, cpu = ([(k.op, k.scope, k.shapes) for k in g.kernels] for g in graphs)
    assert meta == cpu
    assert sum(k.op == "tessera.moe_mxfp4_gemm.default" for k in graphs[0].kernels) == 4
