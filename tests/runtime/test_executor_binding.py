"""The executor binds each kernel's weight and constant views once and refills only the activation, input and
state arguments per call; its results stay those of the first run, bit for bit."""

from __future__ import annotations

import torch

from tessera.program.program import single_device_program
from tessera.runtime.executor import Executor


def test_weight_views_are_bound_once_and_activation_arguments_are_dropped_after_each_call(smollm2_step):
    step, graph, weights, state0 = smollm2_step
    ex = Executor(graph, single_device_program(graph), weights)
    runs, bound = [], []
    for _ in range(2):
        state = {n: t.clone() for n, t in state0.items()}
        runs.append({n: t.clone() for n, t in ex.run(step.inputs, state).items()})
        bound.append({i: [id(a) for a in _flat(call.args)] for i, call in ex._calls.items()})
    assert runs[0].keys() == runs[1].keys() and all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert bound[0] == bound[1]  # the same weight view objects in the second run, the rest None
    static = {n for n, b in graph.buffers.items() if b.kind in ("weight", "constant")}
    weight_args = 0
    for call in ex._calls.values():
        assert all(slot.buffer not in static for _, _, slot in call.holes)
        assert all(container[key] is None for container, key, _ in call.holes)  # freed with the program
        for a in _flat(call.args):
            if isinstance(a, torch.Tensor):
                weight_args += 1
                assert any(a.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
                           for w in weights.values()) or a.numel() <= 64  # a weight's memory, or a small constant
    assert weight_args >= len(graph.kernels) // 2


def _flat(values):
    for v in values:
        if isinstance(v, list):
            yield from _flat(v)
        else:
            yield v
