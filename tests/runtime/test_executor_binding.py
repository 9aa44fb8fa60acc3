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


def test_cpu_gemms_of_weights_run_on_packed_weights_with_the_same_bits(smollm2_step):
    from tessera.kernels.prepacked import PackedWeights, packable

    step, graph, weights, state0 = smollm2_step
    if not packable(torch.bfloat16, torch.device("cpu")):
        return  # nothing is packed on this CPU: the executor runs the traced GEMMs
    gemms = {}
    for k in graph.kernels:
        names = [a["$t"][0] for a in _flat(k.args) if isinstance(a, dict) and "$t" in a]
        if k.op == "aten.mm.default" and graph.buffers[names[1]].kind == "weight":
            gemms[k.index] = (names[1],)
        elif k.op == "tessera.merged_linear.default":
            gemms[k.index] = tuple(names[1:])
    assert len(gemms) == 4 * 30 + 1  # smollm2-135m: each of its 30 layers' QKV, O, gate/up and down; the LM head
    packed = PackedWeights()
    outs = {}
    for prepack in (False, True):
        ex = Executor(graph, single_device_program(graph), weights, packed=packed, prepack=prepack)
        state = {n: t.clone() for n, t in state0.items()}
        outs[prepack] = ({n: t.clone() for n, t in ex.run(step.inputs, state).items()}, state)
        if prepack:
            packed_ops = {i for i, call in ex._calls.items() if call.func.__module__ == "tessera.kernels.prepacked"}
            assert packed_ops == set(gemms)  # every GEMM of a weight, nothing else
    assert set(packed._packed) == set(gemms.values())  # one packed copy per weight set
    (plain, plain_state), (fast, fast_state) = outs[False], outs[True]
    assert all(torch.equal(plain[k], fast[k]) for k in plain)
    assert all(torch.equal(plain_state[k], fast_state[k]) for k in plain_state)
