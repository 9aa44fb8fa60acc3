"""Instantiate model modules on `meta` (no memory, no downloads) or on the CPU with random weights."""

from __future__ import annotations

from collections.abc import Callable

import torch
from accelerate import init_empty_weights
from torch import nn

from tessera.capture.step import qualified


def non_persistent_buffers(module: nn.Module, root: str = "") -> dict[str, torch.Tensor]:
    """Non-persistent buffers (constants such as rotary ``inv_freq``) by qualified name."""
    out: dict[str, torch.Tensor] = {}
    for mod_name, mod in module.named_modules():
        for buf_name in mod._non_persistent_buffers_set:
            buf = mod._buffers.get(buf_name)
            if buf is not None:
                out[qualified(root, qualified(mod_name, buf_name))] = buf
    return out


def instantiate(factory: Callable[[], nn.Module], device: str = "meta", seed: int = 0,
                root: str = "") -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Build ``factory()`` on ``device`` and return it with host values of its constant buffers.

    On ``meta`` the parameters cost nothing; buffers are first computed on the host so constants keep
    their values, then moved to ``meta`` like everything else. On the CPU the weights are randomly
    initialised from ``seed``.
    """
    if device == "meta":
        with init_empty_weights(include_buffers=False):
            module = factory()
        values = {k: v.detach().clone() for k, v in non_persistent_buffers(module, root).items()}
        for mod in module.modules():
            for name, buf in mod._buffers.items():
                if buf is not None and buf.device.type != "meta":
                    mod._buffers[name] = buf.to("meta")
    else:
        torch.manual_seed(seed)
        with torch.device(device):
            module = factory()
        values = {k: v.detach() for k, v in non_persistent_buffers(module, root).items()}
    module.eval()
    module.requires_grad_(False)
    return module, values
