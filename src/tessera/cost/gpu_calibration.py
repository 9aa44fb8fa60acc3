"""Fit GPU efficiency factors on the measured A100-PCIE / L40S kernel times and report held-out error.

The measurements (``data/calibration``) name each kernel, its phase and block, and its time on both
parts, but record no tensor shapes. So the fit works on the *relation* between the two parts: each
kernel is described by one unknown size ``s`` along its class's roofline (bytes for memory-like
classes, FLOPs for compute-bound prefill GEMMs and attention, with a fixed arithmetic intensity per
class and phase). ``s`` is recovered from the A100-PCIE time (the reference, at the prior
efficiencies), and the L40S time is predicted from it. Fitted per class: the floor in clock cycles
(absolute: it sets the shortest kernels on both parts) and the L40S compute and memory efficiencies
(relative to the A100-PCIE priors, which are all that shape-less data can identify). A100-PCIE's
absolute memory efficiency is checked against the one kernel whose bytes are known (the 201,088 x
2,880 BF16 LM head, 1.158 GB), see :func:`lm_head_anchor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tessera.cost.efficiency import ClassEfficiency, DeviceEfficiency, prior_efficiency
from tessera.cost.roofline import L2_RESIDENT_FRACTION, l2_bandwidth
from tessera.hardware.catalog import DeviceSpec
from tessera.hardware.devices import resolve_device

DATA = Path(__file__).parent / "data" / "calibration"
PAIRS_FILE = DATA / "gptoss20b_a100_l40s_kernel_pairs.tsv"
POINTS_FILE = DATA / "gptoss20b_a100_l40s_kernel_points.tsv"
REFERENCE, TARGET = "A100-PCIE", "L40S"
# Between these two parts no mechanism gives more than ~2.4x (DRAM bandwidth) or less than ~0.2x (FP32 vector
# rate): a position whose times differ by more than this factor ran different work on each side.
MISMATCH_RATIO = 4.0
LM_HEAD_BYTES = 201088 * 2880 * 2

# Name fragments -> cost class, first match wins (vLLM, cuBLAS/CUTLASS, ATen and Inductor kernel names).
_NAME_CLASSES = (
    ("marlin_moe", "grouped_gemm"), ("unified_attention", "attention"), ("reduce_segments", "attention"),
    ("gemvx", "gemv"), ("gemm", "gemm"), ("dot+reduce", "gemm"), ("splitkreduce", "gemm"),
    ("softmax", "reduction"), ("reduce_kernel", "reduction"), ("rsqrt", "reduction"), ("topkgating", "reduction"),
    ("moe_sum", "reduction"), ("moe_align", "scan"), ("count_and_sort", "scan"),
    ("gather", "embedding"), ("index_elementwise", "embedding"),
    ("reshape_and_cache", "copy"), ("direct_copy", "copy"), ("fillfunctor", "copy"), ("constant_pad", "copy"),
)

# Arithmetic intensity (FLOPs per byte) assumed for each (class, regime): the shape-less data fixes
# only one size per kernel. Compute-bound prefill work uses high intensities, streaming work low ones.
_INTENSITY = {"gemm": 1000.0, "gemv": 32.0, "grouped_gemm:prefill": 500.0, "grouped_gemm:decode": 16.0,
              "attention:prefill": 500.0, "attention:decode": 8.0, "reduction": 2.0, "scan": 1.0,
              "embedding": 0.0, "copy": 0.0, "elementwise": 1.0}
_TENSOR = ("gemm", "gemv", "grouped_gemm", "attention")


@dataclass(frozen=True)
class MeasuredKernel:
    """One measured kernel position: its class, phase, block and time on each part."""

    phase: str
    block: str
    name: str
    cost_class: str
    launches: int
    reference_s: float
    target_s: float

    @property
    def regime(self) -> str:
        """The class as the size model sees it (decode GEMMs and the LM head stream their weights)."""
        if self.cost_class == "gemm" and (self.phase == "decode" or self.block == "other"):
            return "gemv"
        if self.cost_class in ("grouped_gemm", "attention"):
            return f"{self.cost_class}:{self.phase}"
        return self.cost_class


def classify_kernel_name(name: str) -> str:
    """The cost class of a measured GPU kernel from its (demangled) name."""
    low = name.lower()
    return next((cls for frag, cls in _NAME_CLASSES if frag in low), "elementwise")


def _read_tsv(path: Path) -> list[dict[str, str]]:
    lines = [line.split("\t") for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return [dict(zip(lines[0], line, strict=False)) for line in lines[1:]]


def _usable(k: MeasuredKernel) -> bool:
    return 1 / MISMATCH_RATIO <= k.target_s / k.reference_s <= MISMATCH_RATIO


def load_pairs(path: Path = PAIRS_FILE) -> tuple[list[MeasuredKernel], list[MeasuredKernel]]:
    """(usable, mismatched) kernel positions of the pairs file; mismatched ones ran different work."""
    kernels = []
    for r in _read_tsv(path):
        a100 = float(r["a100_us_median"]) * 1e-6
        kernels.append(MeasuredKernel(r["phase"], r["category"], r["name_a100"], classify_kernel_name(r["name_a100"]),
                                      int(r["launches"]), a100, a100 * float(r["ratio_median"])))
    return [k for k in kernels if _usable(k)], [k for k in kernels if not _usable(k)]


def load_points(path: Path = POINTS_FILE) -> tuple[list[MeasuredKernel], list[MeasuredKernel]]:
    """(usable, mismatched) kernels of the points file (absolute times on both parts)."""
    kernels = [MeasuredKernel(r["phase"], r["category"], r["kernel"], classify_kernel_name(r["kernel"]), 1,
                              float(r["a100_us"]) * 1e-6, float(r["l40s_us"]) * 1e-6) for r in _read_tsv(path)]
    return [k for k in kernels if _usable(k)], [k for k in kernels if not _usable(k)]


def split(kernels: list[MeasuredKernel], every: int = 3, fold: int | None = None
          ) -> tuple[list[MeasuredKernel], list[MeasuredKernel]]:
    """Deterministic (fit, held-out) split: within each class by reference time, every ``every``-th kernel
    (from position ``fold``, default the last of each group of ``every``) is held out."""
    fold = every - 1 if fold is None else fold
    fit, held = [], []
    by_class: dict[str, list[MeasuredKernel]] = {}
    for k in kernels:
        by_class.setdefault(k.cost_class, []).append(k)
    for rows in by_class.values():
        for i, k in enumerate(sorted(rows, key=lambda k: (k.reference_s, k.name, k.phase))):
            (held if i % every == fold else fit).append(k)
    return fit, held


def _times(regime: str, size: np.ndarray, device: DeviceSpec, compute: np.ndarray | float,
           memory: np.ndarray | float, floor_cycles: np.ndarray | float) -> np.ndarray:
    """Kernel time along a regime's roofline for sizes ``size`` (bytes)."""
    cls = regime.split(":")[0]
    ai = _INTENSITY.get(regime, _INTENSITY.get(cls, 1.0))
    path = "bf16" if cls in _TENSOR else "fp32"
    flops = size * ai
    streamed = cls in ("gemv", "grouped_gemm") or regime == "attention:decode"  # weights / KV: from DRAM
    resident = np.logical_and(not streamed, size <= L2_RESIDENT_FRACTION * device.l2_bytes)
    bandwidth = np.where(resident, l2_bandwidth(device), device.memory_bandwidth)
    memory_s = size / (bandwidth * memory)
    compute_s = flops / (device.peak_flops(path) * compute)
    return np.maximum(memory_s, compute_s) + floor_cycles / device.boost_clock_hz


def infer_size(k: MeasuredKernel, device: DeviceSpec, eff: ClassEfficiency, floor_cycles: float) -> float:
    """The size (bytes) at which the reference roofline takes the measured reference time (0: floor-bound)."""
    lo, hi = 0.0, 1e13
    f = lambda s: float(_times(k.regime, np.array([s]), device, eff.compute, eff.memory, floor_cycles)[0])  # noqa: E731
    if f(lo) >= k.reference_s:
        return 0.0
    for _ in range(200):
        mid = math.sqrt(max(lo, 1.0) * hi)
        lo, hi = (mid, hi) if f(mid) < k.reference_s else (lo, mid)
        if hi / max(lo, 1.0) < 1.0001:
            break
    return hi


@dataclass(frozen=True)
class ClassFit:
    """Fitted factors of one class and how well they do."""

    cost_class: str
    floor_cycles: float
    target_compute: float
    target_memory: float
    fit_kernels: int
    fit_error: float  # median |predicted/measured - 1| of the target time on the fitted kernels


_MULTIPLIERS = np.geomspace(0.25, 4.0, 41)
_FLOOR_GRID = np.geomspace(300, 8000, 49)
_PRIOR_WEIGHT = 0.02  # keeps classes with few kernels near the priors


def _predict(rows: list[MeasuredKernel], ref: DeviceSpec, tgt: DeviceSpec, ref_eff: ClassEfficiency,
             floor_cycles: float, compute: np.ndarray | float, memory: np.ndarray | float) -> np.ndarray:
    """Predicted target times [rows, ...grid] for kernels measured on the reference."""
    out = []
    for k in rows:
        s = infer_size(k, ref, ref_eff, ref_eff.floor_cycles)
        out.append(_times(k.regime, np.full(np.shape(compute), s), tgt, compute, memory, floor_cycles))
    return np.array(out).reshape(len(rows), *np.shape(compute)) if np.ndim(compute) else np.array(out)


def fit_class(rows: list[MeasuredKernel], ref: DeviceSpec, tgt: DeviceSpec, ref_eff: ClassEfficiency,
              tgt_prior: ClassEfficiency) -> ClassFit:
    """Grid-search the floor cycles and one target-efficiency multiplier (on both the compute and memory
    priors) minimising squared log error; two parameters per class keep small classes from overfitting."""
    measured = np.array([k.target_s for k in rows])[:, None]
    mult = _MULTIPLIERS[None, :]
    best = None
    for cycles in _FLOOR_GRID:
        ec = np.minimum(tgt_prior.compute * mult, 1.0)
        em = np.minimum(tgt_prior.memory * mult, 1.0)
        pred = _predict(rows, ref, tgt, replace(ref_eff, floor_cycles=cycles), cycles, ec, em)[:, 0, :]
        loss = (np.log(pred / measured) ** 2).mean(axis=0)
        loss = loss + _PRIOR_WEIGHT * (np.log(_MULTIPLIERS) ** 2 + np.log(cycles / tgt_prior.floor_cycles) ** 2)
        j = int(np.argmin(loss))
        if best is None or loss[j] < best[0]:
            best = (loss[j], cycles, _MULTIPLIERS[j])
    _, cycles, m = best
    c, mem = min(tgt_prior.compute * m, 1.0), min(tgt_prior.memory * m, 1.0)
    pred = _predict(rows, ref, tgt, replace(ref_eff, floor_cycles=cycles), cycles, c, mem)
    err = float(np.median(np.abs(pred.ravel() / np.array([k.target_s for k in rows]) - 1)))
    return ClassFit(rows[0].cost_class, float(cycles), float(c), float(mem), len(rows), err)


def predict_target(k: MeasuredKernel, ref: DeviceSpec, tgt: DeviceSpec, ref_eff: ClassEfficiency,
                   tgt_eff: ClassEfficiency) -> float:
    """Predicted target time of a kernel from its reference time, with the target's factors."""
    s = infer_size(k, ref, ref_eff, ref_eff.floor_cycles)
    return float(_times(k.regime, np.array([s]), tgt, tgt_eff.compute, tgt_eff.memory, tgt_eff.floor_cycles)[0])


def lm_head_anchor(kernels: list[MeasuredKernel], ref: DeviceSpec) -> float | None:
    """The reference's achieved fraction of DRAM bandwidth on the LM head (bytes known), if measured."""
    heads = [k for k in kernels if k.block == "other" and k.cost_class == "gemm" and k.phase == "decode"]
    if not heads:
        return None
    t = max(heads, key=lambda k: k.reference_s).reference_s
    return LM_HEAD_BYTES / t / ref.memory_bandwidth


@dataclass(frozen=True)
class GpuCalibration:
    """Fitted factors for both parts, and the errors on fitted and held-out kernels."""

    reference: DeviceEfficiency
    target: DeviceEfficiency
    fits: dict[str, ClassFit]
    held_out: list[tuple[MeasuredKernel, float, float]]  # (kernel, calibrated prediction, prior prediction)
    excluded: int
    anchor: float | None


def _cross_validate(rows: list[MeasuredKernel], ref: DeviceSpec, tgt: DeviceSpec, ref_eff: ClassEfficiency,
                    tgt_prior: ClassEfficiency) -> tuple[ClassFit, float, float]:
    """(fit on all rows, leave-one-out median error of fitting, median error of the priors) for one class."""
    loo, prior = [], []
    for i, k in enumerate(rows):
        f = fit_class(rows[:i] + rows[i + 1:], ref, tgt, ref_eff, tgt_prior)
        pred = predict_target(k, ref, tgt, replace(ref_eff, floor_cycles=f.floor_cycles),
                              ClassEfficiency(f.target_compute, f.target_memory, f.floor_cycles))
        loo.append(abs(pred / k.target_s - 1))
        prior.append(abs(predict_target(k, ref, tgt, ref_eff, tgt_prior) / k.target_s - 1))
    return fit_class(rows, ref, tgt, ref_eff, tgt_prior), float(np.median(loo)), float(np.median(prior))


def calibrate_gpus(kernels: list[MeasuredKernel] | None = None, excluded: int | None = None,
                   progress=None, fold: int | None = None) -> GpuCalibration:
    """Fit on two thirds of the measured positions (a class's fit is kept only if its leave-one-out error
    beats the priors'), and predict the held-out third (``fold`` of :func:`split`) with both."""
    if kernels is None:
        kernels, bad = load_pairs()
        excluded = len(bad)
    ref, tgt = resolve_device(REFERENCE), resolve_device(TARGET)
    ref_prior, tgt_prior = prior_efficiency(ref), prior_efficiency(tgt)
    fit_rows, held = split(kernels, fold=fold)
    fits: dict[str, ClassFit] = {}
    for cls in sorted({k.cost_class for k in fit_rows}):
        rows = [k for k in fit_rows if k.cost_class == cls]
        if len(rows) < 3:
            continue
        fit, loo, prior = _cross_validate(rows, ref, tgt, ref_prior.classes[cls], tgt_prior.classes[cls])
        if progress:
            progress(cls, loo, prior)
        if loo < prior:  # keep fitted factors only where they beat the priors on kernels they did not see
            fits[cls] = fit
    ref_classes = dict(ref_prior.classes)
    tgt_classes = dict(tgt_prior.classes)
    for cls, f in fits.items():
        ref_classes[cls] = replace(ref_classes[cls], floor_cycles=f.floor_cycles)
        tgt_classes[cls] = ClassEfficiency(f.target_compute, f.target_memory, f.floor_cycles)
    source = (f"fitted on {len(fit_rows)} of {len(kernels)} measured GPT-oss-20B kernel positions "
              f"(A100-80G PCIe vs L40S, vLLM 0.18, FluidGPU artifact cdccfb2); "
              "floor cycles per class; L40S efficiencies relative to the A100-PCIE priors")
    ref_fit = DeviceEfficiency(ref.id, ref_classes, source, tuple(fits))
    tgt_fit = DeviceEfficiency(tgt.id, tgt_classes, source, tuple(fits))
    held_pred = []
    for k in held:
        cal = predict_target(k, ref, tgt, ref_classes[k.cost_class], tgt_classes[k.cost_class])
        prior = predict_target(k, ref, tgt, ref_prior.classes[k.cost_class], tgt_prior.classes[k.cost_class])
        held_pred.append((k, cal, prior))
    return GpuCalibration(ref_fit, tgt_fit, fits, held_pred, excluded or 0, lm_head_anchor(kernels, ref))


def cross_validated(kernels: list[MeasuredKernel], folds: int = 3) -> list[tuple[MeasuredKernel, float, float]]:
    """Every kernel predicted by factors fitted without it: the held-out thirds of ``folds`` splits."""
    out = []
    for fold in range(folds):
        out += calibrate_gpus(kernels, fold=fold).held_out
    return out


def error_table(rows: list[tuple[MeasuredKernel, float, float]]) -> dict[str, dict[str, float]]:
    """Median absolute relative error of calibrated and prior predictions, per class and overall."""
    out: dict[str, dict[str, float]] = {}
    groups: dict[str, list[tuple[MeasuredKernel, float, float]]] = {}
    for r in rows:
        groups.setdefault(r[0].cost_class, []).append(r)
    groups["overall"] = rows
    for cls, rs in groups.items():
        cal = [abs(p / k.target_s - 1) for k, p, _ in rs]
        pri = [abs(p / k.target_s - 1) for k, _, p in rs]
        side = [((p > k.reference_s) == (k.target_s > k.reference_s)) for k, p, _ in rs]
        out[cls] = {"kernels": len(rs), "calibrated": float(np.median(cal)), "prior": float(np.median(pri)),
                    "faster_side_agreement": sum(side) / len(side)}
    return out


def factors_document(cal: GpuCalibration, cv: list[tuple[MeasuredKernel, float, float]] | None = None) -> dict:
    """The JSON kept as data (cost/data/gpu_factors.json): fitted factors with provenance and errors."""
    doc = {
        "provenance": {
            "data": "src/tessera/cost/data/calibration/gptoss20b_a100_l40s_kernel_pairs.tsv (FluidGPU artifact "
                    "cdccfb2, MIT; GPT-oss-20B on vLLM 0.18, A100-80G PCIe and L40S, Nsight Systems)",
            "method": __doc__.strip().splitlines()[0] + " See tessera.cost.gpu_calibration.",
            "excluded_mismatched_positions": cal.excluded,
            "fit_kernels": sum(f.fit_kernels for f in cal.fits.values()),
            "held_out_error": error_table(cal.held_out),
            "lm_head_a100_pcie_memory_efficiency": cal.anchor,
            "command": "python benchmarks/bench_gpu_calibration.py --write",
        },
        "devices": {cal.reference.device: cal.reference.to_dict(), cal.target.device: cal.target.to_dict()},
    }
    if cv is not None:
        doc["provenance"]["cross_validated_error"] = error_table(cv)
    return doc
