"""Production kernel graphs: Hugging Face models rewired to run the fused units a serving engine runs.

A model is built by transformers as usual (so configs, parameter names and checkpoints stay Hugging
Face's); `apply_production` then replaces the forwards of its modules, instance by instance, with
forwards that call Tessera's fused ops (`tessera.kernels`): one kernel per fused unit in a trace, the
op's PyTorch body on the CPU. Module calls are kept, so a trace still attributes every kernel to its
module scope. Which forwards a model type gets is decided by its entry in `_FAMILY_MODULES`; a model
type without one keeps the eager forward, and the report says so.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from torch import nn

from tessera.capture.shapes import DEFAULT_GRAPH, GRAPHS
from tessera.errors import TesseraError

# model_type -> module of tessera.capture.production that rewires it (its `apply(model) -> FusionReport`)
_FAMILY_MODULES = {
    "llama": "decoder",
    "mistral": "decoder",
    "qwen2": "decoder",
    "gpt_oss": "decoder",
    "qwen3_moe": "decoder",
    "mamba2": "mamba2",
    "qwen2_5_vl": "qwen2_5_vl",
}


class GraphKindError(TesseraError, ValueError):
    """An unknown kernel-graph kind was asked for."""


@dataclass
class FusionReport:
    """How a built model will be traced: the graph kind, the fused units it runs, and what fell back.

    ``fallbacks`` name each part that keeps Hugging Face's eager forward in a production graph, with the
    reason (e.g. a model type Tessera has no fused units for).
    """

    graph: str
    fused: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)

    def to_meta(self) -> dict:
        """The report as step / graph meta."""
        meta: dict = {"graph": self.graph}
        if self.fallbacks:
            meta["fallbacks"] = list(self.fallbacks)
        return meta


def check_graph(graph: str) -> str:
    """``graph`` if it names a kernel-graph kind, else a clear error."""
    if graph not in GRAPHS:
        raise GraphKindError(f"--graph {graph!r} is not a kernel-graph kind; use one of {', '.join(GRAPHS)}")
    return graph


def model_type_of(config) -> str:
    """The Hugging Face ``model_type`` of a config (a VLM's outer type, not its text model's)."""
    return str(getattr(config, "model_type", "") or "")


def apply_production(model: nn.Module, config, graph: str = DEFAULT_GRAPH) -> FusionReport:
    """Rewire ``model`` (built from ``config``) for the ``graph`` kind and attach the report to it.

    ``eager`` leaves the model as transformers built it. ``production`` applies the model type's fused
    forwards; a model type with none keeps its eager forward, reported as a fallback.
    """
    check_graph(graph)
    model_type = model_type_of(config)
    if graph == "eager":
        report = FusionReport("eager")
    elif model_type in _FAMILY_MODULES:
        module = importlib.import_module(f"{__name__}.{_FAMILY_MODULES[model_type]}")
        report = module.apply(model)
    else:
        report = FusionReport("production", fallbacks=[
            f"model type {model_type!r} has no fused units in Tessera: its Hugging Face eager forward is "
            f"traced op by op (fused model types: {', '.join(sorted(_FAMILY_MODULES))})"])
    model.tessera_fusion = report
    return report


def fusion_of(model: nn.Module | dict[str, nn.Module]) -> FusionReport | None:
    """The report attached to ``model`` (a pipeline's components: the first one's); None if it has none."""
    if isinstance(model, dict):
        return next((fusion_of(m) for m in model.values()), None)
    return getattr(model, "tessera_fusion", None)
