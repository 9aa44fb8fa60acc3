"""The kernel census of two devices: shares, groupings, the plot, the CLI and a physically grounded check."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from tessera.capture.api import trace_model
from tessera.cli.main import app
from tessera.cost.census import (
    BLOCKS,
    EQUAL,
    Census,
    CensusError,
    KernelPair,
    Share,
    census,
    census_phases,
    parse_devices,
)
from tessera.cost.model import CostModel
from tessera.hardware.catalog import UnknownDeviceError
from tessera.hardware.devices import resolve_device
from tessera.report.plots import PlotError, census_ratio_cdf

runner = CliRunner()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MB = 1e6


@pytest.fixture(scope="module")
def graphs():
    """smollm2-135m at small shapes: a short prefill and a batch-1 decode (weight streaming)."""
    return {"prefill": trace_model("smollm2-135m", "prefill", seq=32, ctx=256),
            "decode": trace_model("smollm2-135m", "decode", batch=1, ctx=256)}


@pytest.fixture(scope="module")
def a100_l40s(graphs) -> Census:
    return census(graphs, CostModel(resolve_device("A100")), CostModel(resolve_device("L40S")))


def _pair(time_a: float, time_b: float, cls: str = "elementwise", block: str = "other") -> KernelPair:
    return KernelPair(phase="decode", index=0, op="aten.mul.Tensor", scope="", cost_class=cls, block=block,
                      flops=0.0, bytes=0.0, time_a_s=time_a, time_b_s=time_b, bound_a="latency", bound_b="latency")


def test_a_kernel_faster_on_one_side_counts_there():
    pairs = [_pair(1e-6, 2e-6), _pair(3e-6, 1e-6), _pair(4e-6, 2e-6), _pair(2e-6, 2e-6)]
    assert [p.faster for p in pairs] == ["a", "b", "b", EQUAL]
    s = Share.of(pairs)
    assert (s.kernels, s.kernels_a, s.kernels_b, s.kernels_equal) == (4, 1, 2, 1)
    assert s.kernel_share("a") == 0.25 and s.kernel_share("b") == 0.5 and s.kernel_share(EQUAL) == 0.25
    # step-time shares are of the first device's time: 1 us faster on a, 3 + 4 on b, 2 equal, of 10 us
    assert s.total_a_s == pytest.approx(10e-6) and s.total_b_s == pytest.approx(7e-6)
    assert s.time_share("a") == pytest.approx(0.1)
    assert s.time_share("b") == pytest.approx(0.7)
    assert s.time_share(EQUAL) == pytest.approx(0.2)
    assert s.ratios.median == pytest.approx(0.75)  # ratios 1/3, 1/2, 1, 2
    assert s.ratios.min == pytest.approx(1 / 3) and s.ratios.max == 2.0


def test_shares_sum_to_one_in_every_group(a100_l40s):
    c = a100_l40s
    groups = [c.overall, *c.by_class.values(), *c.by_block.values(), *c.by_phase.values()]
    for s in groups:
        assert sum(s.kernel_share(x) for x in ("a", "b", EQUAL)) == pytest.approx(1.0)
        assert sum(s.time_share(x) for x in ("a", "b", EQUAL)) == pytest.approx(1.0)
    for grouping in (c.by_class, c.by_block, c.by_phase):
        assert sum(s.kernels for s in grouping.values()) == c.overall.kernels == len(c.pairs)
        assert sum(s.total_a_s for s in grouping.values()) == pytest.approx(c.overall.total_a_s)
    assert set(c.by_phase) == {"prefill", "decode"} and c.phases == ("prefill", "decode")
    for phase, times in c.step_time_s.items():
        assert times["A100"] == pytest.approx(c.by_phase[phase].total_a_s)
        assert times["L40S"] == pytest.approx(c.by_phase[phase].total_b_s)


def test_groups_count_the_faster_side_of_each_kernel(a100_l40s):
    c = a100_l40s
    for name, s in c.by_class.items():
        members = [p for p in c.pairs if p.cost_class == name]
        assert s.kernels_a == sum(p.time_a_s < p.time_b_s for p in members)
        assert s.kernels_b == sum(p.time_b_s < p.time_a_s for p in members)
        assert s.time_b_s == pytest.approx(sum(p.time_a_s for p in members if p.faster == "b"))


def test_by_block_covers_attention_and_ffn(a100_l40s):
    blocks = a100_l40s.by_block
    assert {"attention", "ffn"} <= set(blocks) <= set(BLOCKS)
    assert all(blocks[b].kernels > 0 for b in ("attention", "ffn"))
    attention_ops = {p.cost_class for p in a100_l40s.pairs if p.block == "attention"}
    assert "attention" in attention_ops
    assert any(p.block == "ffn" and p.cost_class in ("gemm", "gemv") for p in a100_l40s.pairs)


def test_swapping_the_devices_mirrors_the_kernel_shares(graphs):
    a, b = CostModel(resolve_device("A100")), CostModel(resolve_device("L40S"))
    ab, ba = census(graphs, a, b), census(graphs, b, a)
    assert ab.overall.kernels_a == ba.overall.kernels_b and ab.overall.kernels_b == ba.overall.kernels_a
    assert ab.overall.ratios.geomean == pytest.approx(1 / ba.overall.ratios.geomean)
    # the time basis is the first device's: the shares differ but each side's own time agrees
    assert ab.overall.total_a_s == pytest.approx(ba.overall.total_b_s)


def test_decode_gemvs_stream_weights_faster_on_a100_small_elementwise_faster_on_l40s(a100_l40s):
    """Batch-1 decode: a GEMV reads its whole weight matrix once (memory bound); A100 has 2.2x the DRAM
    bandwidth of L40S (2.04 vs 0.864 TB/s). A small elementwise kernel is a few clocks of fixed cost,
    and L40S clocks at 2.52 GHz vs 1.41 GHz."""
    decode = [p for p in a100_l40s.pairs if p.phase == "decode"]
    big_gemvs = [p for p in decode if p.cost_class == "gemv" and p.bytes >= 1 * MB]
    assert len(big_gemvs) >= 30  # the MLP projections of every layer and the LM head
    assert all(p.time_a_s < p.time_b_s for p in big_gemvs)
    lm_head = max(big_gemvs, key=lambda p: p.bytes)
    assert lm_head.bytes > 50 * MB and lm_head.bound_a == lm_head.bound_b == "memory"
    assert lm_head.ratio > 1.5  # close to the bandwidth ratio
    small = [p for p in decode if p.cost_class == "elementwise" and p.bytes < 64 * 1024]
    assert len(small) >= 2 * 30  # at least RoPE and SiLU-and-mul of each of the 30 layers
    assert all(p.time_b_s < p.time_a_s for p in small)
    assert a100_l40s.by_class["elementwise"].kernel_share("b") == 1.0


def test_census_rejects_bad_inputs(graphs):
    a = CostModel(resolve_device("A100"))
    with pytest.raises(CensusError, match="two different devices"):
        census(graphs, a, CostModel(resolve_device("a100-sxm")))
    with pytest.raises(CensusError, match="one graph per phase"):
        census([graphs["decode"], graphs["decode"]], a, CostModel(resolve_device("L40S")))
    with pytest.raises(CensusError, match="at least one"):
        census([], a, CostModel(resolve_device("L40S")))


def test_parse_devices():
    a, b = parse_devices(" a100 , l40s ")
    assert (a.id, b.id) == ("A100", "L40S")
    for bad in ("A100", "A100,L40S,H100", "A100,", ""):
        with pytest.raises(CensusError, match="exactly two devices"):
            parse_devices(bad)
    with pytest.raises(CensusError, match="twice"):
        parse_devices("A100,a100-80g")
    with pytest.raises(UnknownDeviceError, match="L40S"):
        parse_devices("A100,L40X")


def test_census_phases_default_to_the_family():
    assert census_phases("smollm2-135m") == ("prefill", "decode")
    assert census_phases("sd3.5-medium") == ("encode", "step", "decode")
    assert census_phases("smollm2-135m", ["decode", "decode"]) == ("decode",)


def test_ratio_cdf_png_is_written(a100_l40s, tmp_path):
    for by in ("phase", "class", "block"):
        path = census_ratio_cdf(a100_l40s, tmp_path / f"sub/{by}.png", by=by)
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    import matplotlib.image

    img = matplotlib.image.imread(tmp_path / "sub/phase.png")
    assert img.shape[0] > 300 and img.shape[1] > 600
    with pytest.raises(PlotError, match="use one of phase, class, block"):
        census_ratio_cdf(a100_l40s, tmp_path / "x.png", by="layer")


def test_json_is_complete_and_labelled_predicted(a100_l40s):
    d = json.loads(json.dumps(a100_l40s.to_dict()))
    assert {"model", "devices", "phases", "overall", "by_class", "by_block", "by_phase", "step_time_s",
            "ratios"} <= set(d)
    assert d["predicted"] is True and d["devices"] == ["A100", "L40S"]
    assert d["overall"]["time_share_basis"] == "predicted time on A100"
    assert math.isclose(sum(d["overall"]["kernel_share"].values()), 1.0)
    assert set(d["step_time_s"]["decode"]) == {"A100", "L40S"}


def test_cli_census_json_and_plot(tmp_path):
    png = tmp_path / "c.png"
    r = runner.invoke(app, ["census", "smollm2-135m", "--devices", "A100,L40S", "--phase", "decode", "--batch",
                            "1", "--ctx", "256", "--plot", str(png), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["phases"] == ["decode"] and d["shapes"]["decode"]["batch"] == 1 and d["plot"] == str(png)
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_cli_census_table_default_plot_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["census", "smollm2-135m", "--devices", "L40S,A100", "-p", "decode", "--batch", "1",
                            "--ctx", "256", "--plot-by", "class"])
    assert r.exit_code == 0, r.output
    assert "predicted" in r.stdout and "kernels -> L40S" in r.stdout
    assert "predicted step time, decode: L40S" in r.stdout
    assert (tmp_path / "census_smollm2-135m_L40S_A100.png").read_bytes().startswith(PNG_MAGIC)
    assert "census_smollm2-135m_L40S_A100.png" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--devices", "A100"], "exactly two devices"),
    (["--devices", "A100,L40S,H100"], "exactly two devices"),
    (["--devices", "A100,L40X"], "L40X"),
    (["--devices", "A100,L40S", "--phase", "step"], "its phases are prefill, decode"),
    (["--devices", "A100,L40S", "--plot-by", "layer"], "--plot-by 'layer'"),
])
def test_cli_census_errors_exit_2(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["census", "smollm2-135m", *args])
    assert r.exit_code == 2, r.output
    assert "error:" in r.output and message in r.output
    assert "Traceback" not in r.output
    assert not list(tmp_path.iterdir())  # nothing written
