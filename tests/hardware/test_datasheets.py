"""The catalog against its datasheets: every figure of every row cites its document, and equals the number
the document prints after the conversions the citation names (sparse to dense, bidirectional to per
direction, GeForce FP16 accumulate to FP32 accumulate, units). The citations live in devices.yaml
(`sources`), so the figures are written once: these tests read them back through the loaded specs.
"""

import pytest
import yaml

from tessera.hardware.catalog import (
    ACCUMULATE,
    DEVICES_FILE,
    HOST_FIGURES,
    DeviceCatalogError,
    figure_values,
    host_row,
    load_devices,
)
from tessera.hardware.devices import resolve_device
from tessera.hardware.sources import CONVERSIONS, HALF_RATE, STATUSES

SPECS = load_devices()


def test_figure_values_are_in_the_yaml_units():
    values = figure_values(resolve_device("A100"))
    assert values == pytest.approx({"memory_gb": 80, "bandwidth_tb_s": 2.039, "tflops.fp32": 19.5, "tflops.tf32": 156,
                                    "tflops.bf16": 312, "tflops.fp16": 312, "sm_count": 108, "compute_capability": 8.0,
                                    "boost_clock_mhz": 1410, "l2_mib": 40, "launch_latency_us": 3, "nvlink_gb_s": 300,
                                    "pcie_gb_s": 32, "prices": None})
    assert figure_values(resolve_device("RTXPRO6000"))["compute_capability"] == 12.0
    assert figure_values(resolve_device("MI300X"))["compute_capability"] is None


@pytest.mark.parametrize("dev", sorted(SPECS))
def test_every_figure_cites_its_document(dev):
    spec = SPECS[dev]
    assert set(spec.sources) == set(figure_values(spec))
    for figure, cite in spec.sources.items():
        assert cite.figure == figure and cite.status in STATUSES
        if cite.status == "printed":
            assert cite.doc is not None and cite.printed, (dev, figure)
            assert cite.doc.url or cite.doc.copies, (dev, figure, "a document says where it can be read")
        else:
            assert cite.note, (dev, figure, "a figure not printed says how it was obtained")
        assert all(c in CONVERSIONS for c in cite.convert)


@pytest.mark.parametrize("dev", sorted(SPECS))
def test_catalog_equals_the_cited_printed_figure(dev):
    spec = SPECS[dev]
    quoted = 0
    for figure, value in figure_values(spec).items():
        cite = spec.sources[figure]
        if cite.number is None:
            continue
        quoted += 1
        assert value is not None and cite.matches(value), (dev, figure, value, cite.printed, cite.convert)
    assert quoted >= 5, f"{dev}: fewer than 5 figures quote a printed number"


def test_every_listed_document_is_cited():
    listed = set(yaml.safe_load(DEVICES_FILE.read_text())["documents"])
    cited = {c.doc.key for spec in SPECS.values() for c in spec.sources.values() if c.doc}
    assert cited == listed


def test_estimates_say_so_and_the_host_cites_its_measurement():
    for spec in SPECS.values():
        assert spec.sources["prices"].status == "estimate"
        assert spec.sources["launch_latency_us"].status == "estimate"
    host = host_row().sources
    assert set(host) == set(HOST_FIGURES)
    assert {c.status for f, c in host.items() if f not in ("prices", "pcie_gb_s")} == {"measured"}


def test_every_row_states_which_tensor_figure_it_uses():
    assert {spec.accumulate for spec in SPECS.values()} <= set(ACCUMULATE)
    geforce = {d for d, s in SPECS.items() if "GeForce" in s.name}
    assert geforce == {"RTX4090"}
    for dev, spec in SPECS.items():
        assert spec.accumulate == ("fp32-half-rate" if dev in geforce else "fp32"), dev


def test_geforce_fp32_accumulate_is_half_the_printed_fp16_accumulate_rate():
    spec = resolve_device("RTX4090")
    for path in ("bf16", "fp16", "fp8"):
        cite = spec.sources[f"tflops.{path}"]
        assert HALF_RATE in cite.convert
        # printed: 661 (1321) TFLOPS with FP16 accumulate and sparsity; FP32 accumulate dense is a quarter
        assert spec.peak_flops(path) == pytest.approx(cite.number / 4 * 1e12, rel=1e-3)
    assert spec.peak_flops("bf16") == pytest.approx(330.3e12 / 2, rel=1e-3)


def test_audited_values_follow_the_datasheets():
    # the values the audit of 2026-12-04 changed, each to the cited printed figure
    assert resolve_device("B200").memory_bandwidth == pytest.approx(7.7e12)  # HGX B200: 180GB HBM3E | 7.7TB/s
    assert resolve_device("B200").peak_flops("tf32") == pytest.approx(1100e12)  # TF32 2.2 PFLOPS with sparsity
    assert resolve_device("L40").peak_flops("fp8") == pytest.approx(362e12)  # FP8 Tensor Core 362 | 724*
    assert resolve_device("MI300X").peak_flops("fp32") == pytest.approx(163.4e12)  # FP32 vector, not FP64's 81.7


# --- the loader rejects a row whose citations are missing or disagree with it -------------------------------

def _load(tmp_path, mutate):
    doc = yaml.safe_load(DEVICES_FILE.read_text())
    mutate(doc)
    path = tmp_path / "devices.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    with pytest.raises(DeviceCatalogError) as e:
        load_devices(path)
    return str(e.value)


def _row(doc, rid):
    return next(r for r in doc["devices"] if r["id"] == rid)


def _drop_citation(doc):
    del _row(doc, "H100")["sources"]["tflops.bf16"]


def _wrong_value(doc):
    _row(doc, "H100")["tflops"]["bf16"] = 991


def _extra_citation(doc):
    _row(doc, "A100")["sources"]["tflops.fp8"] = {"status": "estimate", "note": "none"}


def _unknown_document(doc):
    _row(doc, "A100")["sources"]["memory_gb"]["doc"] = "a100-brochure"


def _number_not_printed(doc):
    _row(doc, "A100")["sources"]["memory_gb"]["number"] = 81


def _half_rate_on_data_centre_part(doc):
    _row(doc, "A100")["accumulate"] = "fp32-half-rate"


def _no_accumulate_field(doc):
    del _row(doc, "L40S")["accumulate"]


def _estimate_without_note(doc):
    _row(doc, "L4")["sources"]["prices"] = {"status": "estimate"}


def _printed_without_document(doc):
    del _row(doc, "L4")["sources"]["memory_gb"]["doc"]


def _unknown_conversion(doc):
    _row(doc, "H100")["sources"]["nvlink_gb_s"]["convert"] = ["halved"]


def _price_with_one_number(doc):
    _row(doc, "A100")["sources"]["prices"] = {"doc": "a100-ds", "printed": "relative 1.5", "number": 1.5}


def _document_without_url(doc):
    doc["documents"]["a100-ds"]["url"] = "nvidia.com/a100.pdf"


def _host_missing_citation(doc):
    del _row(doc, "cpu")["sources"]["l2_mib"]


@pytest.mark.parametrize("mutate,expected", [
    (_drop_citation, ["row 3 (id 'H100')", "'sources.tflops.bf16'", "missing citation"]),
    (_wrong_value, ["row 3 (id 'H100')", "'sources.tflops.bf16'", "the row says 991", "989.4"]),
    (_extra_citation, ["row 0 (id 'A100')", "'sources.tflops.fp8'", "does not have"]),
    (_unknown_document, ["row 0 (id 'A100')", "'sources.memory_gb'", "unknown document 'a100-brochure'"]),
    (_number_not_printed, ["row 0 (id 'A100')", "'sources.memory_gb'", "number 81 does not appear"]),
    (_half_rate_on_data_centre_part, ["row 0 (id 'A100')", "'sources.tflops.bf16'", "must convert"]),
    (_no_accumulate_field, ["row 8 (id 'L40S')", "'accumulate'", "missing"]),
    (_estimate_without_note, ["row 10 (id 'L4')", "'sources.prices'", "'note'"]),
    (_printed_without_document, ["row 10 (id 'L4')", "'sources.memory_gb'", "names its document"]),
    (_unknown_conversion, ["row 3 (id 'H100')", "'sources.nvlink_gb_s'", "'convert'", "sparse to dense"]),
    (_price_with_one_number, ["row 0 (id 'A100')", "'sources.prices'", "one number for a mapping"]),
    (_document_without_url, ["documents: document 'a100-ds'", "http(s) URLs"]),
    (_host_missing_citation, ["row 18 (id 'cpu')", "'sources.l2_mib'", "missing citation"]),
])
def test_loader_rejects_a_row_without_a_matching_citation(tmp_path, mutate, expected):
    msg = _load(tmp_path, mutate)
    for part in expected:
        assert part in msg, (part, msg)


def test_bad_compute_capability_is_named(tmp_path):
    def mutate(doc):
        doc["devices"][0]["compute_capability"] = "eight"

    msg = _load(tmp_path, mutate)
    assert "row 0 (id 'A100'), field 'compute_capability'" in msg and "8.0" in msg
