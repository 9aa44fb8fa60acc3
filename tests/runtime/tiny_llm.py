"""The tiny llm's step graphs and random weights, for worker tests."""

from __future__ import annotations

import torch


def tiny_llm_graphs(shapes: dict) -> tuple[dict, dict]:
    """The tiny llm's step graphs traced on `meta` at ``shapes`` (phase -> StepShape; ``decode@2`` names a decode
    step) and random weights for them on the host (seeded, scaled by 0.2)."""
    from tessera.capture.build import instantiate
    from tessera.capture.models import resolve_model
    from tessera.capture.phases import build_model, step_for
    from tessera.capture.tiny import tiny_config
    from tessera.capture.trace import trace
    from tessera.graph.codec import dtype_from_name

    meta, values = instantiate(lambda: build_model("llm", tiny_config("llm")), "meta")
    spec = resolve_model("smollm2-135m")
    graphs = {p: trace(step_for(spec, meta, values, p.split("@")[0], s, device="meta")) for p, s in shapes.items()}
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for g in graphs.values():
        for n in g.weight_names():
            b = g.buffers[n]
            weights.setdefault(n, (torch.randn(b.shape, generator=gen) * 0.2).to(dtype_from_name(b.dtype)))
    return graphs, weights
