"""The catalog's figures equal the datasheet values, in the precision the kernels use.

Tensor figures are dense (datasheets' sparse figures halved) with FP32 accumulate (GeForce RTX 4090: half
its FP16-accumulate rate, Ada whitepaper appendix A: 165.2 FP16/BF16 TFLOP/s, FP8 330.3). Bandwidth TB/s,
L2 MiB (MB as printed), boost clock MHz, compute capability from the CUDA programming guide.
Sources per row are in devices.yaml (`source`).
"""

import pytest

from tessera.hardware.devices import resolve_device

# id: (fp32, tf32, bf16, fp16, fp8, fp4, TB/s, L2 MB, SMs, boost MHz, compute capability)
DATASHEET = {
    # A100 datasheet (dense) / GA100 whitepaper
    "A100": (19.5, 156, 312, 312, None, None, 2.039, 40, 108, 1410, (8, 0)),
    "A100-PCIE": (19.5, 156, 312, 312, None, None, 1.935, 40, 108, 1410, (8, 0)),
    "A100-40G": (19.5, 156, 312, 312, None, None, 1.555, 40, 108, 1410, (8, 0)),
    # H100 / H200 datasheets (sparse halved) / Hopper whitepaper
    "H100": (67, 494.7, 989.4, 989.4, 1978.9, None, 3.35, 50, 132, 1980, (9, 0)),
    "H100-PCIE": (51, 378, 756, 756, 1513, None, 2.0, 50, 114, 1755, (9, 0)),
    "H200": (67, 494.7, 989.4, 989.4, 1978.9, None, 4.8, 50, 132, 1980, (9, 0)),
    "H20": (44, 74, 148, 148, 296, None, 4.0, 60, 78, 1755, (9, 0)),
    # HGX B200 datasheet / 8, sparse halved
    "B200": (75, 1125, 2250, 2250, 4500, 9000, 8.0, 126, 148, 1965, (10, 0)),
    # Ada datasheets (L40S full-rate FP32 accumulate; L40 prints half the L40S's tensor rates)
    "L40S": (91.6, 183, 362.05, 362.05, 733, None, 0.864, 96, 142, 2520, (8, 9)),
    "L40": (90.5, 90.5, 181.05, 181.05, 362.1, None, 0.864, 96, 142, 2490, (8, 9)),
    "L4": (30.3, 60, 121, 121, 242.5, None, 0.3, 48, 58, 2040, (8, 9)),
    # GA102 parts (datasheets, sparse halved; professional parts accumulate FP32 at full rate)
    "A10": (31.2, 62.5, 125, 125, None, None, 0.6, 6, 72, 1695, (8, 6)),
    "A40": (37.4, 74.8, 149.7, 149.7, None, None, 0.696, 6, 84, 1740, (8, 6)),
    "A6000": (38.7, 77.4, 154.8, 154.8, None, None, 0.768, 6, 84, 1800, (8, 6)),
    # Ada whitepaper appendix A, FP32-accumulate column (GeForce: half the FP16-accumulate 330.3)
    "RTX4090": (82.6, 82.6, 165.2, 165.2, 330.3, None, 1.008, 72, 128, 2520, (8, 9)),
    # RTX Blackwell whitepaper (dense, FP32 accumulate; 4 PFLOP/s FP4 is sparse)
    "RTXPRO6000": (125, 251.9, 503.8, 503.8, 1007.6, 2015.2, 1.792, 128, 188, 2617, (12, 0)),
    # Tesla V100 SXM2 datasheet (FP16 tensor cores only)
    "V100": (15.7, None, None, 125, None, None, 0.9, 6, 80, 1530, (7, 0)),
    # AMD Instinct MI300X data sheet (dense matrix; 256 MB Infinity Cache as the last level)
    "MI300X": (81.7, 653.7, 1307.4, 1307.4, 2614.9, None, 5.3, 256, 304, 2100, None),
}
PATHS = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp4")


@pytest.mark.parametrize("dev", sorted(DATASHEET))
def test_catalog_equals_datasheet(dev):
    *tflops, tbs, l2, sms, mhz, cc = DATASHEET[dev]
    spec = resolve_device(dev)
    for path, value in zip(PATHS, tflops, strict=True):
        got = spec.peak_flops(path)
        assert (got is None) if value is None else got == pytest.approx(value * 1e12), (dev, path, got)
    assert spec.memory_bandwidth == pytest.approx(tbs * 1e12)
    assert spec.l2_bytes == l2 * 2**20
    assert spec.sm_count == sms
    assert spec.boost_clock_hz == pytest.approx(mhz * 1e6)
    assert spec.compute_capability == cc


def test_every_catalog_gpu_is_in_the_table():
    from tessera.hardware.catalog import load_devices

    assert set(load_devices()) == set(DATASHEET)


def test_geforce_fp32_accumulate_is_half_the_fp16_accumulate_rate():
    # RTX 4090: 330.3 TFLOP/s dense FP16 with FP16 accumulate (Ada whitepaper); the kernels accumulate in FP32
    assert resolve_device("RTX4090").peak_flops("bf16") == pytest.approx(330.3e12 / 2, rel=1e-3)


def test_bad_compute_capability_is_named(tmp_path):
    import yaml

    from tessera.hardware.catalog import DEVICES_FILE, DeviceCatalogError, load_devices

    doc = yaml.safe_load(DEVICES_FILE.read_text())
    doc["devices"][0]["compute_capability"] = "eight"
    path = tmp_path / "devices.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(DeviceCatalogError, match=r"row 0 \(id 'A100'\), field 'compute_capability'.*8\.0"):
        load_devices(path)
