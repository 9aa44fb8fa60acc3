"""Time of one kernel on one device from its FLOPs and bytes: a roofline with per-class efficiency,
wave quantisation over SMs (with split-K for GEMMs of less than one wave), L2 residency of activations,
and a clock/launch-latency floor."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.cost.efficiency import ClassEfficiency
from tessera.cost.features import TENSOR_CORE_CLASSES, KernelFeatures
from tessera.cost.options import NATIVE, CostOptions
from tessera.hardware.catalog import DeviceSpec

TILE = 128  # output tile edge of a tensor-core GEMM / attention block: the unit of wave quantisation
L2_BYTES_PER_CLOCK = {"gpu": 64, "host": 32}  # L2 (host: last-level cache) bytes per clock per SM/core
L2_RESIDENT_FRACTION = 0.5  # activations up to this share of L2 are served from it (written just before)
# Shortest slice of K a split-K GEMM hands one CTA: four 64-deep stages of the CUTLASS/cuBLAS main loop.
SPLIT_K_MIN_DEPTH = 256
PARTIAL_ITEMSIZE = 4  # split-K partial sums are FP32

# dtype -> tensor-core path, with fallbacks for parts that lack it (V100 has no BF16: FP16 rate)
_TENSOR_PATHS = {"bfloat16": ("bf16", "fp16", "fp32"), "float16": ("fp16", "bf16", "fp32"),
                 "float32": ("fp32",), "float64": ("fp32",)}


@dataclass(frozen=True)
class KernelCost:
    """Predicted (or measured) time of a kernel on a device and what bounds it."""

    index: int
    cost_class: str
    time_s: float
    compute_s: float
    memory_s: float
    floor_s: float
    bound: str  # "compute" | "memory" | "latency" | "measured"


def compute_path(f: KernelFeatures, device: DeviceSpec, options: CostOptions) -> str:
    """The FLOP path a kernel runs on: a tensor-core dtype for matrix classes, FP32 vector otherwise."""
    if f.cost_class not in TENSOR_CORE_CLASSES:
        return "fp32"
    if f.cost_class in ("gemm", "gemv", "grouped_gemm"):
        # the weights' deployed format: the override, or (native) what the kernel's weight buffers hold
        fmt = options.weights_dtype if options.weights_dtype != NATIVE else f.weight_format
        if fmt == "fp8" and device.peak_flops("fp8"):
            return "fp8"
        if fmt == "mxfp4" and device.peak_flops("fp4"):  # FP4 tensor cores (Blackwell)
            return "fp4"
        # elsewhere dequantised in the GEMM to the activations' dtype (Marlin on Ampere/Ada, matmul_ogs on Hopper)
    for path in _TENSOR_PATHS.get(f.compute_dtype, ("fp32",)):
        if device.peak_flops(path):
            return path
    return "fp32"


def _output_tiles(f: KernelFeatures) -> int:
    batch, m, n, _ = f.gemm
    return batch * math.ceil(m / TILE) * math.ceil(n / TILE)


def split_k(f: KernelFeatures, device: DeviceSpec) -> int:
    """Into how many slices of K a dense GEMM is split: one whose output tiles fill less than one wave of
    the SMs is split until the slices fill the SMs, each slice at least ``SPLIT_K_MIN_DEPTH`` deep; 1 for
    everything else. It stands for what the libraries do with an under-filled GEMM (split-K or smaller
    tiles: the calibration runs' decode GEMMs show ``splitKreduce`` after the A100's router GEMM, 64x64 tiles
    for its QKV and o_proj, 32x32 tiles on the L40S), so that such a GEMM streams its weights."""
    if device.vendor == "host" or f.gemm is None or f.cost_class != "gemm":
        return 1
    tiles = _output_tiles(f)
    if tiles >= device.sm_count:
        return 1
    return max(1, min(device.sm_count // tiles, f.gemm[3] // SPLIT_K_MIN_DEPTH))


def wave_utilisation(f: KernelFeatures, device: DeviceSpec) -> float:
    """Share of the SMs' slots doing useful work once output tiles (times their K slices, see
    :func:`split_k`) are dealt out in whole waves."""
    if device.vendor == "host" or f.gemm is None or f.cost_class not in ("gemm", "grouped_gemm", "conv"):
        return 1.0
    tiles = _output_tiles(f) * split_k(f, device)
    waves = math.ceil(tiles / device.sm_count)
    return tiles / (waves * device.sm_count)


def split_k_bytes(f: KernelFeatures, device: DeviceSpec) -> float:
    """Bytes of a split-K GEMM's FP32 partial sums, written by the slices and read back by the reduction."""
    splits = split_k(f, device)
    if splits == 1:
        return 0.0
    batch, m, n, _ = f.gemm
    return 2.0 * splits * batch * m * n * PARTIAL_ITEMSIZE


def l2_bandwidth(device: DeviceSpec) -> float:
    """Aggregate L2 (host: last-level cache) bandwidth implied by SM count and clock."""
    per_clock = L2_BYTES_PER_CLOCK["host" if device.vendor == "host" else "gpu"]
    return per_clock * device.sm_count * device.boost_clock_hz


def ideal_times(f: KernelFeatures, device: DeviceSpec, options: CostOptions = CostOptions()) -> tuple[float, float]:
    """(compute, memory) seconds of a kernel at full efficiency: FLOPs at its path's peak over the SMs'
    useful share; weight and KV bytes at DRAM bandwidth, activations (with split-K partial sums) at L2
    bandwidth when they fit."""
    peak = device.peak_flops(compute_path(f, device, options)) or device.peak_flops("fp32")
    compute = f.flops / peak / wave_utilisation(f, device) if f.flops > 0 else 0.0
    dram = f.weight_bytes + f.kv_bytes
    other = f.other_bytes + split_k_bytes(f, device)
    if other <= L2_RESIDENT_FRACTION * device.l2_bytes:
        return compute, dram / device.memory_bandwidth + other / l2_bandwidth(device)
    return compute, (dram + other) / device.memory_bandwidth


def kernel_time(f: KernelFeatures, device: DeviceSpec, eff: ClassEfficiency,
                options: CostOptions = CostOptions()) -> KernelCost:
    """Predicted time of one kernel: (overhead + floor + max(compute, memory)) x the class's time factor.

    The floor (a class's fixed cycles: ramp-up, one wave, tail) is paid by every kernel, so the shortest
    kernels run at the clock's pace; host overhead is the launch (CPU: dispatch) cost. The time factor
    (``eff.scale``, 1 unless a `--factors` file gives one) scales every part alike."""
    compute, memory = ideal_times(f, device, options)
    compute_s, memory_s = compute / eff.compute, memory / eff.memory
    floor_s = eff.floor_cycles / device.boost_clock_hz
    if eff.overhead_s is not None:
        overhead = eff.overhead_s
    elif device.vendor == "host" or not options.cuda_graphs:
        overhead = device.launch_latency_s
    else:
        overhead = 0.0
    work = max(compute_s, memory_s)
    fixed = overhead + floor_s
    bound = "latency" if fixed >= work else "compute" if compute_s >= memory_s else "memory"
    k = eff.scale
    return KernelCost(f.index, f.cost_class, k * (fixed + work), k * compute_s, k * memory_s, k * fixed, bound)
