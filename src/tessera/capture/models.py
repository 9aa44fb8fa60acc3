"""The model catalog: which models Tessera knows, and how their configs are read.

A model is named either by its catalog name (``llama-3.1-8b``; see ``catalog/catalog.json`` and
``tessera models``) or by the path of a local Hugging Face model directory (one holding
``config.json``; or a diffusers pipeline folder with ``model_index.json`` or
``transformer/config.json``). `resolve_model` turns either into a `ModelSpec`; `load_config` reads and
checks its config. Configs are hyperparameters only: nothing here downloads anything.

Two neighbours build on it: `tessera.capture.tiny` (small random-init configs of each family, for
tests) and `tessera.capture.smollm2` (the real weights of the catalog's ``smollm2-135m``). Neither is
imported here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.errors import ConfigError, UnknownModelError
from tessera.limits import EXPERTS, HEADS, LAYER_WIDTH, LAYERS, TOKENS, VOCAB, Limit

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

# Size fields of transformers and diffusers configs and the limit each is checked against (at any depth of
# the document: text_config, vision_config...), before a module is built.
SIZE_LIMITS: dict[str, Limit] = {
    **dict.fromkeys(("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "head_dim", "d_model", "d_ff", "d_kv", "attention_head_dim", "joint_attention_dim",
                     "pooled_projection_dim", "caption_projection_dim", "projection_dim", "state_size", "n_groups",
                     "conv_kernel", "patch_size", "in_channels", "out_channels", "latent_channels",
                     "out_hidden_size", "sample_size", "block_out_channels", "embed_dim", "in_chans",
                     "spatial_merge_size", "temporal_patch_size", "window_size", "time_step_rank",
                     "pos_embed_max_size"), LAYER_WIDTH),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "depth", "layers_per_block"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "num_key_value_heads", "num_heads"), HEADS),
    **dict.fromkeys(("num_local_experts", "num_experts", "num_experts_per_tok"), EXPERTS),
    "vocab_size": VOCAB,
    **dict.fromkeys(("max_position_embeddings", "sliding_window"), TOKENS),
}


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
        check_sizes(raw, path)
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


def check_sizes(raw: dict[str, Any], path: Path | str, prefix: str = "") -> None:
    """Refuse a size field of a config (at any depth) beyond its limit in `tessera.limits` (a `LimitError`
    naming the file and the field), before anything is built from it."""
    for key, value in raw.items():
        where = f"{path}: field '{prefix}{key}'"
        if isinstance(value, dict):
            check_sizes(value, path, f"{prefix}{key}.")
        elif key in SIZE_LIMITS:
            values = value if isinstance(value, list) else [value]
            for item in values:
                if isinstance(item, int) and not isinstance(item, bool):
                    SIZE_LIMITS[key].check(item, where)


def _validate(raw: dict[str, Any], family: str, path: Path) -> None:
    check_sizes(raw, path)
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
