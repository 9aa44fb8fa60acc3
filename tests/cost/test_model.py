"""The roofline cost model: physical scaling, floors, dtype options, profiles, calibration data, CLI."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tessera.cli.main import app
from tessera.cost.efficiency import ClassEfficiency, efficiency_for, gpu_factors_provenance, prior_efficiency
from tessera.cost.features import FeatureExtractor, KernelFeatures, cost_class
from tessera.cost.model import CostModel, ProfileDeviceError
from tessera.cost.options import CostOptionError, CostOptions
from tessera.cost.profile import KernelTiming, Profile, kernel_signature
from tessera.cost.roofline import compute_path, kernel_time, split_k, split_k_bytes, wave_utilisation
from tessera.hardware.devices import resolve_device

runner = CliRunner()
EFF = ClassEfficiency(compute=0.7, memory=0.8, floor_cycles=2000)


def gemm(m: int, n: int, k: int, cls: str = "gemm") -> KernelFeatures:
    return KernelFeatures(0, cls, "ffn", 2.0 * m * n * k, weight_bytes=2.0 * n * k, kv_bytes=0.0,
                          other_bytes=2.0 * (m * k + m * n), compute_dtype="bfloat16", gemm=(1, m, n, k))


def elementwise(nbytes: float) -> KernelFeatures:
    return KernelFeatures(0, "elementwise", "other", nbytes / 4, 0.0, 0.0, nbytes, "bfloat16", None)


@pytest.fixture(scope="module")
def decode_graph():
    from tessera.capture.api import trace_model

    return trace_model("smollm2-135m", "decode", batch=4, ctx=256)


def test_compute_bound_gemm_scales_with_tensor_flops():
    a100, h100 = resolve_device("A100"), resolve_device("H100")
    f = gemm(8192, 8192, 8192)
    ta, th = kernel_time(f, a100, EFF), kernel_time(f, h100, EFF)
    assert ta.bound == th.bound == "compute"
    expected = a100.peak_flops("bf16") / h100.peak_flops("bf16") * wave_utilisation(f, a100) / wave_utilisation(f, h100)
    assert th.time_s / ta.time_s == pytest.approx(expected, rel=0.02)


def test_memory_bound_kernels_scale_with_bandwidth():
    h100, h200 = resolve_device("H100"), resolve_device("H200")
    f = elementwise(8e9)  # far beyond any L2
    t1, t2 = kernel_time(f, h100, EFF), kernel_time(f, h200, EFF)
    assert t1.bound == t2.bound == "memory"
    assert t2.time_s / t1.time_s == pytest.approx(h100.memory_bandwidth / h200.memory_bandwidth, rel=0.01)
    gemv = gemm(1, 8192, 8192, "gemv")  # weight streaming
    assert kernel_time(gemv, h100, EFF).bound == "memory"


def test_latency_floor_favours_the_higher_clock():
    a100, l40s = resolve_device("A100"), resolve_device("L40S")
    tiny = elementwise(256)
    ta, tl = kernel_time(tiny, a100, EFF), kernel_time(tiny, l40s, EFF)
    assert ta.bound == tl.bound == "latency"
    assert ta.floor_s == pytest.approx(2000 / a100.boost_clock_hz)
    assert tl.time_s < ta.time_s
    assert tl.time_s / ta.time_s == pytest.approx(a100.boost_clock_hz / l40s.boost_clock_hz, rel=0.05)


def test_eager_launches_pay_the_launch_latency():
    a100 = resolve_device("A100")
    graphs, eager = kernel_time(elementwise(256), a100, EFF), kernel_time(elementwise(256), a100, EFF,
                                                                          CostOptions(cuda_graphs=False))
    assert eager.time_s - graphs.time_s == pytest.approx(a100.launch_latency_s)


def test_wave_quantisation_over_sms():
    a100 = resolve_device("A100")  # 108 SMs, 128x128 tiles
    assert wave_utilisation(gemm(128 * 108, 128, 64), a100) == pytest.approx(1.0)
    assert wave_utilisation(gemm(128 * 109, 128, 64), a100) == pytest.approx(109 / 216)


def test_gemms_under_one_wave_split_k_to_fill_the_sms():
    a100, l40s = resolve_device("A100"), resolve_device("L40S")
    k_proj = gemm(64, 1024, 4096)  # a decode k_proj: 8 output tiles for 108 SMs
    assert split_k(k_proj, a100) == 13 and wave_utilisation(k_proj, a100) == pytest.approx(104 / 108)
    assert split_k_bytes(k_proj, a100) == 2 * 13 * 64 * 1024 * 4  # FP32 partials written and read back
    assert split_k(gemm(64, 1024, 512), a100) == 2  # slices at least 256 deep
    assert split_k(gemm(4096, 4096, 4096), a100) == 1  # a full wave or more: no split
    assert split_k(gemm(64, 1024, 4096, "gemv"), a100) == 1
    # 64 rows stream their weights on both parts: merging q, k and v into one GEMM changes the time by the
    # floors it saves and the smaller GEMMs' extra partial sums (a few per cent, in L2), not the bytes-bound
    # time, so the parts' ratio does not depend on the graph's fusion (unsplit, the A100 k_proj was
    # compute-bound at 7% of its SMs: 4.5x its weight-streaming time)
    for dev in (a100, l40s):
        merged = kernel_time(gemm(64, 6144, 4096), dev, EFF)
        parts = [kernel_time(gemm(64, n, 4096), dev, EFF) for n in (4096, 1024, 1024)]
        assert {merged.bound} | {p.bound for p in parts} == {"memory"}
        assert merged.time_s - merged.floor_s == pytest.approx(sum(p.time_s - p.floor_s for p in parts), rel=0.08)


def test_tensor_paths_only_where_the_part_has_them():
    f = gemm(4096, 4096, 4096)
    fp8 = CostOptions(weights_dtype="fp8")
    assert compute_path(f, resolve_device("H100"), fp8) == "fp8"
    assert compute_path(f, resolve_device("A100"), fp8) == "bf16"  # no FP8 on Ampere: dequantised to BF16
    assert compute_path(f, resolve_device("B200"), CostOptions(weights_dtype="mxfp4")) == "fp4"
    assert compute_path(f, resolve_device("V100"), CostOptions()) == "fp16"  # no BF16 on Volta
    assert compute_path(elementwise(1e6), resolve_device("H100"), fp8) == "fp32"


def test_dtype_options_change_bytes(decode_graph):
    base = FeatureExtractor(decode_graph).all()
    fp8 = FeatureExtractor(decode_graph, CostOptions(weights_dtype="fp8", kv_dtype="fp8")).all()
    mx = FeatureExtractor(decode_graph, CostOptions(weights_dtype="mxfp4")).all()
    gemv = [i for i, f in enumerate(base) if f.cost_class in ("gemm", "gemv") and f.weight_bytes > 0]
    attn = [i for i, f in enumerate(base) if f.cost_class == "attention"]
    assert gemv and attn
    for i in gemv:
        assert fp8[i].weight_bytes == pytest.approx(base[i].weight_bytes / 2)
        assert mx[i].weight_bytes == pytest.approx(base[i].weight_bytes * 4.25 / 16)
        assert fp8[i].other_bytes == base[i].other_bytes
    for i in attn:
        assert base[i].kv_bytes > 0 and fp8[i].kv_bytes == pytest.approx(base[i].kv_bytes / 2)
    assert CostModel(resolve_device("H100"), CostOptions(weights_dtype="fp8")).step_time(decode_graph) < \
        CostModel(resolve_device("H100")).step_time(decode_graph)


def test_kernel_bytes_split_matches_the_trace(decode_graph):
    for k, f in zip(decode_graph.kernels, FeatureExtractor(decode_graph).all(), strict=True):
        assert f.bytes == pytest.approx(k.bytes_read + k.bytes_written, rel=1e-9, abs=1)


def test_cost_classes(decode_graph):
    classes = {cost_class(k) for k in decode_graph.kernels}
    assert {"gemv", "attention", "elementwise", "copy", "reduction", "embedding"} <= classes
    assert "norm" not in classes


def test_bad_options():
    with pytest.raises(CostOptionError, match="mxfp4"):
        CostOptions(weights_dtype="int3")
    with pytest.raises(CostOptionError, match="--kv-dtype"):
        CostOptions(kv_dtype="mxfp4")


def test_measured_entries_win(decode_graph):
    k = decode_graph.kernels[10]
    prof = Profile(device="A100", device_name="test", threads=None, model="m", phase="decode", graph_hash="x",
                   shape={}, warmup=0, repeats=1, created="now",
                   kernels=[KernelTiming(0, k.id, kernel_signature(k), k.op, k.op_class, 1.0, 1.0, 1)])
    costs = CostModel(resolve_device("A100"), profile=prof).kernel_costs(decode_graph)
    same = [c for c, kk in zip(costs, decode_graph.kernels, strict=True) if kernel_signature(kk) == kernel_signature(k)]
    assert same and all(c.time_s == 1.0 and c.bound == "measured" for c in same)
    assert sum(c.bound == "measured" for c in costs) == len(same)
    with pytest.raises(ProfileDeviceError, match="measured on A100"):
        CostModel(resolve_device("L40S"), profile=prof)


def test_shipped_gpu_factors_are_fitted_data_with_provenance():
    l40s = efficiency_for(resolve_device("L40S"))
    assert l40s.fitted and "GPT-oss-20B" in l40s.source
    assert efficiency_for(resolve_device("L4")).source.startswith("inherited from L40S")
    assert efficiency_for(resolve_device("H100")).fitted == ()  # no measurements of Hopper: priors
    prov = gpu_factors_provenance()
    assert prov["held_out_error"]["overall"]["kernels"] > 10
    assert efficiency_for(resolve_device("MI300X")) == prior_efficiency(resolve_device("MI300X"))


def test_gpu_calibration_reproduces_the_shipped_factors():
    from tessera.cost.efficiency import GPU_FACTORS_FILE
    from tessera.cost.gpu_calibration import calibrate_gpus, factors_document, load_pairs, split

    rows, bad = load_pairs()
    assert len(rows) + len(bad) == 92 and bad  # mismatched positions are excluded, not fitted
    fit_rows, held = split(rows)
    assert not set(map(id, fit_rows)) & set(map(id, held)) and len(held) >= len(rows) // 4
    shipped = json.loads(GPU_FACTORS_FILE.read_text())
    refit = json.loads(json.dumps(factors_document(calibrate_gpus())))
    assert refit["devices"] == shipped["devices"]  # the shipped data is what the code fits
    assert refit["provenance"]["held_out_error"] == shipped["provenance"]["held_out_error"]


def test_classify_measured_kernel_names():
    from tessera.cost.gpu_calibration import classify_kernel_name

    assert classify_kernel_name("void marlin_moe_wna16::Marlin<...>") == "grouped_gemm"
    assert classify_kernel_name("ampere_bf16_s16816gemm_bf16_64x64_sliced1x2_ldg8_f2f_stages_64x6_tn") == "gemm"
    assert classify_kernel_name("kernel_unified_attention_2d") == "attention"
    assert classify_kernel_name("triton_red_fused__to_copy_add_addmm_mean_mul_pow_rsqrt_0") == "reduction"
    assert classify_kernel_name("reshape_and_cache_kernel_flash") == "copy"
    assert classify_kernel_name("triton_poi_fused_4") == "elementwise"


def test_estimate_cli_json():
    r = runner.invoke(app, ["estimate", "smollm2-135m", "--device", "a100", "--phase", "decode", "--batch", "4",
                            "--ctx", "256", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["device"] == "A100" and d["predicted"] and d["step_time_s"] > 0
    assert sum(v["share"] for v in d["by_class"].values()) == pytest.approx(1.0)
    assert sum(v["time_s"] for v in d["by_block"].values()) == pytest.approx(d["step_time_s"])
    eager = json.loads(runner.invoke(app, ["estimate", "smollm2-135m", "--device", "a100", "--batch", "4", "--ctx",
                                           "256", "--eager", "--json"]).stdout)
    assert eager["step_time_s"] == pytest.approx(d["step_time_s"] + d["kernels"] * 3e-6, rel=1e-6)


def test_estimate_cli_table_and_errors():
    r = runner.invoke(app, ["estimate", "smollm2-135m", "--device", "L40S", "--batch", "2", "--ctx", "128"])
    assert r.exit_code == 0 and "predicted" in r.stdout and "step_time" in r.stdout
    r = runner.invoke(app, ["estimate", "smollm2-135m", "--device", "A10O"])
    assert r.exit_code == 2 and "A100" in r.stderr and "did you mean" in r.stderr
    r = runner.invoke(app, ["estimate", "smollm2-135m", "--device", "A100", "--weights-dtype", "int3"])
    assert r.exit_code == 2 and "--weights-dtype" in r.stderr
    r = runner.invoke(app, ["estimate", "smollm2-135m", "--device", "A100", "--profile", "/nonexistent.json"])
    assert r.exit_code == 2 and "nonexistent.json" in r.stderr


def test_calibrate_fits_host_factors_that_estimate_uses(tmp_path, monkeypatch):
    from tessera.capture.tiny import tiny_config
    from tessera.cost.efficiency import host_factors_file, load_factors

    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "tiny-llm"
    tiny_config("llm").save_pretrained(model)
    profiles = []
    for phase, shape in (("prefill", ["--seq", "16", "--ctx", "32"]), ("decode", ["--batch", "4", "--ctx", "32"])):
        out = tmp_path / f"{phase}.json"
        r = runner.invoke(app, ["profile", str(model), "--phase", phase, *shape, "--device", "cpu", "--threads", "1",
                                "--warmup", "1", "--repeats", "3", "-o", str(out)])
        assert r.exit_code == 0, r.output
        profiles.append(str(out))
    r = runner.invoke(app, ["calibrate", *profiles])
    assert r.exit_code == 0, r.output
    factors = load_factors(host_factors_file())
    assert {"elementwise", "gemm"} & set(factors.fitted) and "fitted on" in factors.source
    assert all(factors.classes[c].overhead_s > 0 for c in factors.fitted)
    r = runner.invoke(app, ["estimate", str(model), "--device", "cpu", "--phase", "decode", "--batch", "4", "--ctx",
                            "32", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["factors"].startswith("fitted on") and d["step_time_s"] > 0
    r = runner.invoke(app, ["estimate", str(model), "--device", "cpu", "--phase", "decode", "--batch", "4", "--ctx",
                            "32", "--profile", profiles[1], "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["measured_kernels"] == json.loads(r.stdout)["kernels"]


def test_calibrate_refuses_gpu_profiles(tmp_path):
    prof = Profile(device="A100", device_name="x", threads=None, model="smollm2-135m", phase="decode",
                   graph_hash="x", shape={}, warmup=0, repeats=1, created="now", kernels=[])
    prof.save(tmp_path / "gpu.json")
    r = runner.invoke(app, ["calibrate", str(tmp_path / "gpu.json")])
    assert r.exit_code == 2 and "measured on A100" in r.stderr


def test_memory_footprint_follows_the_dtype_options(decode_graph):
    from tessera.cost.model import memory_footprint

    base = memory_footprint(decode_graph)
    small = memory_footprint(decode_graph, CostOptions(weights_dtype="fp8", kv_dtype="fp8"))
    matrices = sum(b.nbytes for b in decode_graph.buffers.values() if b.kind == "weight" and len(b.shape) >= 2)
    assert base.weight_bytes - small.weight_bytes == pytest.approx(matrices / 2)
    assert small.state_bytes == pytest.approx(base.state_bytes / 2)  # all of smollm2's state is KV cache


def test_estimate_warns_when_the_step_does_not_fit_one_device():
    args = ["estimate", "llama-3.1-8b", "--device", "L4", "--batch", "64", "--ctx", "8192"]
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    mem = json.loads(r.stdout)["memory"]
    assert not mem["fits"] and mem["weight_bytes"] + mem["state_bytes"] > mem["device_bytes"] == 24e9
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "cannot run on a single device" in r.stderr
    r = runner.invoke(app, ["estimate", "llama-3.1-8b", "--device", "L4", "--batch", "64", "--ctx", "8192",
                            "--weights-dtype", "fp8", "--kv-dtype", "fp8", "--json"])
    assert not json.loads(r.stdout)["memory"]["fits"]  # 8 GB of weights + 34 GB of KV still exceed 24 GB
