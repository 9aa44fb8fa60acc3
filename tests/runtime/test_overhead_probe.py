"""The host overhead probes: what they measure over, and bad requests refused by name."""

from __future__ import annotations

import math

import pytest

from tessera.capture.api import trace_model
from tessera.cost.host_overhead import HostOverhead
from tessera.runtime.overhead_probe import (
    OverheadProbeError,
    gemm_weight_shapes,
    measure_cold_excess,
    measure_dispatch,
    measure_weight_bandwidth,
    overhead_key,
)


def test_the_weight_shapes_are_the_gemms_weights_counted_per_step():
    graph = trace_model("smollm2-135m", "decode", batch=1, ctx=128)
    shapes = gemm_weight_shapes([graph], limit=20)
    layers = 30
    assert shapes[(576, 1536)] == layers  # down projections
    assert shapes[(1536, 576)] == 2 * layers  # gate and up (one merged GEMM over both weights)
    assert shapes[(49152, 576)] == 1  # the LM head (tied to the embedding, which is no GEMM)
    assert len(gemm_weight_shapes([graph], limit=2)) == 2


def test_dispatch_is_measured_over_a_real_step_of_kernels():
    seconds, kernels = measure_dispatch(threads=1, passes=5)
    assert kernels > 20 and math.isfinite(seconds) and seconds >= 0.0


def test_the_key_names_the_timed_code_and_the_threads():
    one, two = overhead_key(1), overhead_key(2)
    assert one["code"] == two["code"] and len(one["code"]) == 16
    assert one["threads"] == 1 and two["threads"] == 2


@pytest.mark.parametrize("call,match", [
    (lambda: measure_dispatch(threads=0), "threads must be a whole number >= 1"),
    (lambda: measure_dispatch(threads=1, passes=2), "passes must be a whole number >= 3"),
    (lambda: measure_weight_bandwidth(1, {(0, 8): 1}), r"weight shapes must be \(out, in\) pairs"),
    (lambda: measure_weight_bandwidth(1, {(8, 8): 0}), "with counts >= 1"),
    (lambda: measure_cold_excess(1, {(8, 8): 1}, rows=(0,)), "row counts must be whole numbers >= 1"),
    (lambda: measure_cold_excess(1, {(8, 8): 1}, rows=()), "row counts must be whole numbers >= 1"),
    (lambda: measure_cold_excess(1, {(8, 8): 1}, passes=0), "passes must be a whole number >= 1"),
])
def test_bad_probe_requests_are_refused(call, match):
    with pytest.raises(OverheadProbeError, match=match):
        call()


def test_the_cold_excess_is_measured_per_shape_and_rows():
    shapes = {(2048, 1024): 1, (1024, 2048): 1}  # 4 MiB each: 48 distinct weights beyond the last-level cache
    rows = measure_cold_excess(1, shapes, rows=(1, 4), passes=1)
    assert [(o, i, r) for o, i, r, _ in rows] == [(2048, 1024, 1), (2048, 1024, 4), (1024, 2048, 1), (1024, 2048, 4)]
    assert all(s >= 0.0 for *_, s in rows)
    assert HostOverhead(1e-6, 1e9, cold_excess=rows).cold_s((2048, 1024), 2) is not None  # the figures it carries
