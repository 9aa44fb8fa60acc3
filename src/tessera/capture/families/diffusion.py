"""Encode, denoising-step and decode phases of Stable Diffusion 3 style (MMDiT) pipelines.

The three phases replicate the math of diffusers' ``StableDiffusion3Pipeline`` with its modules
(no tokenizers, no pipeline object): ``encode`` runs the two CLIP encoders and T5 and wires their
outputs as ``encode_prompt`` does, ``step`` is one classifier-free-guided transformer call followed
by the ``FlowMatchEulerDiscreteScheduler`` Euler update, and ``decode`` runs the VAE decoder.
Weights are named by component root: ``transformer.*``, ``text_encoder.*``, ``text_encoder_2.*``,
``text_encoder_3.*``, ``vae.*``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from unittest import mock

import torch
from torch import nn

from tessera.capture.build import instantiate
from tessera.capture.step import Step
from tessera.errors import PhaseError, ShapeError
from tessera.limits import IMAGE_SIDE

DIFFUSION_PHASES = ("encode", "step", "decode")
COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae")
PHASE_COMPONENTS: dict[str, tuple[str, ...]] = {
    "encode": ("text_encoder", "text_encoder_2", "text_encoder_3"),
    "step": ("transformer",),
    "decode": ("vae",),
}
CLIP_LEN = 77  # the CLIP tokenizers pad every prompt to 77 tokens
RESOLUTION_MULTIPLE = 16  # VAE downsampling (8) x transformer patch size (2)
DEFAULT_GUIDANCE = 7.0  # StableDiffusion3Pipeline's default guidance_scale
DEFAULT_STEPS = 28  # StableDiffusion3Pipeline's default num_inference_steps
DEFAULT_SHIFT = 3.0  # FlowMatchEulerDiscreteScheduler shift of SD3 / SD3.5

_RESOLUTION_RE = re.compile(r"^\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?$")


# ---------------------------------------------------------------------------------------------------
# Configs


# ---------------------------------------------------------------------------------------------------
# Modules


def _cast(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    # nn.Module.to: diffusers' ModelMixin.to only adds a warning about from_pretrained's fp32 modules
    # (SD3's transformer and VAE keep none).
    return nn.Module.to(module, dtype)


def _contiguous_output(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.contiguous()


def _contiguous_attention_outputs(vae: nn.Module) -> nn.Module:
    """Make the VAE's attention blocks return contiguous activations.

    diffusers' attention processor returns a channels-last-strided image ([B,HW,C] transposed back to
    [B,C,H,W]) that then spreads through the residual adds. Devices treat such inputs differently
    (group_norm copies it to contiguous everywhere but on the CPU; convolutions keep channels-last on the
    CPU and cuDNN but not on `meta`), so the kernels would depend on the device. One copy per attention
    block keeps every activation contiguous and the kernels the same on every device.
    """
    from diffusers.models.attention_processor import Attention

    for sub in vae.modules():
        if isinstance(sub, Attention):
            sub.register_forward_hook(_contiguous_output)
    return vae


def _build_transformer(config: dict, dtype: torch.dtype, device: str) -> nn.Module:
    import diffusers.models.embeddings as embeddings
    from diffusers import SD3Transformer2DModel

    if device != "meta":
        return _cast(SD3Transformer2DModel.from_config(config), dtype)
    # The persistent (weight) pos_embed buffer is a sin/cos table of pos_embed_max_size^2 x dim values
    # (226M for SD3.5): on `meta` it is built on `meta` too, instead of on the host and then dropped.
    on_meta = functools.partial(embeddings.get_2d_sincos_pos_embed, device="meta")
    with mock.patch.object(embeddings, "get_2d_sincos_pos_embed", on_meta):
        return _cast(SD3Transformer2DModel.from_config(config), dtype)


def component_factory(name: str, config: dict, dtype: torch.dtype = torch.bfloat16,
                      device: str = "meta") -> Callable[[], nn.Module]:
    """A zero-argument constructor of pipeline component ``name`` from its config dict.

    The text encoders are created directly in ``dtype``: casting afterwards would untie T5's tied
    embeddings on ``meta`` (each Parameter object is converted separately there).
    """
    config = {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype", "architectures")}
    if name == "transformer":
        return lambda: _build_transformer(config, dtype, device)
    if name == "vae":
        from diffusers import AutoencoderKL

        return lambda: _contiguous_attention_outputs(_cast(AutoencoderKL.from_config(config), dtype))
    if name in ("text_encoder", "text_encoder_2"):
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection

        return lambda: CLIPTextModelWithProjection._from_config(CLIPTextConfig(**config), dtype=dtype,
                                                                attn_implementation="sdpa")
    if name == "text_encoder_3":
        from transformers import T5Config, T5EncoderModel

        return lambda: T5EncoderModel._from_config(T5Config(**config), dtype=dtype, attn_implementation="sdpa")
    raise ValueError(f"unknown SD3 component {name!r} (expected one of {', '.join(COMPONENTS)})")


def build_sd3_components(configs: dict[str, dict], device: str = "meta", dtype: torch.dtype = torch.bfloat16,
                         seed: int = 0) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor]]:
    """Instantiate the SD3 components in ``configs`` on ``device`` (``meta``: free; else seeded random
    weights); returns the modules by component name and the host values of all their constants."""
    modules: dict[str, nn.Module] = {}
    constant_values: dict[str, torch.Tensor] = {}
    for name in COMPONENTS:
        if name not in configs:
            continue
        factory = component_factory(name, configs[name], dtype, device)
        modules[name], values = instantiate(factory, device, seed, root=name)
        constant_values.update(values)
    return modules, constant_values


# ---------------------------------------------------------------------------------------------------
# Shapes and placeholder inputs


def parse_resolution(text: str) -> tuple[int, int]:
    """``"N"`` (square) or ``"WxH"`` -> (width, height); both positive multiples of 16."""
    expected = (f"expected N or WxH with positive integers that are multiples of {RESOLUTION_MULTIPLE} "
                "(e.g. 1024 or 1024x768)")
    m = _RESOLUTION_RE.match(text)
    if m is None:
        raise ShapeError(f"invalid resolution {text!r}: {expected}")
    if max(len(g) for g in m.groups() if g) > 9:  # int() of thousands of digits is itself refused
        IMAGE_SIDE.check(10**9, f"resolution {text[:32]!r}")
    width = int(m.group(1))
    height = int(m.group(2)) if m.group(2) is not None else width
    for side in (width, height):
        IMAGE_SIDE.check(side, f"resolution {text!r}")
    if width <= 0 or height <= 0 or width % RESOLUTION_MULTIPLE or height % RESOLUTION_MULTIPLE:
        raise ShapeError(f"invalid resolution {text!r}: {expected}")
    return width, height


def latent_geometry(modules: dict[str, nn.Module]) -> tuple[int, int, int]:
    """(VAE scale factor, latent channels, patch size) of the pipeline, as the SD3 pipeline computes them.

    Without the VAE (a step-only build) SD3's 8x VAE and the transformer's input channels are assumed.
    """
    patch = modules["transformer"].config.patch_size if "transformer" in modules else 2
    if "vae" in modules:
        vcfg = modules["vae"].config
        return 2 ** (len(vcfg.block_out_channels) - 1), vcfg.latent_channels, patch
    if "transformer" in modules:
        return 8, modules["transformer"].config.in_channels, patch
    raise ValueError("latent shapes need the vae or the transformer component")


def latent_shape(modules: dict[str, nn.Module], batch: int, resolution: tuple[int, int]) -> tuple[int, ...]:
    """[B, C, H/f, W/f] latents of a (width, height) image; ValueError if the image does not tile."""
    width, height = resolution
    factor, channels, patch = latent_geometry(modules)
    multiple = factor * patch
    if width <= 0 or height <= 0 or width % multiple or height % multiple:
        raise ShapeError(f"resolution {width}x{height} must be positive multiples of {multiple} "
                         f"(VAE factor {factor} x patch size {patch})")
    return (batch, channels, height // factor, width // factor)


def first_step_schedule(steps: int = DEFAULT_STEPS, shift: float = DEFAULT_SHIFT) -> tuple[float, float, float]:
    """(timestep, sigma, sigma_next) of the first step of a flow-match Euler schedule."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(steps, device="cpu")
    return float(sched.timesteps[0]), float(sched.sigmas[0]), float(sched.sigmas[1])


def diffusion_inputs(phase: str, modules: dict[str, nn.Module], batch: int, resolution: tuple[int, int],
                     t5_len: int, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Placeholder inputs of ``phase`` with the right shapes and dtypes (real values come from the caller)."""
    bf16 = {"dtype": torch.bfloat16, "device": device}
    if phase == "encode":
        return {"clip_ids": torch.zeros(batch, CLIP_LEN, dtype=torch.long, device=device),
                "t5_ids": torch.zeros(batch, t5_len, dtype=torch.long, device=device)}
    if phase == "decode":
        return {"latents": torch.zeros(latent_shape(modules, batch, resolution), **bf16)}
    if phase != "step":
        raise PhaseError(f"phase {phase!r} is not a diffusion phase (use {', '.join(DIFFUSION_PHASES)})")
    tcfg = modules["transformer"].config
    timestep, sigma, sigma_next = first_step_schedule()
    f32 = {"dtype": torch.float32, "device": device}
    rows, seq = 2 * batch, CLIP_LEN + t5_len
    return {"latents": torch.zeros(latent_shape(modules, batch, resolution), **bf16),
            "prompt_embeds": torch.zeros(rows, seq, tcfg.joint_attention_dim, **bf16),
            "pooled": torch.zeros(rows, tcfg.pooled_projection_dim, **bf16),
            "timestep": torch.full((rows,), timestep, **f32),
            "sigma": torch.full((1,), sigma, **f32), "sigma_next": torch.full((1,), sigma_next, **f32),
            "guidance_scale": torch.full((1,), DEFAULT_GUIDANCE, **f32)}


# ---------------------------------------------------------------------------------------------------
# Phase functions


def encode_prompt(modules: dict[str, nn.Module], clip_ids: torch.Tensor,
                  t5_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_embeds [B,77+T,D], pooled [B,P]) wired as ``StableDiffusion3Pipeline.encode_prompt``."""
    clip_embeds, pooled = [], []
    for name in ("text_encoder", "text_encoder_2"):
        out = modules[name](clip_ids, output_hidden_states=True)
        pooled.append(out[0])
        clip_embeds.append(out.hidden_states[-2])
    t5 = modules["text_encoder_3"](t5_ids)[0]
    clip = torch.cat(clip_embeds, dim=-1)
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return torch.cat([clip, t5], dim=-2), torch.cat(pooled, dim=-1)


def guided_euler_step(transformer: nn.Module, latents: torch.Tensor, prompt_embeds: torch.Tensor,
                      pooled: torch.Tensor, timestep: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                      guidance_scale: torch.Tensor) -> torch.Tensor:
    """One classifier-free-guided MMDiT call and flow-match Euler update of ``latents``."""
    model_input = torch.cat([latents, latents])
    noise = transformer(hidden_states=model_input, timestep=timestep, encoder_hidden_states=prompt_embeds,
                        pooled_projections=pooled, return_dict=False)[0]
    uncond, text = noise.chunk(2)
    # 0-d scales keep the bf16 result dtype, as the pipeline's Python float and the scheduler's 0-d sigmas do
    noise = uncond + guidance_scale.reshape(()) * (text - uncond)
    dt = (sigma_next - sigma).reshape(())
    return (latents.to(torch.float32) + dt * noise).to(noise.dtype)


def vae_decode(vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """Image [B,3,H,W] from latents, unscaled and shifted as the pipeline does."""
    latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
    return vae.decode(latents, return_dict=False)[0]


def _phase_fn(phase: str, modules: dict[str, nn.Module]):
    if phase == "encode":
        def encode(inp, _state, _consts):
            embeds, pooled = encode_prompt(modules, inp["clip_ids"], inp["t5_ids"])
            return {"prompt_embeds": embeds, "pooled": pooled}
        return encode
    if phase == "step":
        def step(inp, _state, _consts):
            return {"latents": guided_euler_step(
                modules["transformer"], inp["latents"], inp["prompt_embeds"], inp["pooled"], inp["timestep"],
                inp["sigma"], inp["sigma_next"], inp["guidance_scale"])}
        return step

    def decode(inp, _state, _consts):
        return {"image": vae_decode(modules["vae"], inp["latents"])}
    return decode


def diffusion_step(modules: dict[str, nn.Module], constant_values: dict[str, torch.Tensor], *, model_name: str,
                   phase: str, batch: int, resolution: tuple[int, int], t5_len: int = 256,
                   device: str | torch.device = "meta", inputs: dict[str, torch.Tensor] | None = None) -> Step:
    """The ``encode``, ``step`` or ``decode`` phase of an SD3 pipeline as a Step.

    ``modules`` holds the components by name (only the phase's are used); ``resolution`` is the image's
    (width, height); ``batch`` counts images (the step phase runs the transformer on 2*batch rows).
    """
    if phase not in DIFFUSION_PHASES:
        raise PhaseError(f"phase {phase!r} is not a diffusion phase (use {', '.join(DIFFUSION_PHASES)})")
    missing = [c for c in PHASE_COMPONENTS[phase] if c not in modules]
    if missing:
        raise ValueError(f"the {phase} phase needs the components {', '.join(missing)}")
    used = {c: modules[c] for c in PHASE_COMPONENTS[phase]}
    if inputs is None:
        inputs = diffusion_inputs(phase, modules, batch, resolution, t5_len, device)
    constants = {k: v for k, v in constant_values.items() if k.split(".", 1)[0] in used}
    width, height = resolution
    return Step(model=model_name, family="diffusion", phase=phase, modules=used, fn=_phase_fn(phase, used),
                inputs=inputs, state={}, constant_values=constants,
                meta={"batch": batch, "resolution": [width, height], "t5_len": t5_len})
