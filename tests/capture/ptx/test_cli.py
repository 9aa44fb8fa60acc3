"""`tessera ptx analyze` and `tessera ptx instrument`, through a small typer app mounting `ptx_app`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tessera.cli.ptx import ptx_app

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "ptx"
UNIT = FIXTURES / "unit"
BINARIES = FIXTURES / "binaries"

app = typer.Typer()
app.add_typer(ptx_app, name="ptx")
runner = CliRunner()

HAS_EXTRACT = importlib.util.find_spec("tessera.capture.ptx.extract") is not None
HAS_INSTRUMENT = importlib.util.find_spec("tessera.capture.ptx.instrument") is not None


def _cuobjdump() -> bool:
    if not HAS_EXTRACT:
        return False
    from tessera.capture.ptx.extract import find_tool

    return find_tool("cuobjdump") is not None


needs_cuobjdump = pytest.mark.skipif(not _cuobjdump(), reason="needs tessera.capture.ptx.extract and cuobjdump "
                                                             "(pip install nvidia-cuda-cuobjdump)")


def ptx(*args: str):
    return runner.invoke(app, ["ptx", *args])


def test_analyze_prints_a_table_per_kernel():
    r = ptx("analyze", str(UNIT / "misc.sm_90.ptx"))
    assert r.exit_code == 0, r.output
    for name in ("k_struct", "k_func", "k_selp", "k_ind", "k_gen"):
        assert name in r.stdout
    assert "read-write" in r.stdout and "descriptor" not in r.stdout
    assert "10 kernel(s) analysed." in r.stdout
    assert r.stderr == ""


def test_analyze_json_is_a_list_of_kernels_in_declaration_order():
    r = ptx("analyze", "--json", str(UNIT / "misc.sm_90.ptx"), str(UNIT / "triton_tma_copy.sm_90a.ptx"))
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [k["name"] for k in data][:2] == ["k_struct", "k_func"] and data[-1]["name"] == "tma_copy"
    for k in data:
        assert list(k) == ["name", "file", "indirect", "params"]
        assert [p["index"] for p in k["params"]] == list(range(len(k["params"])))
        for p in k["params"]:
            assert list(p) == ["index", "name", "kind", "access", "indirect", "reason", "fields"]
    struct = data[0]["params"][0]
    assert struct["kind"] == "struct" and struct["fields"] == [{"offset": 0, "access": "write"},
                                                              {"offset": 8, "access": "read"}]
    tma = data[-1]
    assert tma["file"].endswith("triton_tma_copy.sm_90a.ptx")
    assert [p["kind"] for p in tma["params"]][:1] == ["descriptor"]


def test_syntax_errors_go_to_stderr_with_file_line_and_the_rest_is_still_printed():
    bad = str(UNIT / "hand_malformed.ptx")
    r = ptx("analyze", "--json", bad, str(UNIT / "nvrtc.sm_80.ptx"))
    assert r.exit_code == 1
    names = [k["name"] for k in json.loads(r.stdout)]
    assert names == ["k_outparam", "k_after", "saxpy", "_Z5scaleIdEvPT_S0_i", "_Z5gridc4Pairi"]
    for line in (61, 74, 82):
        assert f"{bad}:{line}:" in r.stderr


def test_unreadable_file_exits_2_after_the_others(tmp_path):
    missing = tmp_path / "nope.ptx"
    r = ptx("analyze", "--json", str(missing), str(UNIT / "nvrtc.sm_80.ptx"))
    assert r.exit_code == 2
    assert len(json.loads(r.stdout)) == 3
    assert "nope.ptx" in r.stderr


def test_a_file_without_kernels_is_an_error(tmp_path):
    empty = tmp_path / "empty.ptx"
    empty.write_text(".version 8.0\n.target sm_80\n.address_size 64\n")
    r = ptx("analyze", str(empty))
    assert r.exit_code == 1 and "no kernels found" in r.stderr


@needs_cuobjdump
def test_binary_without_ptx_says_so_and_lists_its_sass_only_kernels():
    r = ptx("analyze", str(BINARIES / "kernels.cubin"))
    assert r.exit_code == 1
    err = r.stderr
    assert "contains no PTX" in err and "scale" in err and "vadd" in err


@needs_cuobjdump
def test_binaries_with_ptx_are_analysed():
    r = ptx("analyze", "--json", str(BINARIES / "kernels.fatbin"), str(BINARIES / "kernels.so"))
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert {k["name"] for k in data} >= {"vadd", "scale"}
    assert all(":" in k["file"] for k in data)       # file:member of the embedded PTX


@pytest.mark.skipif(not HAS_INSTRUMENT, reason="tessera.capture.ptx.instrument is not installed")
def test_instrument_writes_the_output_and_reports_sites(tmp_path):
    out = tmp_path / "inst.ptx"
    r = ptx("instrument", str(UNIT / "misc.sm_90.ptx"), "-o", str(out))
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert "atom.global.min.u64" in text and "atom.global.max.u64" in text
    assert "site(s) instrumented" in r.stdout
    r = ptx("instrument", str(UNIT / "triton_tma_copy.sm_90a.ptx"), "-o", str(out), "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["output"] == str(out) and data["skipped"]          # bulk tensor copies cannot be recorded
    assert {"function", "line", "reason"} <= set(data["skipped"][0])


@pytest.mark.skipif(not HAS_INSTRUMENT, reason="tessera.capture.ptx.instrument is not installed")
def test_instrument_missing_input_exits_2(tmp_path):
    r = ptx("instrument", str(tmp_path / "missing.ptx"), "-o", str(tmp_path / "o.ptx"))
    assert r.exit_code == 2 and "missing.ptx" in r.stderr
