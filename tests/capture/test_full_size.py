"""Full-size `meta` traces of the catalog's language models at real configs (speed: benchmarks/bench_trace.py).

qwen2.5-vl-7b and sd3.5-medium at full size are covered in tests/capture/test_vlm.py and tests/capture/test_diffusion.py.
"""

from __future__ import annotations

import pytest

from tessera.capture.models import load_config, resolve_model
from tessera.capture.phases import build_modules, resolve_shape, step_for
from tessera.capture.trace import trace

MODELS = ["llama-3.1-8b", "gpt-oss-20b", "mamba-codestral-7b", "qwen3-235b-a22b", "smollm2-135m"]
SHAPES = {"decode": dict(batch=64, ctx=2048), "prefill": dict(batch=1, seq=2048)}


@pytest.fixture(scope="module", params=MODELS)
def built(request):
    spec = resolve_model(request.param)
    config = load_config(spec)
    modules, values = build_modules(spec, "meta", config=config)
    return spec, config, modules, values


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_full_size_trace(built, phase):
    spec, config, modules, values = built
    shape = resolve_shape(spec, config, phase, **SHAPES[phase])
    graph = trace(step_for(spec, modules, values, phase, shape, device="meta"))
    layers = config.num_hidden_layers
    assert {k.layer for k in graph.kernels if k.layer is not None} == set(range(layers))
    # every weight of the model is a buffer of the step, each storage once (tied weights aliased)
    weight_bytes = sum(b.nbytes for b in graph.buffers.values() if b.kind == "weight")
    if spec.name == "gpt-oss-20b":  # experts in MXFP4 (4.25 bits per weight), the rest bf16: ~13.8 GB deployed
        assert 13.70e9 < weight_bytes < 13.85e9
    else:
        assert weight_bytes == spec.params * 2
    state = [b for b in graph.buffers.values() if b.kind == "state"]
    assert len(state) == 2 * layers
    if spec.family in ("llm", "moe"):
        attention = [k for k in graph.kernels if k.op_class == "attention"]
        assert len(attention) == layers
        cache = graph.buffers["cache.layer0.k"]
        assert cache.shape[0] == shape.batch and cache.shape[2] == 2048
    if spec.family == "moe":
        assert sum(k.op_class == "grouped_gemm" for k in graph.kernels) == 2 * layers
    logits = graph.outputs["logits"]
    assert logits[3][:2] == [shape.batch, 1]
