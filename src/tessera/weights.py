"""Weights as safetensors files keyed by state-dict name (tied weights stored once)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tessera.errors import TesseraError


class WeightsError(TesseraError):
    """Weights are missing or do not match the graph."""


def unique_state(modules: dict[str, nn.Module]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """State-dict tensors of named roots, each storage once, and alias -> canonical name for the rest."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    for root, mod in modules.items():
        for name, t in mod.state_dict(keep_vars=True).items():
            full = f"{root}.{name}" if root else name
            key = t.untyped_storage()._cdata
            if key in seen:
                aliases[full] = seen[key]
                continue
            seen[key] = full
            tensors[full] = t.detach().contiguous()
    return tensors, aliases


def save_weights(modules: dict[str, nn.Module], path: str | Path) -> Path:
    """Write the weights of ``modules`` to one safetensors file (aliases in its metadata)."""
    tensors, aliases = unique_state(modules)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"tessera_aliases": json.dumps(aliases)})
    return path


def load_weights(path: str | Path, names: list[str] | None = None,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read weights (all, or only ``names``) from a safetensors file into memory of their own (not a map of the
    file); aliases resolve to their target and share its tensor."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist")
    out: dict[str, torch.Tensor] = {}
    read: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        meta = f.metadata() or {}
        aliases = json.loads(meta.get("tessera_aliases", "{}"))
        keys = set(f.keys())
        for name in (names if names is not None else sorted(keys)):
            key = name if name in keys else aliases.get(name)
            if key is None or key not in keys:
                continue
            if key not in read:
                tensor = f.get_tensor(key)
                # safetensors maps the file into CPU tensors: decode GEMMs reading those pages ran as fast as on
                # a private copy on an idle development VM, but up to 1.7x slower while another process used the
                # cores (as a worker's peer does)
                read[key] = tensor.clone() if tensor.device.type == "cpu" else tensor
            out[name] = read[key]
    return out


def load_graph_weights(graph, weights_path: str | Path | list, names: list[str] | None = None
                       ) -> dict[str, torch.Tensor]:
    """The weights ``names`` (default: every weight buffer of the KernelGraph ``graph``) from one or more
    safetensors files, each under its own name and its aliases' (tied weights)."""
    names = [n for n, b in graph.buffers.items() if b.kind == "weight"] if names is None else names
    wanted = set(names) | {a for n in names for a in graph.buffers[n].aliases}
    out: dict[str, torch.Tensor] = {}
    for path in [weights_path] if isinstance(weights_path, str | Path) else weights_path:
        out.update(load_weights(path, sorted(wanted - set(out))))
    return out
