"""Host overhead of Tessera's engine on this CPU: the figures, their cache, and the cost model charging them per
kernel exactly as `HostOverhead.kernel_s` says."""

from __future__ import annotations

import json
import math

import pytest

from tessera.capture.api import trace_model
from tessera.cost.features import FeatureExtractor
from tessera.cost.host_overhead import HostOverhead, HostOverheadError, read_cached, write_cached
from tessera.cost.model import CostModel
from tessera.cost.profile import KernelTiming, Profile, kernel_signature
from tessera.hardware.catalog import HOST_ID
from tessera.hardware.devices import resolve_device


def _profile(graph, seconds: float, overhead: HostOverhead | None) -> Profile:
    """Every kernel of ``graph`` measured at ``seconds`` on this host's CPU."""
    kernels = [KernelTiming(k.index, k.id, kernel_signature(k), k.op, k.op_class, seconds, seconds, 1)
               for k in graph.kernels]
    return Profile(HOST_ID, "test cpu", 1, graph.model, graph.phase, graph.hash, {}, 0, 1, "now", kernels,
                   overhead=overhead)


@pytest.fixture(scope="module")
def decode_graph():
    return trace_model("smollm2-135m", "decode", batch=1, ctx=128)


def test_kernel_charge_is_the_profiled_time_or_the_weight_read_plus_dispatch():
    o = HostOverhead(dispatch_s=0.25, weight_bandwidth=4.0)
    assert o.kernel_s(1.0, 2.0) == 1.25  # profiled 1 s beats 2 bytes at 4 B/s
    assert o.kernel_s(0.25, 8.0) == 2.25  # 8 bytes at 4 B/s: 2 s
    assert o.with_engine_step(0.5, "test").engine_step_s == 0.5


def test_the_cost_model_charges_each_measured_kernel_exactly(decode_graph):
    cpu = resolve_device("cpu:1")
    bandwidth = 2.0**33  # bytes/s: the LM head's 57 MB read takes longer than the 50 us profiled, a norm does not
    o = HostOverhead(dispatch_s=2.0**-15, weight_bandwidth=bandwidth)
    plain = CostModel(cpu, profile=_profile(decode_graph, 5e-5, None)).kernel_costs(decode_graph)
    charged = CostModel(cpu, profile=_profile(decode_graph, 5e-5, o)).kernel_costs(decode_graph)
    features = FeatureExtractor(decode_graph).all()
    assert [c.time_s for c in charged] == [max(p.time_s, f.weight_bytes / bandwidth) + 2.0**-15
                                           for p, f in zip(plain, features, strict=True)]
    assert all(p.time_s == 5e-5 for p in plain)
    assert sum(c.time_s > 5e-5 + 2.0**-15 for c in charged) >= 1  # some weights are read slower than profiled


def test_a_gemm_reads_each_weight_at_its_shapes_measured_rate(decode_graph):
    cpu = resolve_device("cpu:1")
    shapes = {tuple(decode_graph.buffers[a.buffer].shape) for k in decode_graph.kernels
              for a in decode_graph.accesses_of(k.index) if decode_graph.buffers[a.buffer].kind == "weight"}
    rates = tuple((s[0], s[1], 2.0**30 * (1 + n)) for n, s in enumerate(sorted(x for x in shapes if len(x) == 2)))
    o = HostOverhead(dispatch_s=0.0, weight_bandwidth=1.0, shape_bandwidth=rates)  # 1 B/s: used where no shape rate
    charged = CostModel(cpu, profile=_profile(decode_graph, 1e-9, o)).kernel_costs(decode_graph)
    rate = {(a, b): bw for a, b, bw in rates}
    features = FeatureExtractor(decode_graph).all()
    checked = 0
    for k, c, f in zip(decode_graph.kernels, charged, features, strict=True):
        reads = [(tuple(decode_graph.buffers[a.buffer].shape), a.sizes, a.itemsize)
                 for a in decode_graph.accesses_of(k.index) if decode_graph.buffers[a.buffer].kind == "weight"]
        if f.cost_class in ("gemm", "gemv") and reads:
            expected = sum(math.prod(sz) * item / rate[shape] for shape, sz, item in reads)
            assert c.time_s == max(1e-9, expected)
            checked += 1
        else:
            assert c.time_s == max(1e-9, f.weight_bytes / 1.0)
    assert checked == 121  # 30 layers x (QKV, O, gate-up, down) and the LM head


def test_a_cold_weights_excess_is_interpolated_in_rows_and_clamped_beyond():
    o = HostOverhead(0.0, 1.0, cold_excess=((8, 4, 1, 2.0), (8, 4, 16, 5.0), (8, 4, 64, 3.0)))
    assert [o.cold_s((8, 4), r) for r in (1, 16, 64)] == [2.0, 5.0, 3.0]  # measured rows: as measured
    assert o.cold_s((8, 4), 6) == 3.0 and o.cold_s((8, 4), 40) == 4.0  # linear between them
    assert o.cold_s((8, 4), 500) == 3.0  # beyond: the nearest measured
    assert o.cold_s((4, 8), 16) is None  # a shape not measured


def test_a_gemm_with_measured_cold_weights_is_charged_warm_plus_their_excess():
    cold = ((8, 4, 1, 2.0), (8, 4, 16, 4.0), (2, 4, 1, 1.0))
    o = HostOverhead(dispatch_s=0.25, weight_bandwidth=4.0, cold_excess=cold, in_step_s=0.5)
    merged = [((8, 4), 64.0), ((2, 4), 16.0), ((8,), 16.0)]  # two matrices (a merged GEMM) and a bias
    assert o.kernel_s(1.0, 96.0, merged, rows=16) == 1.0 + 4.0 + 1.0 + 0.25  # no in-step excess: the reads model it
    # a matrix without a measured excess, or no rows: the profiled time or the weights' read, as before
    assert o.kernel_s(1.0, 96.0, [((8, 4), 64.0), ((3, 4), 24.0)], rows=16) == 96.0 / 4.0 + 0.25
    assert o.kernel_s(1.0, 96.0, merged) == 96.0 / 4.0 + 0.25
    assert o.kernel_s(1.0, 16.0, [((8,), 16.0)]) == 4.0 + 0.25 + 0.5  # no weight matrix: the in-step excess


def test_the_cost_model_charges_each_gemm_its_cold_excess_at_its_rows():
    cpu = resolve_device("cpu:1")
    graph = trace_model("smollm2-135m", "prefill", batch=1, seq=32, ctx=128)
    features = FeatureExtractor(graph).all()
    shapes = sorted({tuple(graph.buffers[a.buffer].shape) for a in graph.accesses
                     if graph.buffers[a.buffer].kind == "weight" and len(graph.buffers[a.buffer].shape) == 2})
    cold = tuple((o_, i, r, 1e-3 * r) for o_, i in shapes for r in (1, 64))  # 1 ms a row, exact to interpolate
    o = HostOverhead(dispatch_s=0.0, weight_bandwidth=1.0, cold_excess=cold)
    charged = CostModel(cpu, profile=_profile(graph, 1e-6, o)).kernel_costs(graph)
    rows = []
    for k, c, f in zip(graph.kernels, charged, features, strict=True):
        matrices = [a for a in graph.accesses_of(k.index) if graph.buffers[a.buffer].kind == "weight"
                    and len(graph.buffers[a.buffer].shape) == 2]
        if f.cost_class in ("gemm", "gemv") and matrices:
            rows.append(f.gemm[0] * f.gemm[1])
            assert c.time_s == pytest.approx(1e-6 + len(matrices) * rows[-1] * 1e-3, rel=1e-12)
    # 30 layers x (QKV, O, gate-up, down) over the prompt's 32 tokens, and the LM head over its last token
    assert sorted(rows) == [1] + [32] * 120


@pytest.mark.parametrize("field,value,match", [
    ("dispatch_s", -1e-6, "dispatch_s must be a finite number of seconds >= 0"),
    ("engine_step_s", float("nan"), "engine_step_s must be a finite number"),
    ("weight_bandwidth", 0.0, "weight_bandwidth must be a finite bytes/s > 0"),
    ("threads", True, "threads must be a whole number >= 1"),
    ("shape_bandwidth", ((576, 576, 0.0),), r"shape_bandwidth rows must be \(out, in, bytes/s > 0\)"),
    ("cold_excess", ((576, 576, 0, 1e-5),), r"cold_excess rows must be \(out, in, rows >= 1, seconds >= 0\)"),
    ("cold_excess", ((576, 576, 1, -1e-5),), r"cold_excess rows must be"),
])
def test_bad_figures_are_refused_by_name(field, value, match):
    figures = {"dispatch_s": 1e-5, "weight_bandwidth": 1e9, "engine_step_s": 0.0, "threads": 1} | {field: value}
    with pytest.raises(HostOverheadError, match=match):
        HostOverhead(**figures)


def test_the_profile_file_never_holds_the_overhead(decode_graph, tmp_path):
    prof = _profile(decode_graph, 1e-5, HostOverhead(1e-5, 1e9))
    assert "overhead" not in prof.to_dict()
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").overhead is None


def test_cached_figures_are_used_only_for_their_key(tmp_path):
    path = tmp_path / "overhead.json"
    figures = HostOverhead(3e-5, 6e9, 0.0, 1, "test")
    write_cached(path, {"code": "a"}, figures)
    assert read_cached(path, {"code": "a"}) == figures
    assert read_cached(path, {"code": "b"}) is None  # other code (a faster executor): measured again
    assert read_cached(path, {"code": "a"}, quiet=True) == figures  # measured quiet: kept on a quiet host
    write_cached(path, {"code": "a"}, figures, busy=True)
    assert read_cached(path, {"code": "a"}) == figures  # measured busy: used while the host is busy,
    assert read_cached(path, {"code": "a"}, quiet=True) is None  # measured again once it is quiet
    data = json.loads(path.read_text())
    data["dispatch_s"] = -1.0
    path.write_text(json.dumps(data))
    assert read_cached(path, {"code": "a"}) is None  # damaged: measured again
    path.write_text("{not json")
    assert read_cached(path, {"code": "a"}) is None
    with pytest.raises(HostOverheadError, match="not a version-3 tessera-host-overhead file"):
        HostOverhead.from_dict({"kind": "other"}, "x.json")
