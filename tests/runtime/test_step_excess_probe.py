"""The in-step excess probe: what it measures over, its cache, and bad requests refused by name."""

from __future__ import annotations

import hashlib
import json

import pytest

from tessera.cost.host_overhead import HostOverhead
from tessera.runtime.step_excess_probe import (
    StepExcessProbeError,
    measure_step_excess,
    step_excess_key,
    with_step_excess,
)


def test_the_step_is_run_and_its_light_kernels_compared_with_their_profile():
    figures = measure_step_excess("smollm2-135m", 1, batch=1, ctx=32, slots=1, passes=3)
    assert 100 < figures.kernels < 304  # the kernels that read no weight matrix, of 304
    assert figures.step_s > 0 and figures.profiled_s > 0
    assert abs(figures.excess_s) < figures.step_s / figures.kernels * 10


def test_a_cached_figure_for_this_key_is_used_less_the_dispatch(tmp_path):
    overhead = HostOverhead(dispatch_s=3e-5, weight_bandwidth=1e9)
    key = step_excess_key("smollm2-135m", 1, 4, 128, 8)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    (tmp_path / f"step-excess-1t-{digest}.json").write_text(json.dumps(
        {"key": key, "busy": False, "figures": {"excess_s": 5e-5, "kernels": 183, "step_s": 0.06,
                                                 "profiled_s": 0.03}}))
    lines: list[str] = []
    charged = with_step_excess(overhead, "smollm2-135m", log=lines.append, cache_dir=tmp_path)
    assert charged.in_step_s == pytest.approx(2e-5) and not lines  # read, not measured
    assert (charged.dispatch_s, charged.weight_bandwidth) == (3e-5, 1e9)
    below = HostOverhead(dispatch_s=1e-4, weight_bandwidth=1e9)  # a dispatch above the excess: nothing more
    assert with_step_excess(below, "smollm2-135m", log=lines.append, cache_dir=tmp_path).in_step_s == 0.0


@pytest.mark.parametrize("kwargs,match", [
    ({"threads": 0}, "threads must be a whole number >= 1"),
    ({"passes": 2}, "passes must be a whole number >= 3"),
    ({"batch": 0}, "batch must be a whole number >= 1"),
    ({"batch": 9, "slots": 8}, "batch 9 exceeds the cache's 8 slots"),
])
def test_bad_probe_requests_are_refused(kwargs, match):
    with pytest.raises(StepExcessProbeError, match=match):
        measure_step_excess("smollm2-135m", **kwargs)
