"""Tiny random models of the LLM, MoE and SSM families: meta == CPU kernel sequences, replay == eager."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from tessera.capture.build import instantiate
from tessera.capture.models import resolve_model
from tessera.capture.phases import StepShape, build_model, step_for
from tessera.capture.shapes import PHASES
from tessera.capture.tiny import tiny_config
from tessera.capture.trace import trace
from tessera.program.program import single_device_program
from tessera.runtime.executor import Executor
from tessera.weights import save_weights, unique_state

SHAPE = StepShape(batch=2, seq=6, ctx=16)
FAMILY_MODEL = {"llm": "smollm2-135m", "moe": "gpt-oss-20b", "ssm": "mamba-codestral-7b"}


def _steps(family: str, phase: str, **overrides):
    spec = resolve_model(FAMILY_MODEL[family])
    config = tiny_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    cpu, cpu_values = instantiate(lambda: build_model(family, config), "cpu", seed=0)
    meta, meta_values = instantiate(lambda: build_model(family, config), "meta")
    meta_step = step_for(spec, meta, meta_values, phase, SHAPE, device="meta")
    cpu_step = step_for(spec, cpu, cpu_values, phase, SHAPE, device="cpu")
    g = torch.Generator().manual_seed(7)
    vocab = config.vocab_size
    cpu_step.inputs["input_ids"].copy_(torch.randint(0, vocab, cpu_step.inputs["input_ids"].shape, generator=g))
    if phase == "decode":
        cpu_step.inputs["positions"].copy_(torch.tensor([3, 11]))
        cpu_step.inputs["slots"].copy_(torch.tensor([1, 0]))
        for t in cpu_step.state.values():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return cpu, meta_step, cpu_step


def _sequence(graph):
    return [(k.op, k.shapes, k.dtypes) for k in graph.kernels]


@pytest.mark.parametrize("family,phase", [(f, p) for f in FAMILY_MODEL for p in PHASES[f]])
def test_meta_and_cpu_traces_match_and_replay_equals_eager(family, phase):
    cpu, meta_step, cpu_step = _steps(family, phase)
    state0 = {k: v.clone() for k, v in cpu_step.state.items()}
    meta_graph = trace(meta_step)
    cpu_graph = trace(cpu_step)
    assert _sequence(meta_graph) == _sequence(cpu_graph)
    assert [e.__dict__ for e in meta_graph.edges] == [e.__dict__ for e in cpu_graph.edges]

    eager_state = {k: v.clone() for k, v in state0.items()}
    eager = cpu_step.fn(cpu_step.inputs, eager_state, {})
    weights, _ = unique_state({"": cpu})
    replay_state = {k: v.clone() for k, v in state0.items()}
    out = Executor(meta_graph, single_device_program(meta_graph), weights).run(cpu_step.inputs, replay_state)
    assert torch.equal(out["logits"], eager["logits"])
    for name in eager_state:
        assert torch.equal(replay_state[name], eager_state[name]), name
    assert any(not torch.equal(eager_state[n], state0[n]) for n in eager_state), "the step must write its state"


def test_attention_is_one_kernel_per_layer():
    _, meta_step, _ = _steps("llm", "decode")
    g = trace(meta_step)
    attn = [k for k in g.kernels if k.op_class == "attention"]
    assert [k.layer for k in attn] == [0, 1]
    assert not any(k.op.startswith(("aten.bmm", "aten._softmax", "aten._safe_softmax")) for k in g.kernels)
    assert all(k.scope.endswith("self_attn") for k in attn)


def test_graph_names_are_stable():
    _, meta_step, _ = _steps("llm", "decode", tie_word_embeddings=True)
    g = trace(meta_step)
    kinds = {b.name: b.kind for b in g.buffers.values()}
    assert kinds["model.embed_tokens.weight"] == "weight"
    assert "lm_head.weight" in g.buffers["model.embed_tokens.weight"].aliases  # tied
    assert kinds["cache.layer0.k"] == kinds["cache.layer1.v"] == "state"
    assert kinds["model.rotary_emb.inv_freq"] == "constant"
    assert g.buffers["model.rotary_emb.inv_freq"].values
    assert {kinds[n] for n in ("input_ids", "positions", "slots")} == {"input"}
    ids = [k.id for k in g.kernels]
    assert len(set(ids)) == len(ids)
    assert "model.layers.1.mlp.down_proj:aten.mm.default#0" in ids
    assert trace(meta_step).hash == g.hash


def test_replay_of_a_saved_graph_in_a_fresh_process(tmp_path):
    cpu, meta_step, cpu_step = _steps("moe", "decode")
    graph_file, weights_file = tmp_path / "graph.json", tmp_path / "weights.safetensors"
    trace(meta_step).save(graph_file)
    save_weights({"": cpu}, weights_file)
    torch.save({"inputs": cpu_step.inputs, "state": cpu_step.state}, tmp_path / "io.pt")
    expected_state = {k: v.clone() for k, v in cpu_step.state.items()}
    expected = cpu_step.fn(cpu_step.inputs, expected_state, {})["logits"]
    script = textwrap.dedent(f"""
        import torch
        from tessera.graph.ir import KernelGraph
        from tessera.program.program import single_device_program
        from tessera.runtime.executor import Executor
        from tessera.weights import load_weights
        g = KernelGraph.load({str(graph_file)!r})
        prog = single_device_program(g)
        io = torch.load({str(tmp_path / 'io.pt')!r})
        out = Executor(g, prog, load_weights({str(weights_file)!r}, prog.weights)).run(io["inputs"], io["state"])
        torch.save({{"logits": out["logits"], "state": io["state"]}}, {str(tmp_path / 'out.pt')!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    got = torch.load(tmp_path / "out.pt")
    assert torch.equal(got["logits"], expected)
    assert all(torch.equal(got["state"][k], expected_state[k]) for k in expected_state)


def test_a_replay_keeps_no_argument_tensors_after_each_kernel():
    """Activations go back to the allocator when the program frees them: no kernel's argument list still
    holds a tensor once the kernel has run (it used to, until the next step refilled it)."""
    import weakref

    cpu, meta_step, cpu_step = _steps("llm", "decode")
    graph = trace(meta_step)
    weights, _ = unique_state({"": cpu})
    ex = Executor(graph, single_device_program(graph), weights)
    activations: list[weakref.ref] = []
    run_kernel = ex.run_kernel

    def watched(index: int) -> None:
        run_kernel(index)
        call = ex._calls[index]
        assert all(container[key] is None for container, key, _ in call.holes)
        slot = call.out
        if slot is not None and graph.buffers[slot.buffer].kind == "activation" and ex._views.get(slot.buffer):
            activations.append(weakref.ref(next(iter(ex._views[slot.buffer].values()))[1]))

    ex.run_kernel = watched
    ex.run(cpu_step.inputs, {k: v.clone() for k, v in cpu_step.state.items()})
    # the production decode of the tiny llama has 18 single-output activations (the eager graph had more)
    assert len(activations) > 15 and all(r() is None for r in activations)  # every one freed and gone
