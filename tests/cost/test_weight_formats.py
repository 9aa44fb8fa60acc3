"""Weights priced in their deployed format: native (as traced, MXFP4 uint8 blocks + scales), overrides,
the tensor-core path of MXFP4 GEMMs, and formats a device cannot run."""

from __future__ import annotations

import math

import pytest

from tessera.cost.features import FeatureExtractor
from tessera.cost.model import CostModel, memory_footprint
from tessera.cost.options import (
    CostOptionError,
    CostOptions,
    UnsupportedWeightsError,
    check_weights_supported,
)
from tessera.cost.roofline import compute_path
from tessera.graph.ir import Access, Buffer, Kernel, KernelGraph
from tessera.hardware.devices import resolve_device

M, N, K = 64, 5760, 2880  # a gpt-oss-20b expert gate-up GEMM, one expert's weight


def _buffer(name, kind, dtype, shape, itemsize):
    return Buffer(name, kind, math.prod(shape) * itemsize, dtype, list(shape))


def mxfp4_gemm_graph() -> KernelGraph:
    """One GEMM whose weight is MXFP4-packed: uint8 blocks [N, K/32, 16] and E8M0 scales [N, K/32], BF16 bias."""
    bufs = [_buffer("mlp.w_blocks", "weight", "uint8", (N, K // 32, 16), 1),
            _buffer("mlp.w_scales", "weight", "uint8", (N, K // 32), 1),
            _buffer("mlp.bias", "weight", "bfloat16", (N,), 2),
            _buffer("x", "input", "bfloat16", (M, K), 2),
            _buffer("y", "output", "bfloat16", (M, N), 2)]
    acc = [Access(0, b.name, "write" if b.kind == "output" else "read", 0, b.shape,
                  [math.prod(b.shape[i + 1:]) for i in range(len(b.shape))], b.nbytes // math.prod(b.shape))
           for b in bufs]
    read = sum(b.nbytes for b in bufs[:-1])
    kernel = Kernel(0, "aten.mm.default", "model.layers.0.mlp", 0, 0, "gemm", [], {}, [],
                    [[M, K], [K, N]], ["bfloat16", "uint8"], 2 * M * N * K, read, bufs[-1].nbytes)
    return KernelGraph("test", "decode", {}, [kernel], {b.name: b for b in bufs}, acc, [], ["x"], [], {})


def test_native_is_the_default_and_stores_weights_as_traced():
    assert CostOptions().weights_dtype == "native"
    g = mxfp4_gemm_graph()
    f = FeatureExtractor(g).features(g.kernels[0])
    blocks, scales, bias = N * K // 2, N * K // 32, 2 * N
    assert f.weight_bytes == blocks + scales + bias  # 4.25 bits per weight, as traced
    assert (blocks + scales) * 8 / (N * K) == 4.25
    assert f.weight_format == "mxfp4"
    assert memory_footprint(g).weight_bytes == blocks + scales + bias
    assert CostOptions().weight_scale("bfloat16") == CostOptions().weight_scale("uint8") == 1.0


@pytest.mark.parametrize("override,bits", [("bf16", 16), ("fp16", 16), ("fp8", 8), ("mxfp4", 4.25)])
def test_overrides_reprice_packed_and_float_weights(override, bits):
    g = mxfp4_gemm_graph()
    opts = CostOptions(weights_dtype=override)
    f = FeatureExtractor(g, opts).features(g.kernels[0])
    # blocks + scales together cost the override's bits per weight; the 1-D bias stays as traced
    assert f.weight_bytes == pytest.approx(N * K * bits / 8 + 2 * N)
    assert opts.weight_scale("uint8") == pytest.approx(bits / 4.25)
    assert opts.weight_scale("bfloat16") == pytest.approx(bits / 16)
    assert opts.weight_scale("float32") == pytest.approx(bits / 32)
    assert memory_footprint(g, opts).weight_bytes == pytest.approx(N * K * bits / 8 + 2 * N)


def test_native_mxfp4_gemms_run_fp4_only_on_blackwell():
    g = mxfp4_gemm_graph()
    f = FeatureExtractor(g).features(g.kernels[0])
    assert compute_path(f, resolve_device("B200"), CostOptions()) == "fp4"
    assert compute_path(f, resolve_device("RTXPRO6000"), CostOptions()) == "fp4"
    for dev in ("A100", "L40S", "H100"):  # Marlin (Ampere/Ada), matmul_ogs (Hopper): dequantised to BF16
        assert compute_path(f, resolve_device(dev), CostOptions()) == "bf16"
    # an explicit bf16 override prices the GEMM as BF16 even on Blackwell
    fb = FeatureExtractor(g, CostOptions(weights_dtype="bf16")).features(g.kernels[0])
    assert compute_path(fb, resolve_device("B200"), CostOptions(weights_dtype="bf16")) == "bf16"


def test_unknown_weights_dtype_is_a_clear_error():
    with pytest.raises(CostOptionError, match=r"--weights-dtype 'int3'.*native, bf16, fp16, fp8, mxfp4"):
        CostOptions(weights_dtype="int3")


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_weight_only_formats_need_sm80(fmt):
    v100 = resolve_device("V100")
    assert v100.compute_capability == (7, 0)
    with pytest.raises(UnsupportedWeightsError, match=rf"{fmt} weights cannot run on V100 .*7\.0.*8\.0"):
        check_weights_supported(CostOptions(weights_dtype=fmt), v100)
    with pytest.raises(UnsupportedWeightsError):  # the estimate / plan paths build a CostModel
        CostModel(v100, CostOptions(weights_dtype=fmt))
    for dev in ("A100", "A10", "L40S", "H100", "B200", "MI300X", "cpu"):
        check_weights_supported(CostOptions(weights_dtype=fmt), resolve_device(dev))
    check_weights_supported(CostOptions(weights_dtype="fp16"), v100)


def test_native_mxfp4_graph_is_refused_on_v100():
    g = mxfp4_gemm_graph()
    check_weights_supported(CostOptions(), resolve_device("V100"))  # no graph: nothing to refuse
    with pytest.raises(UnsupportedWeightsError, match="traced in this format"):
        CostModel(resolve_device("V100")).estimate(g)
    assert CostModel(resolve_device("A100")).estimate(g).step_time_s > 0
    assert CostModel(resolve_device("V100"), CostOptions(weights_dtype="fp16")).estimate(g).step_time_s > 0


def test_cli_rejects_a_format_the_device_cannot_run():
    from typer.testing import CliRunner

    from tessera.cli.main import app

    r = CliRunner().invoke(app, ["estimate", "smollm2-135m", "--device", "V100", "--weights-dtype", "mxfp4"])
    assert r.exit_code != 0
    assert "compute capability" in r.output + (r.stderr if r.stderr_bytes is not None else "")
