"""A kernel's measured excess inside a real step (`HostOverhead.in_step_s`): charged exactly to every kernel on this
host that reads no weight matrix (the weights' read models the others), kept by the overhead's other derivations, and refused when it is no time."""

from __future__ import annotations

import math

import pytest

from tessera.capture.api import trace_model
from tessera.cost.features import cost_class
from tessera.cost.host_overhead import HostOverhead, HostOverheadError
from tessera.cost.model import CostModel
from tessera.cost.profile import KernelTiming, Profile, kernel_signature
from tessera.hardware.catalog import HOST_ID
from tessera.hardware.devices import resolve_device

IN_STEP = 2.0**-16


def _profile(graph, overhead: HostOverhead) -> Profile:
    kernels = [KernelTiming(k.index, k.id, kernel_signature(k), k.op, k.op_class, 5e-5, 5e-5, 1)
               for k in graph.kernels]
    return Profile(HOST_ID, "test cpu", 1, graph.model, graph.phase, graph.hash, {}, 0, 1, "now", kernels,
                   overhead=overhead)


def test_every_kernel_reading_no_weight_matrix_is_charged_the_in_step_excess_once():
    graph = trace_model("smollm2-135m", "decode", batch=1, ctx=128)
    cpu = resolve_device("cpu:1")
    base = HostOverhead(dispatch_s=2.0**-15, weight_bandwidth=2.0**33)
    plain = CostModel(cpu, profile=_profile(graph, base)).kernel_costs(graph)
    charged = CostModel(cpu, profile=_profile(graph, base.with_in_step(IN_STEP, "test"))).kernel_costs(graph)
    matrices = {k.index for k in graph.kernels if cost_class(k) in ("gemm", "gemv")}  # GEMMs of weight matrices
    assert len(matrices) == 4 * 30 + 1  # each layer's four, and the LM head
    assert [c.time_s for c in charged] == [p.time_s + (0.0 if k.index in matrices else IN_STEP)
                                           for p, k in zip(plain, graph.kernels, strict=True)]


def test_the_derived_figures_keep_each_other():
    o = HostOverhead(0.25, 4.0).with_in_step(0.125, "probe").with_engine_step(0.5, "warm-up")
    assert (o.in_step_s, o.engine_step_s, o.dispatch_s) == (0.125, 0.5, 0.25)
    assert o.kernel_s(1.0, 2.0) == 1.375
    assert o.with_in_step(0.0, "none").engine_step_s == 0.5
    assert "+ 125000.0 in a real step" in o.describe()


@pytest.mark.parametrize("value", [-1e-6, math.inf, math.nan])
def test_an_in_step_excess_that_is_no_time_is_refused(value):
    with pytest.raises(HostOverheadError, match="in_step_s must be a finite number of seconds >= 0"):
        HostOverhead(0.0, 1.0, in_step_s=value)
