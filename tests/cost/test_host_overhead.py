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


@pytest.mark.parametrize("field,value,match", [
    ("dispatch_s", -1e-6, "dispatch_s must be a finite number of seconds >= 0"),
    ("engine_step_s", float("nan"), "engine_step_s must be a finite number"),
    ("weight_bandwidth", 0.0, "weight_bandwidth must be a finite bytes/s > 0"),
    ("threads", True, "threads must be a whole number >= 1"),
    ("shape_bandwidth", ((576, 576, 0.0),), r"shape_bandwidth rows must be \(out, in, bytes/s > 0\)"),
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
    with pytest.raises(HostOverheadError, match="not a version-2 tessera-host-overhead file"):
        HostOverhead.from_dict({"kind": "other"}, "x.json")
