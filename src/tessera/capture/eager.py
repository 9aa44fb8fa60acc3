"""Run model steps eagerly (the reference every other execution is compared with)."""

from __future__ import annotations

import torch
from torch import nn

from tessera.capture.models import ModelSpec
from tessera.capture.phases import StepShape, step_for


class EagerRunner:
    """A step runner (phase, inputs) -> outputs (``logits``, ``tokens``) over one engine state, running the model
    eagerly."""

    def __init__(self, spec: ModelSpec, model: nn.Module, constant_values: dict, slots: int, ctx: int):
        self.spec, self.model, self.values = spec, model, constant_values
        self.ctx = ctx
        self.state: dict[str, torch.Tensor] | None = None
        self.slots = slots

    def __call__(self, phase: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batch, seq = inputs["input_ids"].shape
        shape = StepShape(batch=self.slots, seq=seq, ctx=self.ctx)
        step = step_for(self.spec, self.model, self.values, phase, shape, device="cpu", inputs=inputs,
                        state=self.state)
        self.state = step.state
        return step.run()
