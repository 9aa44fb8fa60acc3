"""A step backend wrapper for tests: runs every step on the real backend and hands each step's phase,
inputs and outputs to ``record``; everything else (busy time, forgetting, resets, closing) goes through."""

from __future__ import annotations

import torch

from tessera.serve.backend import SyncSteps


class RecordingBackend(SyncSteps):
    """Wraps a `tessera.serve.backend.StepBackend`; subclasses say what to keep in ``record``. Steps run one at
    a time, each to its end when submitted (``SyncSteps``), so every one of them is recorded."""

    def __init__(self, backend):
        self.backend = backend

    def run(self, phase: str, inputs: dict[str, torch.Tensor], owners=()) -> dict[str, torch.Tensor]:
        outputs = self.backend.run(phase, inputs, owners)
        self.record(phase, inputs, outputs)
        return outputs

    def record(self, phase: str, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def __getattr__(self, name: str):
        return getattr(self.backend, name)
