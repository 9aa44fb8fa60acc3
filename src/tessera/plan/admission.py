"""How many sequences one engine admits, from its devices' memory: the plan side of engine-like admission.

A serving engine admits sequences while free KV blocks last: each device keeps ``memory_utilization`` of
its memory, holds its weights and its peak activations, and pages the state of the sequences in flight
into the rest, up to ``max_num_seqs`` sequences per engine. An engine's memory on each target is therefore
``fixed + n x per_sequence`` for n sequences in flight (``MemoryShape``), where ``fixed`` is the weights,
the activation reserve and the state of phases a request passes through once (a prefill engine holds only
the prompt it computes), and ``per_sequence`` the repeated phase's state of one sequence at the mean
context of a request's life (paged: a sequence holds blocks for the tokens it has, not for its longest
context). The admitted count is the largest n every target can hold, rounded down to a batch the planner
traces (a multiple of the micro-batch count, of 16 above 32 sequences); "no fit" only when the weights and
one sequence do not fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tessera.plan.config import AdmissionConfig
from tessera.plan.deployment import EngineAdmission
from tessera.plan.targets import usable_memory


@dataclass(frozen=True)
class MemoryShape:
    """An engine's memory on each target as ``fixed + n x per_sequence`` bytes for n sequences in flight."""

    targets: list[str]
    capacity: np.ndarray  # bytes per target
    fixed: np.ndarray  # weights, activation reserve, once-per-request phases' state
    per_sequence: np.ndarray  # the repeated phase's state of one sequence
    tokens_per_sequence: float  # cache tokens a sequence holds on average (0: the state does not grow)
    weights: np.ndarray | None = None  # the weights' share of ``fixed`` per target
    reserve: float = 0.0  # the activation reserve included in ``fixed`` (every target)


def round_batch(n: int, micro_batches: int = 1) -> int:
    """``n`` rounded down to a batch the planner traces: a multiple of M, and of 16 above 32 sequences."""
    step = 16 if n > 32 else micro_batches
    step = max(step, micro_batches)
    return (n // step) * step


def admit(shape: MemoryShape, config: AdmissionConfig, cap: int, micro_batches: int = 1,
          cap_reason: str = "") -> EngineAdmission:
    """The sequences one engine of this memory shape admits (at most ``cap``; ``cap_reason`` says what set
    the cap), the cache tokens its free memory holds and what limits it. ``max_seqs`` 0 means no fit."""
    usable = usable_memory(shape.capacity, config.memory_utilization)
    free = usable - shape.fixed
    holding = shape.per_sequence > 0
    limited_by = cap_reason or f"--max-num-seqs {config.max_num_seqs}"
    n = cap
    if (free < 0).any():
        t = int(np.argmin(free))
        return EngineAdmission(0, 0, config.block_size,
                               f"no fit: {shape.targets[t]} needs {shape.fixed[t] / 1e9:.1f} GB for weights and "
                               f"activations, above {usable[t] / 1e9:.1f} GB ({config.memory_utilization:g} of "
                               f"{shape.capacity[t] / 1e9:.1f} GB)")
    if holding.any():
        fits = np.full(len(free), np.inf)
        fits[holding] = free[holding] / shape.per_sequence[holding]
        t = int(np.argmin(fits))
        by_memory = int(math.floor(fits[t] + 1e-9))
        if by_memory < 1:
            return EngineAdmission(0, 0, config.block_size,
                                   f"no fit: {shape.targets[t]} has {free[t] / 1e9:.2f} GB left after weights and "
                                   f"activations, below one sequence's state ({shape.per_sequence[t] / 1e9:.2f} GB)")
        if by_memory < cap:
            n = by_memory
            limited_by = (f"memory on {shape.targets[t]}: {free[t] / 1e9:.1f} GB for state, "
                          f"{shape.per_sequence[t] / 1e6:.1f} MB per sequence")
    kv_tokens = None
    if shape.tokens_per_sequence > 0 and holding.any():
        per_token = shape.per_sequence[holding] / shape.tokens_per_sequence
        kv_tokens = int(np.floor(free[holding] / per_token).min())
    rounded = round_batch(n, micro_batches)
    if rounded < 1:
        return EngineAdmission(0, kv_tokens, config.block_size,
                               f"no fit: {n} sequences do not fill one micro-batch of each of {micro_batches}")
    return EngineAdmission(rounded, kv_tokens, config.block_size, limited_by)
