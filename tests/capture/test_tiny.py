"""The tiny random-init configs of each family: they build and run (tessera.capture.tiny)."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from transformers import AutoModelForCausalLM, Qwen2_5_VLForConditionalGeneration

from tessera.capture.tiny import tiny_config
from tessera.errors import TesseraError
from tests.capture.test_models import SD35_COMPONENTS, build_component


def test_tiny_config_unknown_family():
    with pytest.raises(TesseraError, match="families: llm, moe, ssm, vlm, diffusion"):
        tiny_config("rnn")


@pytest.mark.parametrize("family", ["llm", "moe", "ssm"])
def test_tiny_causal_lm_runs(family):
    config = tiny_config(family)
    assert config.num_hidden_layers == 2 and config.hidden_size == 64
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert next(model.parameters()).dtype == torch.bfloat16
    ids = torch.randint(3, config.vocab_size, (2, 12))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 12, config.vocab_size)
    assert torch.isfinite(logits).all()


def test_tiny_config_dtype():
    assert AutoModelForCausalLM.from_config(tiny_config("llm", dtype="float32")).dtype == torch.float32


def test_tiny_vlm_runs_with_an_image():
    config = tiny_config("vlm")
    vision = config.vision_config
    assert vision.out_hidden_size == config.text_config.hidden_size
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration._from_config(config).eval()
    # One 112x112 image: an 8x8 grid of 14-pixel patches, merged 2x2 into 16 tokens, 4 windows of 2x2.
    grid = torch.tensor([[1, 8, 8]])
    pixels = torch.randn(64, 3 * vision.temporal_patch_size * vision.patch_size**2, dtype=torch.bfloat16)
    image = [config.vision_start_token_id] + [config.image_token_id] * 16 + [config.vision_end_token_id]
    ids = torch.tensor([[10, 11, *image, 12, 13]])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid).logits
    assert logits.shape == (1, ids.shape[1], config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


def test_tiny_sd3_pipeline_wiring():
    cfg = tiny_config("diffusion", dtype="float32")
    assert set(cfg) == set(SD35_COMPONENTS)
    torch.manual_seed(0)
    models = {name: build_component(name, d).eval() for name, d in cfg.items() if name != "scheduler"}
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(cfg["scheduler"])
    batch = 2
    with torch.no_grad():
        # As StableDiffusion3Pipeline.encode_prompt: CLIP penultimate hidden states side by side, padded to
        # T5's width, then T5's tokens along the sequence; pooled = both CLIP projections side by side.
        ids = torch.randint(3, 1000, (batch, 8))
        clip = [models[n](ids, output_hidden_states=True) for n in ("text_encoder", "text_encoder_2")]
        clip_embeds = torch.cat([o.hidden_states[-2] for o in clip], dim=-1)
        t5_embeds = models["text_encoder_3"](torch.randint(2, 256, (batch, 12))).last_hidden_state
        clip_embeds = torch.nn.functional.pad(clip_embeds, (0, t5_embeds.shape[-1] - clip_embeds.shape[-1]))
        prompt_embeds = torch.cat([clip_embeds, t5_embeds], dim=-2)
        pooled = torch.cat([o.text_embeds for o in clip], dim=-1)
        assert prompt_embeds.shape == (batch, 8 + 12, cfg["transformer"]["joint_attention_dim"])
        assert pooled.shape == (batch, cfg["transformer"]["pooled_projection_dim"])

        vae = models["vae"]
        image = torch.randn(batch, 3, 16, 16)
        latents = vae.encode(image).latent_dist.sample()
        assert latents.shape == (batch, 16, 8, 8)
        scheduler.set_timesteps(2)
        t = scheduler.timesteps[0]
        noise = models["transformer"](
            hidden_states=latents,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled,
            timestep=t.expand(batch),
        ).sample
        assert noise.shape == latents.shape
        latents = scheduler.step(noise, t, latents).prev_sample
        decoded = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor).sample
    assert decoded.shape == image.shape
    assert torch.isfinite(decoded).all()


