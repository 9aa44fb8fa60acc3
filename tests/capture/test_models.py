"""The model catalog, local model directories and config checks (tessera.capture.models)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    CLIPTextModelWithProjection,
    PretrainedConfig,
    Qwen2_5_VLForConditionalGeneration,
    T5EncoderModel,
)

from tessera.capture.models import (
    CATALOG_DIR,
    FAMILIES,
    ModelSpec,
    component_class,
    list_models,
    load_config,
    resolve_model,
)
from tessera.capture.tiny import tiny_config
from tessera.errors import ConfigError, TesseraError, UnknownModelError

# Measured once with torch 2.13, transformers 5.24, diffusers 0.42 (tied embeddings counted once).
EXPECTED = {
    "llama-3.1-8b": ("llm", "LlamaForCausalLM", 8_030_261_248),
    "gpt-oss-20b": ("moe", "GptOssForCausalLM", 20_914_757_184),
    "mamba-codestral-7b": ("ssm", "Mamba2ForCausalLM", 7_285_403_648),
    "qwen2.5-vl-7b": ("vlm", "Qwen2_5_VLForConditionalGeneration", 8_292_166_656),
    "sd3.5-medium": ("diffusion", "SD3Transformer2DModel", 2_243_171_520),
    "qwen3-235b-a22b": ("moe", "Qwen3MoeForCausalLM", 235_093_634_560),
    "smollm2-135m": ("llm", "LlamaForCausalLM", 134_515_008),
}
SD35_COMPONENTS = {
    "transformer": ("SD3Transformer2DModel", 2_243_171_520),
    "text_encoder": ("CLIPTextModelWithProjection", 123_650_304),
    "text_encoder_2": ("CLIPTextModelWithProjection", 694_659_840),
    "text_encoder_3": ("T5EncoderModel", 4_762_310_656),
    "vae": ("AutoencoderKL", 83_819_683),
    "scheduler": ("FlowMatchEulerDiscreteScheduler", 0),
}
SD35_PIPELINE_PARAMS = 7_907_612_003


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def hf_config(d: dict) -> PretrainedConfig:
    """A transformers config from a pipeline component's dict."""
    rest = {k: v for k, v in d.items() if k != "model_type"}
    return AutoConfig.for_model(d["model_type"], **rest)


def build_component(name: str, d: dict):
    cls = {
        "transformer": SD3Transformer2DModel,
        "vae": AutoencoderKL,
        "text_encoder": CLIPTextModelWithProjection,
        "text_encoder_2": CLIPTextModelWithProjection,
        "text_encoder_3": T5EncoderModel,
    }[name]
    if name.startswith("text_encoder"):
        return cls._from_config(hf_config(d))
    return cls.from_config(d)


# ---------------------------------------------------------------------------------------------------
# Catalog


def test_catalog_lists_the_seven_models():
    specs = list_models()
    assert [s.name for s in specs] == list(EXPECTED)
    for spec in specs:
        family, hf_class, params = EXPECTED[spec.name]
        assert (spec.family, spec.hf_class, spec.params) == (family, hf_class, params)
        assert spec.family in FAMILIES
        assert not spec.local
        assert (spec.config_dir / ("transformer" if spec.components else "") / "config.json").is_file()
    assert resolve_model("sd3.5-medium").components == tuple(SD35_COMPONENTS)
    assert all(s.components == () for s in specs if s.family != "diffusion")


def test_catalog_rows_carry_source_licence_and_date():
    rows = json.loads((CATALOG_DIR / "catalog.json").read_text())["models"]
    for row in rows:
        assert row["as_of"] == "2026-11"
        assert row["licence"]
        assert "/" in row["source"]
    sd = next(r for r in rows if r["name"] == "sd3.5-medium")
    assert {c["name"]: (c["class"], c["params"]) for c in sd["components"]} == SD35_COMPONENTS
    assert sum(c["params"] for c in sd["components"]) == sd["pipeline_params"] == SD35_PIPELINE_PARAMS
    assert resolve_model("gpt-oss-20b").source == "openai/gpt-oss-20b"


def test_resolve_is_case_insensitive():
    assert resolve_model("Llama-3.1-8B") == resolve_model("llama-3.1-8b")
    assert resolve_model(" QWEN2.5-VL-7B ").family == "vlm"


def test_unknown_model_lists_the_catalog():
    with pytest.raises(UnknownModelError) as err:
        resolve_model("llama-9000")
    message = str(err.value)
    assert "llama-9000" in message
    for name in EXPECTED:
        assert name in message
    assert "local Hugging Face model directory" in message
    assert isinstance(err.value, TesseraError)


# ---------------------------------------------------------------------------------------------------
# Loading and checking configs


@pytest.mark.parametrize("name", [n for n in EXPECTED if n != "sd3.5-medium"])
def test_catalog_configs_load(name):
    spec = resolve_model(name)
    config = load_config(spec)
    assert isinstance(config, PretrainedConfig)
    assert spec.hf_class in config.architectures


def test_pipeline_components_load_as_dicts():
    spec = resolve_model("sd3.5-medium")
    assert load_config(spec) == load_config(spec, "transformer")
    for comp, (cls, _) in SD35_COMPONENTS.items():
        assert isinstance(load_config(spec, comp), dict)
        assert component_class(spec, comp) == cls
    with pytest.raises(ConfigError, match="text_encoder_4"):
        load_config(spec, "text_encoder_4")
    with pytest.raises(ConfigError, match="no component"):
        load_config(resolve_model("llama-3.1-8b"), "vae")


def copy_catalog_model(name: str, dest: Path) -> Path:
    shutil.copytree(CATALOG_DIR / name, dest)
    return dest


def test_broken_json_names_file_line_and_column(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}\n')
    with pytest.raises(ConfigError) as err:
        resolve_model(str(tmp_path))
    assert str(path) in str(err.value)
    assert "line 3, column 21" in str(err.value)


@pytest.mark.parametrize(
    ("name", "field", "where"),
    [
        ("llama-3.1-8b", "num_hidden_layers", None),
        ("llama-3.1-8b", "max_position_embeddings", None),
        ("mamba-codestral-7b", "state_size", None),
        ("mamba-codestral-7b", "num_heads", None),
        ("gpt-oss-20b", "num_experts_per_tok", None),
        ("qwen2.5-vl-7b", "vocab_size", None),
        ("qwen2.5-vl-7b", "depth", "vision_config"),
    ],
)
def test_missing_field_names_file_and_field(tmp_path, name, field, where):
    folder = copy_catalog_model(name, tmp_path / name)
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    del (raw[where] if where else raw)[field]
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        load_config(resolve_model(str(folder)))
    assert str(path) in str(err.value)
    assert (f"{where}.{field}" if where else f"'{field}'") in str(err.value)
    assert "missing" in str(err.value)


@pytest.mark.parametrize("bad", [0, -4096, 4096.0, "4096", True, None])
def test_invalid_hidden_size(tmp_path, bad):
    folder = copy_catalog_model("llama-3.1-8b", tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    raw["hidden_size"] = bad
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"'hidden_size' must be a positive integer") as err:
        load_config(resolve_model(str(folder)))
    assert str(folder / "config.json") in str(err.value)


def test_broken_pipeline_component(tmp_path):
    folder = copy_catalog_model("sd3.5-medium", tmp_path / "sd")
    path = folder / "transformer" / "config.json"
    raw = json.loads(path.read_text())
    del raw["joint_attention_dim"]
    path.write_text(json.dumps(raw))
    (folder / "vae" / "config.json").write_text("{")
    spec = resolve_model(str(folder))
    with pytest.raises(ConfigError, match="joint_attention_dim") as err:
        load_config(spec)
    assert str(path) in str(err.value)
    with pytest.raises(ConfigError, match=r"vae/config.json: not valid JSON at line 1, column 2"):
        load_config(spec, "vae")


def test_directory_without_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_unsupported_local_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ConfigError, match="cannot tell the model family of model_type='bert'"):
        resolve_model(str(tmp_path))


# ---------------------------------------------------------------------------------------------------
# Local model directories


@pytest.mark.parametrize("family", ["llm", "moe", "ssm", "vlm"])
def test_local_hf_directory(tmp_path, family):
    folder = tmp_path / f"my-{family}"
    tiny_config(family).save_pretrained(folder)
    spec = resolve_model(str(folder))
    assert spec == ModelSpec(
        name=f"my-{family}",
        family=family,
        hf_class=tiny_config(family).architectures[0],
        params=None,
        source=str(folder.resolve()),
        config_dir=folder.resolve(),
        local=True,
    )
    assert resolve_model(str(folder / "config.json")) == spec
    assert type(load_config(spec)) is type(tiny_config(family))


def test_local_copy_of_catalog_model_and_family_from_architectures(tmp_path):
    spec = resolve_model(str(copy_catalog_model("qwen3-235b-a22b", tmp_path / "q")))
    assert (spec.family, spec.hf_class, spec.local) == ("moe", "Qwen3MoeForCausalLM", True)
    folder = copy_catalog_model("mamba-codestral-7b", tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    del raw["model_type"]
    (folder / "config.json").write_text(json.dumps(raw))
    assert resolve_model(str(folder)).family == "ssm"


@pytest.mark.parametrize("with_index", [True, False])
def test_local_diffusers_pipeline(tmp_path, with_index):
    components = tiny_config("diffusion")
    for name, d in components.items():
        (tmp_path / name).mkdir()
        fname = "scheduler_config.json" if name == "scheduler" else "config.json"
        (tmp_path / name / fname).write_text(json.dumps(d))
    (tmp_path / "tokenizer").mkdir()  # not a model component: no config.json
    (tmp_path / "tokenizer" / "tokenizer_config.json").write_text("{}")
    if with_index:
        index = {"_class_name": "StableDiffusion3Pipeline", "tokenizer": ["transformers", "CLIPTokenizer"]}
        index |= {n: ["diffusers", "X"] for n in components}
        index["image_encoder"] = [None, None]
        (tmp_path / "model_index.json").write_text(json.dumps(index))
    spec = resolve_model(str(tmp_path))
    assert spec.family == "diffusion"
    assert spec.hf_class == "SD3Transformer2DModel"
    assert spec.components == (
        "transformer",
        "scheduler",
        "text_encoder",
        "text_encoder_2",
        "text_encoder_3",
        "vae",
    )
    assert load_config(spec, "vae") == components["vae"]
    assert component_class(spec, "text_encoder_3") == "T5EncoderModel"


# ---------------------------------------------------------------------------------------------------
# Full-size models on the meta device


@pytest.mark.parametrize("name", [n for n in EXPECTED if n != "sd3.5-medium"])
def test_full_size_parameter_counts_on_meta(name):
    spec = resolve_model(name)
    config = load_config(spec)
    with torch.device("meta"):
        if spec.family == "vlm":
            model = Qwen2_5_VLForConditionalGeneration._from_config(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == spec.hf_class
    assert n_params(model) == spec.params == EXPECTED[name][2]
    if spec.family == "vlm":
        assert n_params(model.model.visual) == 676_550_144


def test_sd35_component_parameter_counts_on_meta():
    spec = resolve_model("sd3.5-medium")
    total = 0
    for comp, (cls, params) in SD35_COMPONENTS.items():
        if comp == "scheduler":
            FlowMatchEulerDiscreteScheduler.from_config(load_config(spec, comp))
            continue
        with torch.device("meta"):
            model = build_component(comp, load_config(spec, comp))
        assert type(model).__name__ == cls
        assert n_params(model) == params, comp
        total += params
    assert total == SD35_PIPELINE_PARAMS
