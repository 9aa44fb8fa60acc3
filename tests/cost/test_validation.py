"""`tessera validate`: measured times against predictions on the shipped calibration set and on a profile of
this host, time factors fitted on them and applied by the cost model (`--factors`), and the CLI."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tessera.cli.main import app
from tessera.cost.efficiency import efficiency_for
from tessera.cost.factors import TimeFactors, TimeFactorsError, load_time_factors
from tessera.cost.gpu_calibration import (
    MISMATCH_RATIO,
    POINTS_FILE,
    MeasuredKernel,
    classify_kernel_name,
    kernel_identity,
    predict_target,
)
from tessera.cost.measurements import MeasurementError
from tessera.cost.model import CostModel
from tessera.cost.options import CostOptions
from tessera.cost.validation import ValidationConfig, fit_factors, validate
from tessera.hardware.devices import resolve_device

runner = CliRunner()
FIXTURES = Path(__file__).parents[1] / "fixtures"
PROFILE = FIXTURES / "profiles" / "smollm2-135m_decode_b8_ctx256_cpu.json"


@pytest.fixture(scope="module")
def calibration():
    return validate(ValidationConfig((POINTS_FILE,)))


@pytest.fixture(scope="module")
def host_profile():
    return validate(ValidationConfig((PROFILE,)))


def _points() -> list[dict[str, str]]:
    lines = [line for line in POINTS_FILE.read_text().splitlines() if line and not line.startswith("#")]
    rows = list(csv.DictReader(lines, delimiter="\t"))
    return [r for r in rows if 1 / MISMATCH_RATIO <= float(r["l40s_us"]) / float(r["a100_us"]) <= MISMATCH_RATIO]


def test_calibration_set_errors_match_an_independent_computation(calibration):
    rows = _points()
    ref, tgt = resolve_device("A100-PCIE"), resolve_device("L40S")
    ref_eff, tgt_eff = efficiency_for(ref), efficiency_for(tgt)
    errors, ratios = [], {}
    for r in rows:
        cls = classify_kernel_name(r["kernel"])
        ident = kernel_identity(r["kernel"], r["phase"], r["category"])
        k = MeasuredKernel(r["phase"], r["category"], r["kernel"], cls, 1, float(r["a100_us"]) * 1e-6,
                           float(r["l40s_us"]) * 1e-6, ident)
        r_eff = ref_eff.ops.get(ident) or ref_eff.classes[cls]
        if ident in ref_eff.ops:
            r_eff = replace(ref_eff.classes[cls], floor_cycles=r_eff.floor_cycles)
        t_eff = tgt_eff.ops.get(ident) or tgt_eff.classes[cls]
        errors.append(abs(predict_target(k, ref, tgt, r_eff, t_eff) / k.target_s - 1))
        ratios.setdefault(cls, []).append(k.target_s / k.reference_s)
    overall = calibration.overall["L40S"]
    assert "A100-PCIE" not in calibration.overall  # the reference fixes sizes; it is not predicted
    assert calibration.references == {"A100-PCIE": len(rows)} and len(calibration.excluded) == 98 - len(rows)
    assert overall.count == len(rows)
    assert overall.median_abs == pytest.approx(float(np.median(errors)), rel=1e-9)
    assert overall.p90_abs == pytest.approx(float(np.percentile(errors, 90)), rel=1e-9)
    for row in calibration.ratios:  # the measured cross-device ratios, straight from the table
        assert (row.device_a, row.device_b) == ("A100-PCIE", "L40S")
        assert row.measured_median == pytest.approx(float(np.median(ratios[row.op_class])), rel=1e-9)


def test_host_profile_errors_match_cpu_calibration_pairing(host_profile):
    from tessera.capture.api import trace_model
    from tessera.cost.cpu_calibration import relative_errors, samples
    from tessera.cost.profile import Profile
    from tessera.hardware.host import host_spec

    prof = Profile.load(PROFILE)
    graph = trace_model(prof.model, prof.phase, batch=8, seq=1, ctx=256)
    device = host_spec(prof.threads)
    expected = relative_errors(samples(graph, prof), device, efficiency_for(device))
    got = {g.op_class: g.stats for g in host_profile.groups}
    assert set(got) == set(expected) - {"overall"}
    for cls, errs in expected.items():
        stats = host_profile.overall["cpu"] if cls == "overall" else got[cls]
        assert stats.count == len(errs)
        assert stats.median_abs == pytest.approx(float(np.median(errs)), rel=1e-9)


@pytest.mark.parametrize("which", ["calibration", "host_profile"])
def test_fit_then_factors_zeroes_the_median_error(which, request, tmp_path):
    result = request.getfixturevalue(which)
    files = (POINTS_FILE,) if which == "calibration" else (PROFILE,)
    factors = fit_factors(result, "test")
    path = tmp_path / "factors.json"
    factors.save(path)
    loaded = load_time_factors(path)
    assert loaded.as_mapping() == factors.as_mapping() and loaded.path == str(path)
    again = validate(ValidationConfig(files, CostOptions(factors=loaded)))
    fitted = {(g.device, g.op_class) for g in again.groups if g.stats.count >= 3}
    assert fitted
    for g in again.groups:
        if (g.device, g.op_class) in fitted:
            assert abs(g.stats.median_signed) < 1e-9, g
    before = {(g.device, g.op_class): g.stats for g in result.groups}
    worse_signed = [g for g in again.groups if abs(g.stats.median_signed) > abs(before[(g.device, g.op_class)]
                                                                              .median_signed) + 1e-9]
    assert not worse_signed
    # refitting on predictions that already carry the factors gives the same factors (fit is relative to none)
    refit = fit_factors(again, "test").as_mapping()
    assert refit.keys() == factors.as_mapping().keys()
    for device, classes in factors.as_mapping().items():
        assert refit[device] == pytest.approx(classes, rel=1e-12)


def test_fit_leaves_small_groups_without_factor(calibration):
    factors = fit_factors(calibration, "test", min_count=3).as_mapping()["L40S"]
    counts = {g.op_class: g.stats.count for g in calibration.groups}
    assert set(factors) == {c for c, n in counts.items() if n >= 3}
    with pytest.raises(MeasurementError, match="lower --min-count"):
        fit_factors(calibration, "test", min_count=1000)


def test_factors_multiply_one_class_in_the_cost_model():
    from tessera.capture.api import trace_model

    graph = trace_model("smollm2-135m", "decode", batch=32, ctx=256)
    a100 = resolve_device("A100")
    base = CostModel(a100).kernel_costs(graph)
    factors = TimeFactors.from_mapping({"A100": {"gemm": 2.0}, "L40S": {"*": 5.0}}, "test")
    scaled = CostModel(a100, CostOptions(factors=factors)).kernel_costs(graph)
    assert any(c.cost_class == "gemm" for c in base)
    for b, s in zip(base, scaled, strict=True):
        assert s.time_s == pytest.approx(b.time_s * (2.0 if b.cost_class == "gemm" else 1.0), rel=1e-12)
    l40s = resolve_device("L40S")
    every = CostModel(l40s, CostOptions(factors=factors)).estimate(graph).step_time_s
    assert every == pytest.approx(5.0 * CostModel(l40s).estimate(graph).step_time_s, rel=1e-12)


@pytest.mark.parametrize("doc, message", [
    ({"kind": "other"}, "not a Tessera time-factors file"),
    ({"kind": "tessera-time-factors", "version": 9, "devices": {}}, "version 9"),
    ({"kind": "tessera-time-factors", "version": 1}, "lacks 'devices'"),
    ({"kind": "tessera-time-factors", "version": 1, "devices": {"L40X": {"gemm": 1}}}, "unknown device 'L40X'"),
    ({"kind": "tessera-time-factors", "version": 1, "devices": {"l40s": {"gemm": 1}}}, "canonical id 'L40S'"),
    ({"kind": "tessera-time-factors", "version": 1, "devices": {"L40S": {"matmul": 1}}}, "unknown cost class"),
    ({"kind": "tessera-time-factors", "version": 1, "devices": {"L40S": {"gemm": "1"}}}, "must be a number"),
    ({"kind": "tessera-time-factors", "version": 1, "devices": {"L40S": {"gemm": 1e6}}}, "outside"),
    ({"kind": "tessera-time-factors", "version": 1, "devices": {"L40S": {}}}, "non-empty"),
])
def test_factors_file_errors(tmp_path, doc, message):
    p = tmp_path / "f.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(TimeFactorsError, match=message) as e:
        load_time_factors(p)
    assert str(p) in str(e.value)


def test_step_rows_predict_the_step_and_its_classes(tmp_path):
    p = tmp_path / "m.csv"
    p.write_text("device,model,op,shape,seconds\nA100,smollm2-135m,decode,batch=32 ctx=256,0.001\n"
                 "L40S,smollm2-135m,decode,batch=32 ctx=256,0.002\nA100,smollm2-135m,decode/gemm,batch=32 ctx=256,"
                 "0.0005\n")
    result = validate(ValidationConfig((p,)))
    from tessera.capture.api import trace_model

    graph = trace_model("smollm2-135m", "decode", batch=32, ctx=256)
    a100, l40s = CostModel(resolve_device("A100")), CostModel(resolve_device("L40S"))
    step_a, step_l = a100.estimate(graph).step_time_s, l40s.estimate(graph).step_time_s
    gemm_a = sum(c.time_s for c in a100.kernel_costs(graph) if c.cost_class == "gemm")
    got = [c.predicted_s for c in result.comparisons]
    assert got == pytest.approx([step_a, step_l, gemm_a], rel=1e-12)
    (ratio,) = result.ratios
    assert (ratio.device_a, ratio.device_b, ratio.op_class) == ("A100", "L40S", "step")
    assert ratio.measured_median == pytest.approx(2.0)
    assert ratio.predicted_median == pytest.approx(step_l / step_a)
    assert ratio.stats.median_signed == pytest.approx(step_l / step_a / 2.0 - 1)


def test_step_row_for_a_class_the_step_lacks(tmp_path):
    p = tmp_path / "m.csv"
    p.write_text("device,model,op,shape,seconds\nA100,smollm2-135m,decode/conv,batch=4,0.001\n")
    with pytest.raises(MeasurementError, match=r"m.csv:2: smollm2-135m decode has no conv kernels"):
        validate(ValidationConfig((p,)))


def test_nsys_kernels_predicted_from_the_reference(tmp_path):
    rows = _points()[:12]
    lines = ['"Start (ns)","Duration (ns)","Device","Name"']
    for i, r in enumerate(rows):
        name = f"{r['kernel']}#{i}".replace('"', "'")
        lines.append(f'{i},{float(r["a100_us"]) * 1000:.0f},"NVIDIA A100 80GB PCIe (0)","{name}"')
        lines.append(f'{i},{float(r["l40s_us"]) * 1000:.0f},"NVIDIA L40S (1)","{name}"')
    lines.append('99,5000,"NVIDIA L40S (1)","only_on_l40s_kernel"')
    p = tmp_path / "trace.csv"
    p.write_text("\n".join(lines) + "\n")
    result = validate(ValidationConfig((p,)))
    assert result.references == {"A100-PCIE": 12} and len(result.unpaired) == 1
    assert {c.measurement.device for c in result.comparisons} == {"L40S"}
    assert {c.basis for c in result.comparisons} == {"from A100-PCIE"}
    swapped = validate(ValidationConfig((p,), reference="l40s"))
    assert {c.measurement.device for c in swapped.comparisons} == {"A100-PCIE"}
    with pytest.raises(MeasurementError, match="--reference H100: no shape-less kernel"):
        validate(ValidationConfig((p,), reference="H100"))
    with pytest.raises(MeasurementError, match="--reference: unknown device 'H1OO'"):
        validate(ValidationConfig((p,), reference="H1OO"))


def test_step_row_at_a_shape_the_model_cannot_take(tmp_path):
    p = tmp_path / "m.csv"
    p.write_text("device,model,op,shape,seconds\nA100,smollm2-135m,decode,batch=99999999,0.001\n")
    with pytest.raises(MeasurementError, match=r"m.csv:2: cannot trace smollm2-135m decode at this shape"):
        validate(ValidationConfig((p,)))


def test_validate_cli_table_fit_plot_and_json(tmp_path):
    fit, plot = tmp_path / "f.json", tmp_path / "v.png"
    r = runner.invoke(app, ["validate", str(POINTS_FILE), str(PROFILE), "--fit", str(fit), "--plot", str(plot)])
    assert r.exit_code == 0, r.output
    assert "per device and op class" in r.stdout and "cross-device ratios" in r.stdout and "fitted factor" in r.stdout
    assert "A100-PCIE: reference of" in r.stdout
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert set(load_time_factors(fit).as_mapping()) == {"L40S", "cpu"}
    r = runner.invoke(app, ["validate", str(PROFILE), "--factors", str(fit), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["factors"] == str(fit) and d["overall"]["cpu"]["count"] == 304
    assert abs(d["overall"]["cpu"]["median_signed_error"]) < 0.5


def test_validate_cli_errors(tmp_path):
    bad = tmp_path / "m.csv"
    bad.write_text("device,model,op,shape,seconds\nA100,smollm2-135m,decode,batch=4,soon\n")
    r = runner.invoke(app, ["validate", str(bad)])
    assert r.exit_code == 2 and "m.csv:2: seconds 'soon' is not a number" in r.stderr
    r = runner.invoke(app, ["validate", str(POINTS_FILE), "--phase", "denoise"])
    assert r.exit_code == 2 and "--phase must be decode or prefill" in r.stderr
    r = runner.invoke(app, ["validate", str(POINTS_FILE), "--fit", str(tmp_path)])
    assert r.exit_code == 2 and "is an existing folder" in r.stderr


def test_estimate_plan_and_simulate_take_factors(tmp_path):
    path = tmp_path / "f.json"
    TimeFactors.from_mapping({"L40S": {"*": 2.0}}, "test").save(path)
    args = ["estimate", "smollm2-135m", "--device", "L40S", "--batch", "4", "--ctx", "256", "--json"]
    plain = json.loads(runner.invoke(app, args).stdout)
    scaled = json.loads(runner.invoke(app, [*args, "--factors", str(path)]).stdout)
    assert scaled["step_time_s"] == pytest.approx(2 * plain["step_time_s"], rel=1e-12)
    assert str(path) in scaled["factors"]
    plan = ["plan", "smollm2-135m", "--cluster", "L40S:1", "--policy", "homogeneous", "--workload",
            "fixed:in=64,out=16,requests=16", "--json"]
    a = json.loads(runner.invoke(app, plan).stdout)[0]
    b = json.loads(runner.invoke(app, [*plan, "--factors", str(path)]).stdout)[0]
    assert b["latency_s"] == pytest.approx(2 * a["latency_s"], rel=1e-6)
    sim = ["simulate", "smollm2-135m", "--cluster", "L40S:1", "--policy", "homogeneous", "--workload",
           "fixed:in=64,out=16,requests=16", "--json"]
    a = json.loads(runner.invoke(app, sim).stdout)
    b = json.loads(runner.invoke(app, [*sim, "--factors", str(path)]).stdout)
    assert b["makespan_s"] == pytest.approx(2 * a["makespan_s"], rel=1e-6)
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "tessera-time-factors", "version": 1, "devices": {"L40S": {"gemm": -1}}}')
    for cmd in (["simulate", "smollm2-135m", "--cluster", "L40S:1"], ["plan", "smollm2-135m", "--cluster", "L40S:1"],
                ["census", "smollm2-135m", "--devices", "A100,L40S"]):
        r = runner.invoke(app, [*cmd, "--factors", str(bad)])
        assert r.exit_code == 2 and "bad.json: devices.L40S.gemm = -1 is outside" in r.stderr, (cmd, r.output)
