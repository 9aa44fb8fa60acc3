"""The device catalog: lookup, datasheet rows in SI units, schema errors, and the measured host CPU."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from tessera.hardware.catalog import (
    DEVICES_FILE,
    FLOP_PATHS,
    DeviceCatalogError,
    UnknownDeviceError,
    device_ids,
    load_devices,
)
from tessera.hardware.devices import resolve_device
from tessera.hardware.host import host_cores, host_spec

CONTRACT_IDS = ["A100", "A100-PCIE", "A100-40G", "H100", "H100-PCIE", "H200", "H20", "B200", "L40S", "L40", "L4",
                "A10", "A40", "A6000", "RTX4090", "RTXPRO6000", "V100", "MI300X", "cpu"]


@pytest.mark.parametrize("name,expected", [
    ("A100-80G SXM", "A100"), ("a100", "A100"), ("A100_SXM4", "A100"), ("a100-pcie", "A100-PCIE"),
    ("A100 80G PCIe", "A100-PCIE"), ("RTX Pro 6000", "RTXPRO6000"), ("h100 sxm", "H100"),
    ("H100-PCIe", "H100-PCIE"), ("l40s", "L40S"), ("mi300x", "MI300X"), ("rtx 4090", "RTX4090"),
])
def test_aliases_resolve(name, expected):
    assert resolve_device(name).id == expected


def test_every_contract_device_has_a_complete_row():
    assert device_ids() == CONTRACT_IDS
    specs = load_devices()
    assert list(specs) == CONTRACT_IDS[:-1]
    for spec in specs.values():
        numbers = [spec.memory_bytes, spec.memory_bandwidth, spec.sm_count, spec.boost_clock_hz, spec.l2_bytes,
                   spec.launch_latency_s, spec.pcie_bandwidth, *spec.flops.values(), *spec.prices.values()]
        assert all(n > 0 for n in numbers), spec.id
        assert spec.nvlink_bandwidth is None or spec.nvlink_bandwidth > 0
        assert spec.source and spec.as_of and spec.name and spec.arch
        assert spec.vendor in ("nvidia", "amd") and not spec.measured and spec.threads is None
        assert "fp32" in spec.flops and set(spec.flops) <= set(FLOP_PATHS)
        assert set(spec.prices) == {"relative", "cloud_usd"}
        assert 1e-6 <= spec.launch_latency_s <= 5e-6
        # tensor paths are never below the part's fp32 vector rate
        assert all(v >= spec.flops["fp32"] for v in spec.flops.values())


def test_units_are_converted_to_si():
    a100 = resolve_device("A100")
    assert a100.memory_bandwidth == pytest.approx(2.039e12)
    assert a100.memory_bytes == 80 * 10**9
    assert a100.flops == pytest.approx({"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12})
    assert a100.boost_clock_hz == pytest.approx(1.41e9)
    assert a100.l2_bytes == 40 * 2**20
    assert a100.launch_latency_s == pytest.approx(3e-6)
    assert a100.nvlink_bandwidth == pytest.approx(300e9)
    assert a100.pcie_bandwidth == pytest.approx(32e9)
    assert a100.sm_count == 108


@pytest.mark.parametrize("dev,bf16,tbs,gb", [
    ("A100", 312, 2.039, 80), ("L40S", 362.05, 0.864, 48), ("H100", 989.4, 3.35, 80), ("H200", 989.4, 4.8, 141),
    ("B200", 2250, 7.7, 180), ("RTXPRO6000", 503.8, 1.792, 96), ("L4", 121, 0.30, 24), ("A10", 125, 0.60, 24),
    ("A100-PCIE", 312, 1.935, 80),
])
def test_reference_datasheet_figures(dev, bf16, tbs, gb):
    spec = resolve_device(dev)
    assert spec.peak_flops("bf16") == pytest.approx(bf16 * 1e12)
    assert spec.memory_bandwidth == pytest.approx(tbs * 1e12)
    assert spec.memory_bytes == gb * 10**9


def test_contract_details():
    pcie, l40s = resolve_device("A100-PCIE"), resolve_device("L40S")
    assert (pcie.boost_clock_hz, pcie.sm_count, pcie.l2_bytes, pcie.nvlink_bandwidth) == (1.41e9, 108, 40 * 2**20,
                                                                                          None)
    assert (l40s.sm_count, l40s.boost_clock_hz, l40s.l2_bytes) == (142, 2.52e9, 96 * 2**20)
    assert l40s.peak_flops("fp32") == pytest.approx(91.6e12) and l40s.nvlink_bandwidth is None
    prices = {d: resolve_device(d).price() for d in ("A100", "L40S", "H100", "RTXPRO6000", "B200")}
    assert prices == {"A100": 1.5, "L40S": 1.0, "H100": 2.9, "RTXPRO6000": 1.2, "B200": 5.0}
    assert resolve_device("H100").price("cloud_usd") > 0
    with pytest.raises(Exception, match="scenario"):
        resolve_device("H100").price("spot")


@pytest.mark.parametrize("dev,present,absent", [
    ("A100", ["fp32", "tf32", "bf16", "fp16"], ["fp8", "fp4"]),
    ("A10", ["tf32", "bf16"], ["fp8", "fp4"]),
    ("A40", ["bf16"], ["fp8", "fp4"]),
    ("A6000", ["bf16"], ["fp8", "fp4"]),
    ("V100", ["fp32", "fp16"], ["bf16", "tf32", "fp8", "fp4"]),
    ("H100", ["fp8"], ["fp4"]),
    ("L40S", ["fp8"], ["fp4"]),
    ("MI300X", ["tf32", "bf16", "fp16", "fp8"], ["fp4"]),
    ("B200", ["fp8", "fp4"], []),
    ("RTXPRO6000", ["fp8", "fp4"], []),
])
def test_missing_tensor_paths_are_none(dev, present, absent):
    spec = resolve_device(dev)
    assert all(spec.peak_flops(p) > 0 for p in present)
    assert all(spec.peak_flops(p) is None for p in absent)


def test_unknown_compute_path_is_an_error_not_none():
    with pytest.raises(ValueError, match="bf61.*fp32"):
        resolve_device("A100").peak_flops("bf61")


def test_unknown_device_lists_close_matches_and_known_ids():
    with pytest.raises(UnknownDeviceError) as e:
        resolve_device("A10O")
    msg = str(e.value)
    assert "'A10O'" in msg and "did you mean" in msg
    close = msg.split("did you mean", 1)[1].split("?")[0]
    assert "A100" in close and "A10" in close
    assert all(i in msg for i in CONTRACT_IDS)
    with pytest.raises(UnknownDeviceError, match="cluster spec"):
        resolve_device("A100:2")
    with pytest.raises(UnknownDeviceError, match="cpu:N"):
        resolve_device("cpu:0")


# --- schema errors of a broken devices file ---------------------------------------------------------------

def _rows():
    return yaml.safe_load(DEVICES_FILE.read_text())


def _drop(field):
    def f(doc):
        del doc["devices"][3][field]
    return f


def _set(row, field, value):
    def f(doc):
        doc["devices"][row][field] = value
    return f


def _dup_id(doc):
    doc["devices"][5]["id"] = "A100"


def _dup_alias(doc):
    doc["devices"][1]["aliases"].append("a100 sxm")


def _bad_path(doc):
    doc["devices"][3]["tflops"]["fp6"] = 10


def _no_cpu(doc):
    doc["devices"] = [r for r in doc["devices"] if r["id"] != "cpu"]


@pytest.mark.parametrize("mutate,expected", [
    (_drop("bandwidth_tb_s"), ["row 3 (id 'H100')", "'bandwidth_tb_s'", "missing"]),
    (_set(3, "color", "green"), ["row 3 (id 'H100')", "'color'", "unknown field"]),
    (_set(3, "memory_gb", -80), ["row 3 (id 'H100')", "'memory_gb'", "positive"]),
    (_set(3, "pcie_gb_s", "fast"), ["row 3 (id 'H100')", "'pcie_gb_s'", "number"]),
    (_set(3, "sm_count", 1.5), ["row 3 (id 'H100')", "'sm_count'", "whole number"]),
    (_set(3, "vendor", "intel"), ["row 3 (id 'H100')", "'vendor'", "nvidia, amd"]),
    (_set(3, "prices", {"relative": 1, "spot": 2}), ["row 3 (id 'H100')", "'prices.spot'", "unknown key"]),
    (_bad_path, ["row 3 (id 'H100')", "'tflops.fp6'", "unknown key", "fp32, tf32, bf16"]),
    (_dup_id, ["row 5 (id 'A100')", "'id'", "already used by device 'A100'"]),
    (_dup_alias, ["row 1 (id 'A100-PCIE')", "'aliases'", "'a100 sxm'", "already used by device 'A100'"]),
    (_set(18, "memory_gb", 16), ["row 18 (id 'cpu')", "'memory_gb'", "unknown field"]),
    (_no_cpu, ["no row with id 'cpu'"]),
])
def test_broken_devices_file_names_row_and_field(tmp_path, mutate, expected):
    doc = _rows()
    mutate(doc)
    path = tmp_path / "devices.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(DeviceCatalogError) as e:
        load_devices(path)
    msg = str(e.value)
    assert str(path) in msg
    for part in expected:
        assert part in msg


def test_unreadable_devices_file(tmp_path):
    bad = tmp_path / "devices.yaml"
    bad.write_text("devices: [a: b: c")
    with pytest.raises(DeviceCatalogError, match="not valid YAML"):
        load_devices(bad)
    with pytest.raises(DeviceCatalogError, match="cannot read"):
        load_devices(tmp_path / "missing.yaml")


def test_catalog_copy_loads_the_same(tmp_path):
    path = tmp_path / "devices.yaml"
    path.write_text(DEVICES_FILE.read_text())
    assert load_devices(path) == load_devices()


# --- the measured host ------------------------------------------------------------------------------------

def test_host_spec_is_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    threads_before = torch.get_num_threads()
    cpu = host_spec()
    assert torch.get_num_threads() == threads_before
    assert cpu.id == "cpu" and cpu.vendor == "host" and cpu.measured
    assert cpu.threads == cpu.sm_count == host_cores()
    assert cpu.flops["fp32"] > 0 and cpu.flops["bf16"] > 0 and cpu.peak_flops("fp8") is None
    assert cpu.memory_bandwidth > 0 and cpu.pcie_bandwidth == pytest.approx(cpu.memory_bandwidth / 2)
    assert 0 < cpu.launch_latency_s < 1e-3 and cpu.l2_bytes > 0 and cpu.boost_clock_hz > 0
    assert cpu.memory_bytes > 0 and cpu.nvlink_bandwidth is None and cpu.price() > 0
    assert "host" in cpu.aliases and "measured" in cpu.source and cpu.as_of

    files = list((tmp_path / "host").glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    data["memory_bandwidth"] = 1234.0  # a value no measurement gives: the next call must read the cache
    files[0].write_text(json.dumps(data))
    assert host_spec().memory_bandwidth == 1234.0
    assert resolve_device("host").memory_bandwidth == 1234.0

    files[0].write_text("{not json")  # a broken cache entry is measured again
    assert host_spec().memory_bandwidth > 1e6


def test_cpu_workers_split_the_cores(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    spec = resolve_device("cpu:2")
    assert spec.threads == max(1, host_cores() // 2)
    assert resolve_device("cpu:64").threads == max(1, host_cores() // 64)  # 64: the most workers allowed
    with pytest.raises(ValueError, match="threads"):
        host_spec(0)


def test_the_host_key_names_torch_as_installed_without_importing_it(monkeypatch):
    import torch

    from tessera.hardware import host

    assert host._host_key(1)["torch"] == str(torch.__version__)  # the key cached measurements were filed under

    def absent(name):
        raise host.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(host.metadata, "version", absent)  # no package metadata: torch itself says
    assert host._torch_version() == str(torch.__version__)
