"""Fixtures shared by the runtime tests."""

from __future__ import annotations

import pytest
import torch

SMOLLM2_CTX = 64  # the cache of the shared smollm2-135m decode step (tests read it off the graph: meta["ctx"])


@pytest.fixture(scope="module")
def smollm2_step():
    """A real smollm2-135m decode step of two rows (tokens 504 and 3458 at positions 5 and 17, a cache of
    ``SMOLLM2_CTX``): the step, its graph traced on the CPU, its weights, and a seeded random state to clone."""
    from tessera.capture.trace import trace
    from tessera.runtime.profiler import build_profile_step
    from tessera.weights import unique_state

    step = build_profile_step("smollm2-135m", "decode", batch=2, ctx=SMOLLM2_CTX)
    step.inputs["input_ids"].copy_(torch.tensor([[504], [3458]]))
    step.inputs["positions"].copy_(torch.tensor([5, 17]))
    graph = trace(step)
    weights, _ = unique_state(step.modules)
    state0 = {n: torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(t.dtype)
              for n, t in step.state.items()}
    return step, graph, weights, state0
