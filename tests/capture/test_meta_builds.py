"""Tracing reuses a model built on meta for the next shape, and the graph is the one a fresh build traces."""

from __future__ import annotations

import pytest

from tessera.capture import phases
from tessera.capture.api import trace_model

SEQUENCES = {  # one model's phases at shapes in a row, as a planning run traces them
    "smollm2-135m": [("decode", dict(batch=8, ctx=128)), ("prefill", dict(batch=1, seq=100)),
                     ("decode", dict(batch=64, ctx=512))],
    "mamba-codestral-7b": [("prefill", dict(batch=1, seq=300)), ("decode", dict(batch=8, ctx=300)),
                           ("prefill", dict(batch=1, seq=70))],
    "qwen2.5-vl-7b": [("encode", dict(batch=1)), ("prefill", dict(batch=1, seq=400)), ("encode", dict(batch=2))],
}


@pytest.mark.parametrize("model", sorted(SEQUENCES))
def test_a_reused_meta_build_traces_what_a_fresh_one_traces(model):
    phases._meta_builds.clear()
    reused = [trace_model(model, phase, **kw).hash for phase, kw in SEQUENCES[model]]
    assert len(phases._meta_builds) == 1
    fresh = []
    for phase, kw in SEQUENCES[model]:
        phases._meta_builds.clear()
        fresh.append(trace_model(model, phase, **kw).hash)
    assert reused == fresh
