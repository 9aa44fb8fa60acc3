"""Kernel-backed custom ops in the KernelGraph: accesses from the PTX of their Triton kernels."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tessera.capture.build import instantiate
from tessera.capture.models import resolve_model
from tessera.capture.opaque import SchemaMismatchWarning, register_triton_op
from tessera.capture.phases import StepShape, build_model, step_for
from tessera.capture.step import Step
from tessera.capture.tiny import tiny_config
from tessera.capture.trace import trace
from tessera.program.program import single_device_program
from tessera.runtime.executor import Executor
from tessera.triton_kernels import launch, use_triton_rms_norm
from tessera.weights import unique_state

SHAPE = StepShape(batch=2, seq=5, ctx=16)
NORMS = ("input_layernorm", "post_attention_layernorm", "model.norm")


def _llama(triton_norm: bool):
    spec = resolve_model("smollm2-135m")
    config = tiny_config("llm", dtype="float32")
    # The Triton norm replaces Hugging Face's RMSNorm modules, which the eager graph calls (the production
    # graph runs its own fused norms).
    model, values = instantiate(lambda: build_model("llm", config, torch.float32, graph="eager"), "cpu", seed=3)
    if triton_norm:
        assert use_triton_rms_norm(model) == 2 * config.num_hidden_layers + 1
    step = step_for(spec, model, values, "prefill", SHAPE, device="cpu")
    step.inputs["input_ids"].copy_(torch.randint(0, config.vocab_size, step.inputs["input_ids"].shape,
                                                 generator=torch.Generator().manual_seed(0)))
    return model, step


def _unit(scope: str) -> str | None:
    return scope if scope.endswith(NORMS) else None


def _collapsed_edges(graph) -> set[tuple[str, str, str]]:
    """Edges with every kernel of an RMSNorm module collapsed into one node named by its scope."""
    node = {k.index: _unit(k.scope) or k.id for k in graph.kernels}
    return {(node[e.src], node[e.dst], e.kind) for e in graph.edges if node[e.src] != node[e.dst]}


def test_triton_rms_norm_unit_has_the_edges_of_the_eager_op_and_the_same_output():
    eager_model, eager_step = _llama(triton_norm=False)
    triton_model, triton_step = _llama(triton_norm=True)
    eager_graph, triton_graph = trace(eager_step), trace(triton_step)
    norm_kernels = [k for k in triton_graph.kernels if k.op == "tessera.triton_rms_norm.default"]
    assert len(norm_kernels) == 5 and not triton_graph.meta.get("warnings")
    assert _collapsed_edges(triton_graph) == _collapsed_edges(eager_graph)
    expected = eager_step.fn(eager_step.inputs, {k: v.clone() for k, v in eager_step.state.items()}, {})
    got = triton_step.fn(triton_step.inputs, {k: v.clone() for k, v in triton_step.state.items()}, {})
    torch.testing.assert_close(got["logits"], expected["logits"], rtol=1e-5, atol=1e-5)


def test_meta_graph_with_triton_op_replays_like_eager():
    model, cpu_step = _llama(triton_norm=True)
    spec = resolve_model("smollm2-135m")
    meta, values = instantiate(lambda: build_model("llm", model.config, torch.float32, graph="eager"), "meta")
    use_triton_rms_norm(meta)
    graph = trace(step_for(spec, meta, values, "prefill", SHAPE, device="meta"))
    assert [(k.op, k.shapes) for k in graph.kernels] == [(k.op, k.shapes) for k in trace(cpu_step).kernels]
    state = {k: v.clone() for k, v in cpu_step.state.items()}
    eager = cpu_step.fn(cpu_step.inputs, {k: v.clone() for k, v in cpu_step.state.items()}, {})
    weights, _ = unique_state({"": model})
    out = Executor(graph, single_device_program(graph), weights).run(cpu_step.inputs, state)
    assert torch.equal(out["logits"], eager["logits"])


@triton.jit
def liar_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * 2, mask=mask)
    tl.store(x_ptr + offs, x * 3, mask=mask)  # writes its input: the schema below does not say so


@torch.library.custom_op("tessera_test::liar_scale", mutates_args=())
def liar_scale(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    launch(liar_kernel, (triton.cdiv(x.numel(), 64),), x, out, x.numel(), BLOCK=64)
    return out


@liar_scale.register_fake
def _(x):
    return torch.empty_like(x)


register_triton_op("tessera_test::liar_scale", liar_kernel,
                   lambda args, kwargs, out: {"x_ptr": args[0], "out_ptr": out, "n": args[0].numel(),
                                              "BLOCK": 64})


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_schema_that_hides_a_write_gets_the_write_edge_and_a_warning(device):
    def fn(inp, _st, _c):
        a = inp["x"] * 1
        b = torch.ops.tessera_test.liar_scale(a)
        c = a + 1  # reads what the kernel overwrote
        return {"b": b, "c": c}

    step = Step(model="unit", family="test", phase="unit", modules={}, fn=fn,
                inputs={"x": torch.ones(100, device=device)}, state={})
    with pytest.warns(SchemaMismatchWarning, match=r"tessera_test::liar_scale.*x_ptr.*does not write it.*"
                                                  r"read-write"):
        graph = trace(step)
    mul, liar, add = 0, 1, 2
    edges = {(e.src, e.dst, e.kind) for e in graph.edges}
    assert (liar, add, "RAW") in edges
    assert (mul, liar, "WAW") in edges
    writes = {a.buffer for a in graph.accesses if a.kernel == liar and a.mode == "write"}
    assert graph.kernels[mul].outputs[0][0] in writes
    assert any("liar_scale" in w for w in graph.meta["warnings"])
