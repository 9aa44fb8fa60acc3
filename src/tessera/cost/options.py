"""Cost-model options: the weight and KV-cache storage dtypes a deployment would use, and launch mode."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import TesseraError

# Storage bits per element, block scales included (MXFP4: 4-bit values plus one 8-bit scale per 32).
WEIGHT_DTYPE_BITS = {"bf16": 16.0, "fp16": 16.0, "fp8": 8.0, "mxfp4": 4.25}
KV_DTYPE_BITS = {"bf16": 16.0, "fp16": 16.0, "fp8": 8.0}
TRACE_DTYPE_BITS = {"bfloat16": 16, "float16": 16, "float32": 32, "float64": 64, "float8_e4m3fn": 8,
                    "float8_e5m2": 8, "int64": 64, "int32": 32, "int16": 16, "int8": 8, "uint8": 8, "bool": 8}


class CostOptionError(TesseraError, ValueError):
    """An unknown weight/KV dtype option."""


@dataclass(frozen=True)
class CostOptions:
    """How the traced step would be deployed: weight and KV storage dtypes, CUDA-graph launches.

    The trace is in the model's compute dtype (bf16); these options rescale the bytes of weight and
    KV-cache traffic and pick the tensor-core path (FP8 weights run FP8 GEMMs where the part has FP8;
    MXFP4 runs FP4 GEMMs where it has FP4 and dequantises to BF16 elsewhere). With ``cuda_graphs``
    (what serving engines do) a kernel costs no host launch; without, every kernel pays the device's
    launch latency. The CPU always pays its dispatch latency.
    """

    weights_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.weights_dtype not in WEIGHT_DTYPE_BITS:
            raise CostOptionError(f"--weights-dtype {self.weights_dtype!r} is not supported; use one of "
                                  f"{', '.join(WEIGHT_DTYPE_BITS)}")
        if self.kv_dtype not in KV_DTYPE_BITS:
            raise CostOptionError(f"--kv-dtype {self.kv_dtype!r} is not supported; use one of "
                                  f"{', '.join(KV_DTYPE_BITS)}")

    def weight_scale(self, traced_dtype: str) -> float:
        """Stored bytes of a weight per traced byte."""
        return WEIGHT_DTYPE_BITS[self.weights_dtype] / TRACE_DTYPE_BITS.get(traced_dtype, 16)

    def kv_scale(self, traced_dtype: str) -> float:
        """Stored bytes of a KV-cache entry per traced byte."""
        return KV_DTYPE_BITS[self.kv_dtype] / TRACE_DTYPE_BITS.get(traced_dtype, 16)
