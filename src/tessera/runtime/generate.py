"""Greedy generation over step runners: eager model steps, or programs replayed from kernel graphs."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from tessera.graph.ir import KernelGraph
from tessera.program.program import single_device_program
from tessera.runtime.executor import Executor

# runner(phase, inputs) -> logits [B, 1, vocab]; the runner owns the engine state
StepRunner = Callable[[str, dict[str, torch.Tensor]], torch.Tensor]


def greedy_generate(runner: StepRunner, prompt_ids: list[int], max_new_tokens: int,
                    eos_token_id: int | None = None, slot: int = 0) -> list[int]:
    """Prefill the prompt into ``slot``, then decode greedily; returns the new token ids."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: nothing to prefill")
    slots = torch.tensor([slot])
    logits = runner("prefill", {"input_ids": torch.tensor([prompt_ids]), "slots": slots})
    out: list[int] = []
    position = len(prompt_ids)
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token == eos_token_id:
            break
        logits = runner("decode", {"input_ids": torch.tensor([[token]]), "positions": torch.tensor([position]),
                                   "slots": slots})
        position += 1
    return out


class ReplayRunner:
    """Runs each phase by replaying its kernel graph on one device (the reference Program)."""

    def __init__(self, graphs: Mapping[str, KernelGraph], weights: Mapping[str, torch.Tensor],
                 state: dict[str, torch.Tensor], device: str = "cpu"):
        self.state = state
        self.executors = {phase: Executor(g, single_device_program(g, device), weights, device)
                          for phase, g in graphs.items()}

    def __call__(self, phase: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.executors[phase].run(inputs, self.state)["logits"]
