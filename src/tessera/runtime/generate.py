"""Generation over step runners (eager model steps, replayed programs, distributed runners): greedy, or
temperature / top-p sampling with a seed, done by the step's own sampler kernel (`tessera::sample`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tessera.errors import TesseraError
from tessera.graph.ir import KernelGraph
from tessera.kernels.prepacked import PackedWeights
from tessera.kernels.sample import step_seed
from tessera.program.program import single_device_program
from tessera.runtime.executor import Executor

# runner(phase, inputs) -> the step's outputs (``tokens`` [B], ``logits`` [B, S, vocab]); the runner owns the state
StepRunner = Callable[[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class SamplingError(TesseraError, ValueError):
    """Sampling options out of range, or nothing to generate from."""


@dataclass(frozen=True)
class Sampling:
    """Greedy (temperature 0) or temperature / top-p sampling with a seed; any accepted value samples safely
    (the sampler kernel treats a temperature too small to divide by as greedy and keeps at least one token)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SamplingError(f"--temperature must be a finite number >= 0 (got {self.temperature})")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise SamplingError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if not -(2**63) <= self.seed < 2**64:
            raise SamplingError(f"--seed must fit in 64 bits (got {self.seed})")

    def inputs(self, index: int) -> dict[str, float | int]:
        """The sampler's per-row values for the ``index``-th generated token (its seed mixed with the index)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "seeds": step_seed(self.seed, index)}


def sampling_inputs(rows: list[dict[str, float | int]]) -> dict[str, torch.Tensor]:
    """Per-row sampler values (`Sampling.inputs`) -> the step's ``temperature``, ``top_p`` and ``seeds`` tensors."""
    return {"temperature": torch.tensor([r["temperature"] for r in rows], dtype=torch.float32),
            "top_p": torch.tensor([r["top_p"] for r in rows], dtype=torch.float32),
            "seeds": torch.tensor([r["seeds"] for r in rows], dtype=torch.int64)}


def generate(runner: StepRunner, prompt_ids: list[int],
             max_new_tokens: int, eos_token_id: int | None = None, sampling: Sampling = Sampling(),
             on_token: Callable[[int], None] | None = None) -> list[int]:
    """Prefill the prompt into slot 0, then decode token by token; returns the new token ids."""
    if not prompt_ids:
        raise SamplingError("the prompt is empty: nothing to prefill")
    slots = torch.tensor([0])
    outputs = runner("prefill", {"input_ids": torch.tensor([prompt_ids]), "slots": slots,
                                 **sampling_inputs([sampling.inputs(0)])})
    out: list[int] = []
    position = len(prompt_ids)
    for i in range(max_new_tokens):
        token = int(outputs["tokens"][0])
        out.append(token)
        if on_token is not None:
            on_token(token)
        if token == eos_token_id or i == max_new_tokens - 1:
            break
        outputs = runner("decode", {"input_ids": torch.tensor([[token]]), "positions": torch.tensor([position]),
                                    "slots": slots, **sampling_inputs([sampling.inputs(i + 1)])})
        position += 1
    return out


class ReplayRunner:
    """Runs each phase by replaying its kernel graph on one device (the reference Program); with
    ``batch_invariant``, GEMMs row by row (see `Executor`)."""

    def __init__(self, graphs: Mapping[str, KernelGraph], weights: Mapping[str, torch.Tensor],
                 state: dict[str, torch.Tensor], device: str = "cpu", batch_invariant: bool = False):
        self.state = state
        packed = PackedWeights()  # one packed copy of each GEMM's weights, for every phase
        self.executors = {phase: Executor(g, single_device_program(g, device), weights, device, batch_invariant,
                                          packed) for phase, g in graphs.items()}

    def __call__(self, phase: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.executors[phase].run(inputs, self.state)

    def warm(self) -> dict[str, str]:
        """Run every phase once on zero inputs, then zero the state, so that a served first step of a phase does
        not pay what a first step pays once (calls bound, buffers allocated, packed weights made; a worker's load
        does the same, `Worker._warm`). Returns the phases whose pass failed, which run cold, and why."""
        from tessera.runtime.probe import zero_state

        failed = {}
        for phase, ex in self.executors.items():
            try:
                ex.run(zero_state(ex.graph, ex.program.inputs), self.state)
            except Exception as e:  # noqa: BLE001 - a step on real inputs still runs, and says what fails
                failed[phase] = f"{type(e).__name__}: {e}"
        for t in self.state.values():
            t.zero_()
        return failed
