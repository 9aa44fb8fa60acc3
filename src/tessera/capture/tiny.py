"""Tiny configs for tests: a small random-init model of each family, built in well under a second.

Each family of `tessera.capture.models.FAMILIES` has one config here, two layers deep and 64 wide, shaped
like the catalog model it stands for (Llama for llm, GptOss for moe, Mamba2 for ssm, Qwen2.5-VL for vlm,
an SD3.5-style pipeline for diffusion) so that every code path a full-size model takes (sliding
windows, YaRN, windowed vision attention, the three SD3 text encoders...) is exercised at toy scale.
They are not in the catalog: a test saves one to a folder (``config.save_pretrained``) when it needs a
local model directory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessera.capture.models import FAMILIES
from tessera.errors import TesseraError

if TYPE_CHECKING:  # transformers takes seconds to import; the functions below import it when called
    from transformers import PretrainedConfig


def tiny_config(family: str, dtype: str = "bfloat16") -> PretrainedConfig | dict[str, dict[str, Any]]:
    """A small random-init config of a family: 2 layers, hidden size 64, built in well under a second.

    Returns a transformers ``PretrainedConfig`` for llm (Llama), moe (GptOss), ssm (Mamba2) and vlm
    (Qwen2.5-VL; build it with ``Qwen2_5_VLForConditionalGeneration``, not ``AutoModelForCausalLM``).
    For diffusion, a dict of component name to config dict laid out like ``sd3.5-medium``: transformer,
    text_encoder, text_encoder_2, text_encoder_3, vae, scheduler. The transformers components carry
    ``dtype``; diffusers configs have no dtype field, so their caller casts them.
    """
    builders = {
        "llm": _tiny_llm,
        "moe": _tiny_moe,
        "ssm": _tiny_ssm,
        "vlm": _tiny_vlm,
        "diffusion": _tiny_diffusion,
    }
    if family not in builders:
        raise TesseraError(f"unknown model family {family!r}; families: {', '.join(FAMILIES)}")
    return builders[family](dtype)


def _tiny_llm(dtype: str) -> PretrainedConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype=dtype,
    )


def _tiny_moe(dtype: str) -> PretrainedConfig:
    from transformers import GptOssConfig

    return GptOssConfig(
        architectures=["GptOssForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=128,
        # gpt-oss's YaRN, scaled so that original context x factor = max_position_embeddings.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype=dtype,
    )


def _tiny_ssm(dtype: str) -> PretrainedConfig:
    from transformers import Mamba2Config

    return Mamba2Config(
        architectures=["Mamba2ForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        expand=2,  # intermediate 128 = num_heads 8 x head_dim 16
        num_heads=8,
        head_dim=16,
        state_size=16,
        n_groups=1,
        chunk_size=8,
        conv_kernel=4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype=dtype,
    )


def _tiny_vlm(dtype: str) -> PretrainedConfig:
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        text_config={
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,  # head_dim 16
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "max_window_layers": 2,
            "use_sliding_window": False,
            "sliding_window": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": 505,
            "eos_token_id": 506,
            "pad_token_id": 507,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "out_hidden_size": 64,  # = text hidden size
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "window_size": 56,  # 2 x 2 merged tokens per attention window
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
        },
        image_token_id=500,
        video_token_id=501,
        vision_start_token_id=502,
        vision_end_token_id=503,
        dtype=dtype,
    )


def _tiny_diffusion(dtype: str) -> dict[str, dict[str, Any]]:
    # Dimensions wire together as in StableDiffusion3Pipeline: prompt tokens are the two CLIP
    # penultimate hidden states side by side (32 + 48), zero-padded to T5's width (96), then T5's tokens;
    # the pooled vector is the two CLIP projections side by side (32 + 48 = 80).
    clip = {
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "vocab_size": 1000,
        "max_position_embeddings": 77,  # SD3 pads every CLIP prompt to 77 tokens
    }
    return {
        "transformer": {
            "_class_name": "SD3Transformer2DModel",
            "sample_size": 8,
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 16,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 96,
            "caption_projection_dim": 32,
            "pooled_projection_dim": 80,
            "pos_embed_max_size": 16,
            "dual_attention_layers": [0],
            "qk_norm": "rms_norm",
        },
        "text_encoder": {
            "architectures": ["CLIPTextModelWithProjection"],
            "model_type": "clip_text_model",
            **clip,
            "hidden_size": 32,
            "intermediate_size": 64,
            "projection_dim": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "hidden_act": "quick_gelu",
            "dtype": dtype,
        },
        "text_encoder_2": {
            "architectures": ["CLIPTextModelWithProjection"],
            "model_type": "clip_text_model",
            **clip,
            "hidden_size": 48,
            "intermediate_size": 96,
            "projection_dim": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "hidden_act": "gelu",
            "dtype": dtype,
        },
        "text_encoder_3": {
            "architectures": ["T5EncoderModel"],
            "model_type": "t5",
            "vocab_size": 256,
            "d_model": 96,
            "d_kv": 16,
            "d_ff": 128,
            "num_layers": 2,
            "num_heads": 4,
            "feed_forward_proj": "gated-gelu",
            "dense_act_fn": "gelu_new",
            "relative_attention_num_buckets": 8,
            "relative_attention_max_distance": 16,
            "is_encoder_decoder": False,
            "pad_token_id": 0,
            "eos_token_id": 1,
            "dtype": dtype,
        },
        "vae": {
            "_class_name": "AutoencoderKL",
            "in_channels": 3,
            "out_channels": 3,
            "latent_channels": 16,
            "block_out_channels": [16, 32],  # one 2x downsampling: a 16x16 image has 8x8 latents
            "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
            "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"],
            "layers_per_block": 1,
            "norm_num_groups": 8,
            "act_fn": "silu",
            "sample_size": 16,
            "scaling_factor": 1.5305,
            "shift_factor": 0.0609,
            "force_upcast": True,
            "use_quant_conv": False,
            "use_post_quant_conv": False,
            "latents_mean": None,
            "latents_std": None,
        },
        "scheduler": {
            "_class_name": "FlowMatchEulerDiscreteScheduler",
            "num_train_timesteps": 1000,
            "shift": 3.0,
        },
    }
