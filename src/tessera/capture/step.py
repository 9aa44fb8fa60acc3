"""A traceable model step: a function over named inputs and engine-owned state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

StepFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]],
                  dict[str, torch.Tensor]]


@dataclass
class Step:
    """What one model step reads and writes, ready to trace or to run eagerly.

    ``fn(inputs, state, constants)`` returns named outputs. ``modules`` are the named roots whose
    parameters and persistent buffers are the weights (a single root named ``""`` keeps plain
    state-dict names; pipeline components are prefixed by their root name). ``constant_values``
    holds host (CPU) values of every constant by name: the module's non-persistent buffers (by
    qualified name) and the entries of ``constants``.
    """

    model: str
    family: str
    phase: str
    modules: dict[str, nn.Module]
    fn: StepFn
    inputs: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    constant_values: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def run(self) -> dict[str, torch.Tensor]:
        """Run the step eagerly (no recording)."""
        with torch.no_grad():
            return self.fn(self.inputs, self.state, self.constants)


def qualified(root: str, name: str) -> str:
    """Stable name of a tensor under a named root."""
    return f"{root}.{name}" if root else name
