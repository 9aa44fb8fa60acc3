"""SD3-style diffusion phases: meta vs CPU traces, replay vs eager, attention kernels, scheduler math."""

from __future__ import annotations

import time

import pytest
import torch

from tessera.capture.families.diffusion import (
    CLIP_LEN,
    DIFFUSION_PHASES,
    build_sd3_components,
    diffusion_step,
    parse_resolution,
)
from tessera.capture.models import load_config, resolve_model
from tessera.capture.tiny import tiny_config
from tessera.capture.trace import trace
from tessera.program.program import single_device_program
from tessera.runtime.executor import Executor
from tessera.weights import unique_state

BATCH = 2
RESOLUTION = (64, 48)  # width, height -> latents [B, 4, 6, 8]
T5_LEN = 16
VOCAB = 256  # the smallest vocabulary of the tiny text encoders (T5)


@pytest.fixture(scope="module")
def tiny():
    """(cpu modules, cpu constants, meta modules, meta constants) of the tiny random pipeline."""
    cfgs = tiny_config("diffusion")
    cpu, cpu_consts = build_sd3_components(cfgs, "cpu", seed=0)
    meta, meta_consts = build_sd3_components(cfgs, "meta")
    return cpu, cpu_consts, meta, meta_consts


def _step(modules, consts, phase, device):
    return diffusion_step(modules, consts, model_name="tiny-sd3", phase=phase, batch=BATCH,
                          resolution=RESOLUTION, t5_len=T5_LEN, device=device)


def _fill_real_inputs(step, seed: int = 1) -> None:
    """Replace the placeholder inputs of a CPU step with random values of the same shapes."""
    g = torch.Generator().manual_seed(seed)
    for name, t in step.inputs.items():
        if t.dtype == torch.long:
            t.copy_(torch.randint(0, VOCAB, t.shape, generator=g))
        elif name in ("latents", "prompt_embeds", "pooled"):
            t.copy_(torch.randn(t.shape, generator=g))


def _kernels(graph):
    return [(k.op, k.shapes) for k in graph.kernels]


@pytest.mark.parametrize("phase", DIFFUSION_PHASES)
def test_meta_and_cpu_traces_have_the_same_kernels(tiny, phase):
    cpu, cpu_consts, meta, meta_consts = tiny
    graph_meta = trace(_step(meta, meta_consts, phase, "meta"))
    cpu_step = _step(cpu, cpu_consts, phase, "cpu")
    _fill_real_inputs(cpu_step)
    graph_cpu = trace(cpu_step)
    assert len(graph_meta.kernels) > 0
    assert _kernels(graph_meta) == _kernels(graph_cpu)
    assert graph_meta.meta["family"] == "diffusion"


@pytest.mark.parametrize("phase", DIFFUSION_PHASES)
def test_meta_graph_replays_like_eager(tiny, phase):
    cpu, cpu_consts, meta, meta_consts = tiny
    graph = trace(_step(meta, meta_consts, phase, "meta"))
    cpu_step = _step(cpu, cpu_consts, phase, "cpu")
    _fill_real_inputs(cpu_step)
    eager = cpu_step.run()
    weights, _ = unique_state(cpu_step.modules)
    replayed = Executor(graph, single_device_program(graph), weights).run(cpu_step.inputs, {})
    assert set(replayed) == set(eager)
    for name, value in eager.items():
        assert torch.equal(replayed[name], value), name


def test_phase_outputs_have_pipeline_shapes(tiny):
    cpu, cpu_consts, _, _ = tiny
    tcfg, width, height = cpu["transformer"].config, *RESOLUTION
    enc = _step(cpu, cpu_consts, "encode", "cpu").run()
    assert enc["prompt_embeds"].shape == (BATCH, CLIP_LEN + T5_LEN, tcfg.joint_attention_dim)
    assert enc["pooled"].shape == (BATCH, tcfg.pooled_projection_dim)
    step = _step(cpu, cpu_consts, "step", "cpu")
    assert step.inputs["prompt_embeds"].shape == (2 * BATCH, CLIP_LEN + T5_LEN, tcfg.joint_attention_dim)
    factor = 2 ** (len(cpu["vae"].config.block_out_channels) - 1)  # the VAE's downsampling
    assert step.run()["latents"].shape == (BATCH, tcfg.in_channels, height // factor, width // factor)
    image = _step(cpu, cpu_consts, "decode", "cpu").run()["image"]
    assert image.shape == (BATCH, 3, height, width) and image.dtype == torch.bfloat16


def test_encode_is_wired_like_the_sd3_pipeline(tiny):
    cpu, cpu_consts, _, _ = tiny
    step = _step(cpu, cpu_consts, "encode", "cpu")
    _fill_real_inputs(step)
    out = step.run()
    clip_ids, t5_ids = step.inputs["clip_ids"], step.inputs["t5_ids"]
    with torch.no_grad():
        l_out = cpu["text_encoder"](clip_ids, output_hidden_states=True)
        g_out = cpu["text_encoder_2"](clip_ids, output_hidden_states=True)
        t5 = cpu["text_encoder_3"](t5_ids)[0]
    clip = torch.cat([l_out.hidden_states[-2], g_out.hidden_states[-2]], dim=-1)
    embeds = out["prompt_embeds"]
    assert torch.equal(embeds[:, :CLIP_LEN, : clip.shape[-1]], clip)
    assert not embeds[:, :CLIP_LEN, clip.shape[-1]:].any()  # zero padding up to the T5 width
    assert torch.equal(embeds[:, CLIP_LEN:], t5)
    assert torch.equal(out["pooled"], torch.cat([l_out.text_embeds, g_out.text_embeds], dim=-1))


def test_attention_is_one_sdpa_kernel(tiny):
    _, _, meta, meta_consts = tiny
    step_graph = trace(_step(meta, meta_consts, "step", "meta"))
    attn_scopes = {k.scope for k in step_graph.kernels if k.scope.endswith((".attn", ".attn2"))}
    assert attn_scopes  # joint attention of every block, plus attn2 of the dual-attention block
    for scope in attn_scopes:
        ops = [k.op for k in step_graph.kernels if k.scope == scope]
        assert ops.count("aten.scaled_dot_product_attention.default") == 1, scope
        assert "aten.bmm.default" not in ops and "aten._softmax.default" not in ops, scope
    n_attn = len(attn_scopes)
    assert sum(k.op == "aten.scaled_dot_product_attention.default" for k in step_graph.kernels) == n_attn
    for phase in ("encode", "decode"):
        graph = trace(_step(meta, meta_consts, phase, "meta"))
        ops = [k.op for k in graph.kernels]
        assert "aten.scaled_dot_product_attention.default" in ops
        assert "aten._softmax.default" not in ops


def test_step_matches_diffusers_transformer_guidance_and_scheduler(tiny):
    from diffusers import FlowMatchEulerDiscreteScheduler

    cpu, cpu_consts, _, _ = tiny
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(28)
    i, guidance = 5, 4.5
    t = sched.timesteps[i]
    step = _step(cpu, cpu_consts, "step", "cpu")
    _fill_real_inputs(step)
    step.inputs["timestep"].copy_(t.expand(2 * BATCH))
    step.inputs["sigma"].copy_(sched.sigmas[i : i + 1])
    step.inputs["sigma_next"].copy_(sched.sigmas[i + 1 : i + 2])
    step.inputs["guidance_scale"].fill_(guidance)
    ours = step.run()["latents"]

    latents = step.inputs["latents"]
    with torch.no_grad():
        noise = cpu["transformer"](hidden_states=torch.cat([latents] * 2), timestep=t.expand(2 * BATCH),
                                   encoder_hidden_states=step.inputs["prompt_embeds"],
                                   pooled_projections=step.inputs["pooled"], return_dict=False)[0]
    uncond, text = noise.chunk(2)
    noise = uncond + guidance * (text - uncond)
    expected = sched.step(noise, t, latents, return_dict=False)[0]
    assert ours.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(ours, expected)  # same kernels in the same order: bit for bit on the CPU
    assert not torch.equal(ours, latents)


def test_full_size_meta_traces_are_fast():
    t0 = time.perf_counter()
    modules, consts = build_sd3_components(_catalog_configs(), "meta")
    print(f"\nsd3.5-medium meta build: {time.perf_counter() - t0:.2f}s")
    for phase in DIFFUSION_PHASES:
        t0 = time.perf_counter()
        step = diffusion_step(modules, consts, model_name="sd3.5-medium", phase=phase, batch=1,
                              resolution=parse_resolution("1024"), device="meta")
        graph = trace(step)
        seconds = time.perf_counter() - t0
        print(f"{phase}: {len(graph.kernels)} kernels in {seconds:.2f}s")
        assert len(graph.kernels) > 0
        assert seconds < 10, f"{phase} trace took {seconds:.1f}s"
        if phase == "step":
            assert graph.outputs["latents"][3] == [1, 16, 128, 128]
            assert graph.buffers["transformer.pos_embed.pos_embed"].kind == "weight"


@pytest.mark.parametrize(("text", "expected"), [("1024", (1024, 1024)), ("1024x768", (1024, 768)),
                                                (" 512X1024 ", (512, 1024)), ("16", (16, 16))])
def test_parse_resolution(text, expected):
    assert parse_resolution(text) == expected


@pytest.mark.parametrize("text", ["0", "1000", "1024x0", "1024x1000", "-16", "1024x", "x1024", "abc",
                                  "1024x768x2", "", "10.5"])
def test_parse_resolution_rejects_bad_values(text):
    with pytest.raises(ValueError, match=r"invalid resolution .*expected N or WxH"):
        parse_resolution(text)


def test_unknown_phase_and_missing_components_are_rejected(tiny):
    cpu, cpu_consts, _, _ = tiny
    with pytest.raises(ValueError, match="not a diffusion phase"):
        _step(cpu, cpu_consts, "prefill", "cpu")
    with pytest.raises(ValueError, match="needs the components vae"):
        _step({"transformer": cpu["transformer"]}, cpu_consts, "decode", "cpu")
    with pytest.raises(ValueError, match="multiples of 4"):  # tiny VAE factor 2 x patch 2
        diffusion_step(cpu, cpu_consts, model_name="t", phase="step", batch=1, resolution=(70, 64),
                       device="cpu")


def _catalog_configs() -> dict[str, dict]:
    spec = resolve_model("sd3.5-medium")
    return {c: load_config(spec, c) for c in spec.components if c != "scheduler"}
