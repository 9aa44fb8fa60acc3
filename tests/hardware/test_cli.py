"""`tessera devices`: the catalog table and JSON, cluster descriptions, and their errors."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from tessera.cli.main import app

runner = CliRunner()


def test_catalog_json_lists_every_datasheet_device_with_its_source():
    r = runner.invoke(app, ["devices", "--json"])
    assert r.exit_code == 0, r.output
    rows = {d["id"]: d for d in json.loads(r.stdout)}
    assert {"A100", "A100-PCIE", "H100", "H200", "B200", "L40S", "RTXPRO6000", "MI300X"} <= set(rows)
    assert rows["L40S"]["memory_bandwidth"] == 0.864e12 and round(rows["L40S"]["flops"]["bf16"] / 1e12) == 362
    assert all(d["source"] and d["as_of"] for d in rows.values())
    assert rows["RTX4090"]["accumulate"] == "fp32-half-rate" and rows["A100"]["accumulate"] == "fp32"
    bf16 = rows["A100"]["sources"]["tflops.bf16"]
    assert bf16["status"] == "printed" and bf16["number"] == 312 and "datasheet" in bf16["document"]["title"]
    assert rows["B200"]["sources"]["tflops.tf32"]["convert"] == ["PFLOPS to TFLOPS", "sparse to dense"]


def test_catalog_table():
    r = runner.invoke(app, ["devices"])
    assert r.exit_code == 0 and "A100-PCIE" in r.stdout and "RTXPRO6000" in r.stdout


def test_cluster_description():
    r = runner.invoke(app, ["devices", "--cluster", "A100:2,L40S:1", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["devices"] == ["A100:0", "A100:1", "L40S:0"]
    assert [n["devices"] for n in d["nodes"]] == [{"A100": 2}, {"L40S": 1}]
    r = runner.invoke(app, ["devices", "--cluster", "A100:2,L40S:1"])
    assert r.exit_code == 0 and "200 Gb/s IB" in r.stdout


def test_cluster_errors_exit_2():
    r = runner.invoke(app, ["devices", "--cluster", "A100:x"])
    assert r.exit_code == 2 and "'A100:x'" in r.stderr and "TYPE:COUNT" in r.stderr
    r = runner.invoke(app, ["devices", "--cluster", "A10O:2"])
    assert r.exit_code == 2 and "did you mean" in r.stderr


def test_example_cluster_file():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "h100_rtxpro6000.yaml"
    r = runner.invoke(app, ["devices", "--cluster", str(example), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert len(d["devices"]) == 8 and d["network"]["kind"] == "ib"
    assert [n["link"]["kind"] for n in d["nodes"]] == ["nvlink", "pcie"]
