"""Generation over step runners (eager model steps, replayed programs, distributed runners): greedy, or
temperature / top-p sampling with a seed."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tessera.errors import TesseraError
from tessera.graph.ir import KernelGraph
from tessera.program.program import single_device_program
from tessera.runtime.executor import Executor

# runner(phase, inputs) -> logits [B, S, vocab]; the runner owns the engine state
StepRunner = Callable[[str, dict[str, torch.Tensor]], torch.Tensor]


class SamplingError(TesseraError, ValueError):
    """Sampling options out of range, or nothing to generate from."""


@dataclass(frozen=True)
class Sampling:
    """Greedy (temperature 0) or temperature / top-p sampling with a seed."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise SamplingError(f"--temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"--top-p must be in (0, 1] (got {self.top_p})")

    def picker(self) -> Callable[[torch.Tensor], int]:
        """A function from one row of logits to the next token."""
        if self.temperature == 0:
            return lambda logits: int(logits.argmax())
        gen = torch.Generator().manual_seed(self.seed)

        def pick(logits: torch.Tensor) -> int:
            probs = torch.softmax(logits.float() / self.temperature, dim=-1)
            if self.top_p < 1:
                sorted_p, order = probs.sort(descending=True)
                keep = sorted_p.cumsum(0) - sorted_p < self.top_p
                probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
            return int(torch.multinomial(probs, 1, generator=gen))

        return pick


def generate(runner: StepRunner, prompt_ids: list[int],
             max_new_tokens: int, eos_token_id: int | None = None, sampling: Sampling = Sampling(),
             on_token: Callable[[int], None] | None = None) -> list[int]:
    """Prefill the prompt into slot 0, then decode token by token; returns the new token ids."""
    if not prompt_ids:
        raise SamplingError("the prompt is empty: nothing to prefill")
    pick = sampling.picker()
    slots = torch.tensor([0])
    logits = runner("prefill", {"input_ids": torch.tensor([prompt_ids]), "slots": slots})
    out: list[int] = []
    position = len(prompt_ids)
    for i in range(max_new_tokens):
        token = pick(logits[0, -1])
        out.append(token)
        if on_token is not None:
            on_token(token)
        if token == eos_token_id or i == max_new_tokens - 1:
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
