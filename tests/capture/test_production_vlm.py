"""Qwen2.5-VL production graph: the fused vision tower against the eager one, its kernel sequence, counts.

Tolerances: the production encode is compared with the eager (``graph="eager"``) tower on the same weights
within ``atol = rtol = 1e-2`` in bf16 (the fused units compute what Hugging Face's modules compute, with
the same casts; on the CPU the two agree bit for bit today, which the test prints). Text prefill / decode
logits are compared within ``2e-2`` (as tests/capture/test_vlm.py does against Hugging Face) and greedy
tokens must be equal (the text decoder must be the production one: a fallback to Hugging Face's forward
fails the test, naming it).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tessera.capture.build import instantiate
from tessera.capture.families.vlm import image_grid, vlm_step
from tessera.capture.phases import build_model
from tessera.capture.production import fusion_of
from tessera.capture.tiny import tiny_config
from tessera.capture.trace import trace
from tessera.program.program import single_device_program
from tessera.runtime.executor import Executor
from tessera.weights import unique_state

CATALOG = Path(__file__).resolve().parents[2] / "src" / "tessera" / "capture" / "catalog" / "qwen2.5-vl-7b"
IMAGE = (112, 84)  # 8 x 6 patches, 4 x 3 merged tokens, 4 attention windows of unequal size
BATCH, SEQ, CTX, START = 2, 20, 32, 3
ENCODE_TOL = {"atol": 1e-2, "rtol": 1e-2}
TEXT_TOL = {"atol": 2e-2, "rtol": 2e-2}

# One vision block of the production graph: (scope relative to model.visual.blocks.<i>, op)
BLOCK = [
    ("norm1", "tessera.rms_norm.default"),
    ("attn.qkv", "aten.addmm.default"),
    ("attn", "tessera.vision_rotary_.default"),
    ("attn", "tessera.segment_attention.default"),
    ("attn.proj", "aten.addmm.default"),
    ("norm2", "tessera.add_rms_norm.default"),
    ("mlp", "tessera.merged_linear.default"),
    ("mlp", "tessera.silu_and_mul.default"),
    ("mlp.down_proj", "aten.addmm.default"),
    ("", "aten.add.Tensor"),
]
HEAD = [  # before the blocks, once per encode
    ("model.visual.patch_embed", "aten.mm.default"),
    ("model.visual", "aten.index_select.default"),
    ("model.visual.rotary_pos_emb", "tessera.vision_rope_cos_sin.default"),
]
TAIL = [  # after the blocks
    ("model.visual.merger.ln_q", "tessera.rms_norm.default"),
    ("model.visual.merger.mlp.0", "aten.addmm.default"),
    ("model.visual.merger.mlp.1", "aten.gelu.default"),
    ("model.visual.merger.mlp.2", "aten.addmm.default"),
    ("model.visual", "aten.index_select.default"),
]


def _build(cfg, graph: str, device: str, seed: int = 0):
    return instantiate(lambda: build_model("vlm", cfg, graph=graph), device, seed=seed)


@pytest.fixture(scope="module")
def tiny():
    """Eager and production tiny models with the same weights on the CPU, and the production one on meta."""
    cfg = tiny_config("vlm")
    eager, eager_consts = _build(cfg, "eager", "cpu")
    prod, prod_consts = _build(cfg, "production", "cpu", seed=1)
    prod.load_state_dict(eager.state_dict())
    meta, meta_consts = _build(cfg, "production", "meta")
    return cfg, (eager, eager_consts), (prod, prod_consts), (meta, meta_consts)


def _text_decoder_missing(model) -> str | None:
    report = fusion_of(model)
    missing = [f for f in report.fallbacks if f.startswith("text decoder:")]
    return missing[0] if missing else None


def _kw(phase: str, image=IMAGE) -> dict:
    return {"model_name": "tiny-vlm", "phase": phase, "batch": BATCH, "seq": SEQ, "ctx": CTX, "image": image,
            "image_start": START}


def _pixels(grid, images: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(images * grid.patches, grid.patch_dim, generator=g).to(torch.bfloat16)


def _encode(model, consts, image, pixels) -> torch.Tensor:
    step = vlm_step(model, consts, device="cpu", **_kw("encode", image=image))
    step.inputs["pixel_values"].copy_(pixels)
    return step.run()["image_embeds"]


# ---------------------------------------------------------------------------------------------------
# The report


def test_fusion_report_names_the_vision_units_and_the_text_decoder(tiny):
    _, _, (prod, _), _ = tiny
    report = fusion_of(prod)
    assert report.graph == "production"
    assert "vision: vision_rotary_" in report.fused and "vision: segment_attention" in report.fused
    missing = _text_decoder_missing(prod)
    if missing is not None:
        assert "apply_text_decoder" in missing
    else:
        assert any(u.startswith("text: ") for u in report.fused)
    # parameter names are Hugging Face's
    eager = tiny[1][0]
    assert list(dict(prod.named_parameters())) == list(dict(eager.named_parameters()))


# ---------------------------------------------------------------------------------------------------
# Numerics: production encode == eager encode


@pytest.mark.parametrize("image", [IMAGE, (56, 56)])
def test_encode_matches_eager(tiny, image):
    cfg, (eager, eager_consts), (prod, prod_consts), _ = tiny
    grid = image_grid(cfg.vision_config, image)
    pixels = _pixels(grid, BATCH)
    ref = _encode(eager, eager_consts, image, pixels)
    ours = _encode(prod, prod_consts, image, pixels)
    assert ours.shape == ref.shape == (BATCH * grid.tokens, cfg.text_config.hidden_size)
    diff = (ours.float() - ref.float()).abs().max().item()
    print(f"encode {image[0]}x{image[1]}: max |production - eager| = {diff:.3g} "
          f"(max |eager| = {ref.float().abs().max().item():.3g})")
    torch.testing.assert_close(ours.float(), ref.float(), **ENCODE_TOL)


def test_production_tower_runs_hugging_face_calls(tiny):
    """Called as Hugging Face's model calls its tower (grid_thw on the host), it gives the encode step's result."""
    cfg, _, (prod, consts), _ = tiny
    grid = image_grid(cfg.vision_config, IMAGE)
    pixels = _pixels(grid, BATCH)
    step_out = _encode(prod, consts, IMAGE, pixels)
    with torch.no_grad():
        out = prod.model.visual(pixels, grid_thw=torch.tensor([[1, grid.h, grid.w]] * BATCH))
    assert torch.equal(out.pooler_output, step_out)
    with pytest.raises(NotImplementedError, match="images of one size"):
        prod.model.visual(pixels, grid_thw=torch.tensor([[1, grid.h, grid.w], [1, grid.w, grid.h]]))


def _greedy_chain(model, consts, cfg, pixels):
    """encode -> prefill (image embeddings spliced in) -> one greedy decode step: (prefill, decode) logits."""
    enc = vlm_step(model, consts, device="cpu", **_kw("encode"))
    enc.inputs["pixel_values"].copy_(pixels)
    pre = vlm_step(model, consts, device="cpu", **_kw("prefill"))
    ids = pre.inputs["input_ids"]
    g = torch.Generator().manual_seed(3)
    ids.copy_(torch.where(ids == 0, torch.randint(0, 400, ids.shape, generator=g), ids))
    pre.inputs["image_embeds"].copy_(enc.run()["image_embeds"])
    pre_logits = pre.run()["logits"]
    dec = vlm_step(model, consts, device="cpu", state=pre.state, **_kw("decode"))
    dec.inputs["input_ids"].copy_(pre_logits[:, 0].argmax(-1, keepdim=True))
    dec.inputs["cache_positions"].fill_(SEQ)
    dec.inputs["positions"].fill_(SEQ + pre.meta["rope_delta"])
    return pre_logits, dec.run()["logits"]


def test_prefill_and_decode_match_eager(tiny):
    cfg, (eager, eager_consts), (prod, prod_consts), _ = tiny
    missing = _text_decoder_missing(prod)
    assert missing is None, f"the text decoder fell back to Hugging Face's forward: {missing}"
    pixels = _pixels(image_grid(cfg.vision_config, IMAGE), BATCH)
    ref_pre, ref_dec = _greedy_chain(eager, eager_consts, cfg, pixels)
    pre, dec = _greedy_chain(prod, prod_consts, cfg, pixels)
    torch.testing.assert_close(pre.float(), ref_pre.float(), **TEXT_TOL)
    assert torch.equal(pre[:, 0].argmax(-1), ref_pre[:, 0].argmax(-1))
    torch.testing.assert_close(dec.float(), ref_dec.float(), **TEXT_TOL)
    assert torch.equal(dec[:, 0].argmax(-1), ref_dec[:, 0].argmax(-1))


# ---------------------------------------------------------------------------------------------------
# Traces of the production graph: meta == CPU, replay == eager run of the same model


@pytest.mark.parametrize("phase", ["encode", "prefill", "decode"])
def test_production_meta_trace_matches_cpu_and_replays_exactly(tiny, phase):
    _, _, (prod, consts), (meta, meta_consts) = tiny
    graph_meta = trace(vlm_step(meta, meta_consts, device="meta", **_kw(phase)))
    step = vlm_step(prod, consts, device="cpu", **_kw(phase))
    g = torch.Generator().manual_seed(1)
    for t in step.inputs.values():
        if t.dtype.is_floating_point:
            t.copy_(torch.randn(t.shape, generator=g))
    if phase == "decode":
        step.inputs["cache_positions"].copy_(torch.tensor([SEQ, 7]))
        step.inputs["positions"].copy_(torch.tensor([SEQ - 8, 7]))
        for t in step.state.values():
            t.copy_(torch.randn(t.shape, generator=g))
    state0 = {k: v.clone() for k, v in step.state.items()}
    graph_cpu = trace(step)
    assert [(k.op, k.shapes) for k in graph_meta.kernels] == [(k.op, k.shapes) for k in graph_cpu.kernels]
    for name, t in step.state.items():
        t.copy_(state0[name])
    eager = step.run()
    weights, _ = unique_state({"": prod})
    replay_state = {k: v.clone() for k, v in state0.items()}
    out = Executor(graph_meta, single_device_program(graph_meta), weights).run(step.inputs, replay_state)
    for name in eager:
        assert torch.equal(out[name], eager[name]), name
    for name in step.state:
        assert torch.equal(replay_state[name], step.state[name]), name


# ---------------------------------------------------------------------------------------------------
# The kernel sequence on meta


def _seq(kernels) -> list[tuple[str, str]]:
    return [(k.scope, k.op) for k in kernels]


def test_encode_kernel_sequence_is_as_intended(tiny):
    cfg, _, _, (meta, consts) = tiny
    step = vlm_step(meta, consts, device="meta", **_kw("encode"))
    graph = trace(step)
    depth = cfg.vision_config.depth
    blocks = [[(f"model.visual.blocks.{i}" + (f".{s}" if s else ""), op) for s, op in BLOCK] for i in range(depth)]
    assert _seq(graph.kernels) == HEAD + sum(blocks, []) + TAIL
    # attention over the host-known segments: windows, or whole images in the full-attention blocks
    attn = [k for k in graph.kernels if k.op == "tessera.segment_attention.default"]
    for k in attn:
        want = step.meta["image_lengths"] if k.layer in cfg.vision_config.fullatt_block_indexes \
            else step.meta["window_lengths"]
        assert k.args[3] == want
    # RoPE writes the q and k views of the qkv output in place; attention reads that same buffer
    by_index = {k.index: k for k in graph.kernels}
    for i in range(depth):
        rope, sdpa, qkv = (next(k for k in graph.kernels if k.layer == i and k.op == op)
                           for op in ("tessera.vision_rotary_.default", "tessera.segment_attention.default",
                                      "aten.addmm.default"))
        qkv_out = {a.buffer for a in graph.accesses if a.kernel == qkv.index and a.mode == "write"}
        rope_w = [a for a in graph.accesses if a.kernel == rope.index and a.mode == "write"]
        assert len(rope_w) == 2 and {a.buffer for a in rope_w} == qkv_out
        assert {a.buffer for a in graph.accesses if a.kernel == sdpa.index and a.mode == "read"} == qkv_out
        assert by_index[rope.index + 1] is sdpa


# ---------------------------------------------------------------------------------------------------
# Qwen2.5-VL-7B encode on meta: eager vs production kernel counts


@pytest.fixture(scope="module")
def full():
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig.from_pretrained(CATALOG)
    return {graph: _build(cfg, graph, "meta") for graph in ("eager", "production")}


@pytest.mark.parametrize("image", [(504, 504), (1008, 1008)])
def test_full_size_encode_counts(full, image):
    counts = {}
    for graph, (model, consts) in full.items():
        step = vlm_step(model, consts, model_name="qwen2.5-vl-7b", phase="encode", batch=1, seq=0, ctx=0,
                        image=image)
        t0 = time.perf_counter()
        g = trace(step)
        seconds = time.perf_counter() - t0
        block = [k for k in g.kernels if k.layer == 0]
        counts[graph] = len(g.kernels)
        print(f"qwen2.5-vl-7b encode {image[0]}x{image[1]} {graph}: {len(g.kernels)} kernels "
              f"({len(block)} in block 0), {sum(k.flops for k in g.kernels) / 1e12:.2f} TFLOP, traced in "
              f"{seconds:.2f} s")
        tokens = (image[0] // 28) * (image[1] // 28)
        assert g.outputs["image_embeds"][3] == [tokens, 3584]
        assert sum(k.op == "tessera.segment_attention.default" for k in g.kernels) == 32
        if graph == "production":
            assert [k.op for k in block] == [op for _, op in BLOCK]
            assert len(g.kernels) == len(HEAD) + 32 * len(BLOCK) + len(TAIL)
            gemms = [k for k in g.kernels if k.op_class == "gemm"]
            assert len(gemms) == 1 + 32 * 4 + 2
    assert counts["production"] < counts["eager"]
