"""Cost-model options: the weight and KV-cache storage dtypes a deployment would use, and launch mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.errors import TesseraError

if TYPE_CHECKING:
    from tessera.cost.factors import TimeFactors

# Storage bits per element, block scales included (MXFP4: 4-bit e2m1 values plus one 8-bit E8M0 scale per 32).
WEIGHT_DTYPE_BITS = {"bf16": 16.0, "fp16": 16.0, "fp8": 8.0, "mxfp4": 4.25}
NATIVE = "native"  # every weight stored as traced (the production graph traces weights in their deployed format)
WEIGHTS_DTYPES = (NATIVE, *WEIGHT_DTYPE_BITS)
KV_DTYPE_BITS = {"bf16": 16.0, "fp16": 16.0, "fp8": 8.0}
TRACE_DTYPE_BITS = {"bfloat16": 16, "float16": 16, "float32": 32, "float64": 64, "float8_e4m3fn": 8,
                    "float8_e5m2": 8, "int64": 64, "int32": 32, "int16": 16, "int8": 8, "uint8": 8, "bool": 8}
# A traced uint8 weight buffer is MXFP4-packed: `*_blocks` (two e2m1 values per byte) and `*_scales` (one E8M0
# byte per 32 values), together 4.25 bits per weight.
PACKED_DTYPE = "uint8"
PACKED_BITS = WEIGHT_DTYPE_BITS["mxfp4"]
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


class CostOptionError(TesseraError, ValueError):
    """An unknown weight/KV dtype option."""


class UnsupportedWeightsError(CostOptionError):
    """A weight format the device cannot run (e.g. MXFP4 or FP8 weight-only GEMMs below SM 8.0)."""


def weight_format(traced_dtype: str) -> str:
    """The storage format a traced weight dtype stands for: ``mxfp4`` (uint8, packed), ``fp8``, or the dtype."""
    if traced_dtype == PACKED_DTYPE:
        return "mxfp4"
    if traced_dtype in FP8_DTYPES:
        return "fp8"
    return traced_dtype


@dataclass(frozen=True)
class CostOptions:
    """How the traced step would be deployed: weight and KV storage dtypes, CUDA-graph launches.

    ``weights_dtype="native"`` (the default) prices every weight as traced: the production graph traces
    weights in their deployed format (gpt-oss experts as MXFP4 uint8 blocks + scales, the rest BF16). An
    override (bf16, fp16, fp8, mxfp4) re-prices every matrix weight as stored in that format: float weights
    by override bits / traced bits, MXFP4-packed (uint8) buffers by override bits / 4.25 (blocks and scales
    together then cost the override's bits per weight). The weight format also picks the tensor-core path
    (FP8 weights run FP8 GEMMs where the part has FP8; MXFP4 runs FP4 GEMMs where it has FP4 and is
    dequantised to BF16 in the GEMM elsewhere). KV-cache traffic is rescaled to ``kv_dtype``. With
    ``cuda_graphs`` (what serving engines do) a kernel costs no host launch; without, every kernel pays the
    device's launch latency. The CPU always pays its dispatch latency. ``factors`` (a `--factors` file of
    `tessera validate --fit`) multiplies predicted kernel times per device and cost class.
    """

    weights_dtype: str = NATIVE
    kv_dtype: str = "bf16"
    cuda_graphs: bool = True
    factors: TimeFactors | None = None

    def __post_init__(self) -> None:
        if self.weights_dtype not in WEIGHTS_DTYPES:
            raise CostOptionError(f"--weights-dtype {self.weights_dtype!r} is not supported; use one of "
                                  f"{', '.join(WEIGHTS_DTYPES)}")
        if self.kv_dtype not in KV_DTYPE_BITS:
            raise CostOptionError(f"--kv-dtype {self.kv_dtype!r} is not supported; use one of "
                                  f"{', '.join(KV_DTYPE_BITS)}")

    def weight_scale(self, traced_dtype: str) -> float:
        """Stored bytes of a weight per traced byte (native: 1; uint8 buffers are MXFP4-packed)."""
        if self.weights_dtype == NATIVE:
            return 1.0
        bits = WEIGHT_DTYPE_BITS[self.weights_dtype]
        if traced_dtype == PACKED_DTYPE:
            return bits / PACKED_BITS
        return bits / TRACE_DTYPE_BITS.get(traced_dtype, 16)

    def weight_format(self, traced_dtype: str) -> str:
        """The format a weight traced as ``traced_dtype`` is deployed in (``mxfp4``, ``fp8``, ``bf16``...)."""
        if self.weights_dtype != NATIVE:
            return self.weights_dtype
        return weight_format(traced_dtype)

    def describe_weights(self) -> str:
        """The weight option as printed: ``native (as traced)`` or the override."""
        return "native (as traced)" if self.weights_dtype == NATIVE else self.weights_dtype

    def kv_scale(self, traced_dtype: str) -> float:
        """Stored bytes of a KV-cache entry per traced byte."""
        return KV_DTYPE_BITS[self.kv_dtype] / TRACE_DTYPE_BITS.get(traced_dtype, 16)


# Weight-only quantised GEMMs (dequantised in the GEMM where the part lacks the tensor path) need SM 8.0+:
# vLLM's Marlin kernels (MXFP4 and FP8 weight-only) and triton matmul_ogs target Ampere and later.
MIN_COMPUTE_CAPABILITY = {"mxfp4": (8, 0), "fp8": (8, 0)}


def check_weights_supported(options: CostOptions, device, graph=None) -> None:
    """Raise :class:`UnsupportedWeightsError` when ``device`` cannot run the deployed weight format:
    an explicit ``weights_dtype`` override, or (native) the formats of ``graph``'s weight buffers.

    NVIDIA parts below compute capability 8.0 (V100) have no MXFP4 or FP8 weight-only GEMM (Marlin, vLLM
    need SM80+). AMD parts and this host's CPU are not restricted here (the CPU dequantises in its body)."""
    cc = getattr(device, "compute_capability", None)
    if getattr(device, "vendor", None) != "nvidia" or cc is None:
        return
    if options.weights_dtype != NATIVE:
        formats = {options.weights_dtype}
    elif graph is not None:
        formats = {weight_format(b.dtype) for b in graph.buffers.values() if b.kind == "weight" and len(b.shape) >= 2}
    else:
        return
    for fmt in sorted(formats):
        need = MIN_COMPUTE_CAPABILITY.get(fmt)
        if need is not None and tuple(cc) < need:
            where = "" if options.weights_dtype != NATIVE else " (the graph's weights are traced in this format)"
            raise UnsupportedWeightsError(
                f"{fmt} weights{where} cannot run on {device.id} (compute capability {cc[0]}.{cc[1]}): "
                f"{fmt} weight-only GEMMs (Marlin, vLLM) need compute capability {need[0]}.{need[1]} or "
                f"later; use --weights-dtype fp16 or bf16 on this device")
