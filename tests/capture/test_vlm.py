"""Qwen2.5-VL encode / prefill / decode steps: device-independent traces, exact replay, HF parity."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tessera.capture.build import instantiate
from tessera.capture.families.vlm import (
    build_vlm,
    image_grid,
    parse_image_size,
    vlm_step,
)
from tessera.capture.tiny import tiny_config
from tessera.capture.trace import trace
from tessera.program.program import single_device_program
from tessera.runtime.executor import Executor
from tessera.weights import unique_state

CATALOG = Path(__file__).resolve().parents[2] / "src" / "tessera" / "capture" / "catalog" / "qwen2.5-vl-7b"
IMAGE = (112, 84)  # 8 x 6 patches, 4 x 3 merged tokens, 4 attention windows of unequal size
BATCH, SEQ, CTX, START = 2, 20, 32, 3


@pytest.fixture(scope="module")
def tiny():
    """The tiny config and the same random model on the CPU and on meta (with constant values)."""
    cfg = tiny_config("vlm")
    cpu, cpu_consts = instantiate(lambda: build_vlm(cfg), "cpu", seed=0)
    meta, meta_consts = instantiate(lambda: build_vlm(cfg), "meta")
    return cfg, cpu, cpu_consts, meta, meta_consts


@pytest.fixture(scope="module")
def reference(tiny):
    """A plain Hugging Face model (SDPA everywhere, no step context needed) with the CPU model's weights."""
    cfg, cpu, *_ = tiny
    ref, _ = instantiate(lambda: build_vlm(cfg, attn_implementation="sdpa"), "cpu", seed=1)
    ref.load_state_dict(cpu.state_dict())
    return ref


def _kw(phase: str, image=IMAGE) -> dict:
    return {"model_name": "tiny-vlm", "phase": phase, "batch": BATCH, "seq": SEQ, "ctx": CTX, "image": image,
            "image_start": START}


def _fill_random(step, phase: str, seed: int = 1) -> None:
    """Random real-valued inputs (and a random cache for decode), keeping host-computed layout inputs."""
    g = torch.Generator().manual_seed(seed)
    for t in step.inputs.values():
        if t.dtype.is_floating_point:
            t.copy_(torch.randn(t.shape, generator=g))
    if phase == "prefill":
        ids = step.inputs["input_ids"]
        ids.copy_(torch.where(ids == 0, torch.randint(0, 400, ids.shape, generator=g), ids))
        step.inputs["slots"].copy_(torch.tensor([1, 0]))
    if phase == "decode":
        step.inputs["input_ids"].copy_(torch.randint(0, 400, (BATCH, 1), generator=g))
        step.inputs["cache_positions"].copy_(torch.tensor([SEQ, 7]))
        step.inputs["positions"].copy_(torch.tensor([SEQ - 8, 7]))
        step.inputs["slots"].copy_(torch.tensor([1, 0]))
        for t in step.state.values():
            t.copy_(torch.randn(t.shape, generator=g))


def _ops(graph) -> list:
    return [(k.op, k.shapes) for k in graph.kernels]


# ---------------------------------------------------------------------------------------------------
# Image sizes


def test_parse_image_size():
    assert parse_image_size("504x504") == (504, 504)
    assert parse_image_size(" 112X84 ") == (112, 84)
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        parse_image_size("504")


def test_bad_image_size_is_a_clear_error(tiny):
    cfg, cpu, consts, *_ = tiny
    with pytest.raises(ValueError, match=r"500x504 is not a multiple of 28 pixels .*e\.g\. 504x504"):
        image_grid(cfg.vision_config, (500, 504))
    with pytest.raises(ValueError, match="multiple of 28"):
        vlm_step(cpu, consts, device="cpu", **_kw("encode", image=(100, 56)))


def test_prompt_must_hold_the_image(tiny):
    _, cpu, consts, *_ = tiny
    with pytest.raises(ValueError, match="use --seq of at least 15"):
        vlm_step(cpu, consts, device="cpu", **(_kw("prefill") | {"seq": 10}))


# ---------------------------------------------------------------------------------------------------
# Traces: meta == CPU kernel for kernel; replay of the meta graph == eager, bit for bit


@pytest.mark.parametrize("phase", ["encode", "prefill", "decode"])
def test_meta_trace_matches_cpu_and_replays_exactly(tiny, phase):
    _, cpu, cpu_consts, meta, meta_consts = tiny
    graph_meta = trace(vlm_step(meta, meta_consts, device="meta", **_kw(phase)))
    step = vlm_step(cpu, cpu_consts, device="cpu", **_kw(phase))
    _fill_random(step, phase)
    state0 = {k: v.clone() for k, v in step.state.items()}
    graph_cpu = trace(step)
    assert _ops(graph_meta) == _ops(graph_cpu)

    for name, t in step.state.items():
        t.copy_(state0[name])
    eager = step.run()
    weights, _ = unique_state({"": cpu})
    replay_state = {k: v.clone() for k, v in state0.items()}
    out = Executor(graph_meta, single_device_program(graph_meta), weights).run(step.inputs, replay_state)
    assert set(out) == set(eager)
    for name in eager:
        assert torch.equal(out[name], eager[name]), name
    for name in step.state:
        assert torch.equal(replay_state[name], step.state[name]), name


def test_encode_uses_one_attention_kernel_per_block_and_restores_hf_forward(tiny):
    cfg, cpu, consts, *_ = tiny
    step = vlm_step(cpu, consts, device="cpu", **_kw("encode"))
    graph = trace(step)
    attn = [k for k in graph.kernels if k.op_class == "attention"]
    assert {k.op for k in attn} == {"tessera.segment_attention.default"}
    assert [k.layer for k in attn] == list(range(cfg.vision_config.depth))
    assert all(k.scope.endswith(".attn") for k in attn)
    # windowed layers count only within-window pairs, full-attention layers every pair
    windowed = [k for k in attn if k.layer not in cfg.vision_config.fullatt_block_indexes]
    full = [k for k in attn if k.layer in cfg.vision_config.fullatt_block_indexes]
    assert windowed and full and windowed[0].flops < full[0].flops
    visual = cpu.model.visual
    assert "forward" not in vars(visual) and all("forward" not in vars(b.attn) for b in visual.blocks)


# ---------------------------------------------------------------------------------------------------
# Parity with Hugging Face's own forward


def _pixels(grid, images: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(images * grid.patches, grid.patch_dim, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("image", [IMAGE, (56, 56)])
def test_encode_matches_hf_vision_tower(tiny, reference, image):
    cfg, cpu, consts, *_ = tiny
    grid = image_grid(cfg.vision_config, image)
    step = vlm_step(cpu, consts, device="cpu", **_kw("encode", image=image))
    step.inputs["pixel_values"].copy_(_pixels(grid, BATCH))
    ours = step.run()["image_embeds"]
    grid_thw = torch.tensor([[1, grid.h, grid.w]] * BATCH)
    with torch.no_grad():
        hf = reference.model.visual(step.inputs["pixel_values"], grid_thw=grid_thw).pooler_output
    assert ours.shape == hf.shape == (BATCH * grid.tokens, cfg.text_config.hidden_size)
    torch.testing.assert_close(ours.float(), hf.float(), atol=2e-2, rtol=2e-2)


def _prompt(cfg, step) -> torch.Tensor:
    ids = step.inputs["input_ids"]
    g = torch.Generator().manual_seed(3)
    ids.copy_(torch.where(ids == 0, torch.randint(0, 400, ids.shape, generator=g), ids))
    return ids


def test_prefill_and_decode_match_hf_forward(tiny, reference):
    cfg, cpu, consts, *_ = tiny
    grid = image_grid(cfg.vision_config, IMAGE)
    grid_thw = torch.tensor([[1, grid.h, grid.w]] * BATCH)
    pixels = _pixels(grid, BATCH)
    enc = vlm_step(cpu, consts, device="cpu", **_kw("encode"))
    enc.inputs["pixel_values"].copy_(pixels)
    pre = vlm_step(cpu, consts, device="cpu", **_kw("prefill"))
    ids = _prompt(cfg, pre)
    pre.inputs["image_embeds"].copy_(enc.run()["image_embeds"])

    # the host's multimodal positions are Hugging Face's
    image_tokens = (ids == cfg.image_token_id).int()
    hf_pos, hf_delta = reference.model.get_rope_index(ids, image_tokens, image_grid_thw=grid_thw)
    assert torch.equal(pre.inputs["position_ids"], hf_pos)
    assert hf_delta.flatten().tolist() == [pre.meta["rope_delta"]] * BATCH

    logits = pre.run()["logits"]
    with torch.no_grad():
        hf = reference(input_ids=ids, pixel_values=pixels, image_grid_thw=grid_thw,
                       mm_token_type_ids=image_tokens, use_cache=False).logits
    torch.testing.assert_close(logits[:, 0].float(), hf[:, -1].float(), atol=2e-2, rtol=2e-2)

    dec = vlm_step(cpu, consts, device="cpu", state=pre.state, **_kw("decode"))
    nxt = torch.tensor([[17], [230]])
    dec.inputs["input_ids"].copy_(nxt)
    dec.inputs["cache_positions"].fill_(SEQ)
    dec.inputs["positions"].fill_(SEQ + pre.meta["rope_delta"])
    logits = dec.run()["logits"]
    ids2 = torch.cat([ids, nxt], dim=1)
    reference.model.rope_deltas = None
    with torch.no_grad():
        hf = reference(input_ids=ids2, pixel_values=pixels, image_grid_thw=grid_thw,
                       mm_token_type_ids=(ids2 == cfg.image_token_id).int(), use_cache=False).logits
    torch.testing.assert_close(logits[:, 0].float(), hf[:, -1].float(), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------------
# Full size (Qwen2.5-VL-7B) on meta


@pytest.fixture(scope="module")
def full():
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig.from_pretrained(CATALOG)
    return instantiate(lambda: build_vlm(cfg), "meta")


def test_full_size_encode_traces_fast(full):
    model, consts = full
    step = vlm_step(model, consts, model_name="qwen2.5-vl-7b", phase="encode", batch=1, seq=0, ctx=0,
                    image=(504, 504))
    t0 = time.perf_counter()
    graph = trace(step)
    seconds = time.perf_counter() - t0
    print(f"qwen2.5-vl-7b encode 504x504: {len(graph.kernels)} kernels in {seconds:.2f} s")
    assert seconds < 10
    assert graph.outputs["image_embeds"][3] == [324, 3584]
    assert sum(k.op == "tessera.segment_attention.default" for k in graph.kernels) == 32


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_full_size_text_phases_trace(full, phase):
    model, consts = full
    step = vlm_step(model, consts, model_name="qwen2.5-vl-7b", phase=phase, batch=2, seq=400, ctx=512,
                    image=(504, 504))
    t0 = time.perf_counter()
    graph = trace(step)
    print(f"qwen2.5-vl-7b {phase}: {len(graph.kernels)} kernels in {time.perf_counter() - t0:.2f} s")
    assert graph.outputs["logits"][3] == [2, 1, 152064]
    assert sum(k.op.startswith("tessera.") for k in graph.kernels) == 28 + 1  # the layers' units and the sampler
