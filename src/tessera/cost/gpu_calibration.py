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
from dataclasses import dataclass, field, replace
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

# Measured vLLM / library kernel -> the Tessera fused op it stands for (its identity), first match wins.
# Fragments are matched on both parts' names (lower case) and the position's block; ``{phase}`` rules pick
# by phase. Kernels with no Tessera counterpart (fills, pads, casts) keep no identity and use class factors.
_NAME_IDENTITIES = (
    (("marlin_moe",), None, "moe_mxfp4_gemm"),  # MXFP4 weight-only expert GEMM (Marlin wna16)
    (("moe_wna16",), None, "moe_mxfp4_gemm"),
    (("unified_attention", "reduce_segments"), None, "{phase}_attention"),  # 2d / 3d + segment reduction
    (("reshape_and_cache",), None, "kv_write"),
    (("fused_add_rms_norm",), None, "add_rms_norm"),
    (("embedding_mean_mul_pow_rsqrt",), None, "rms_norm"),  # Inductor: embedding + first input norm
    (("add_addmm_mean_mul_pow_rsqrt", "add_mean_mul_pow_rsqrt"), None, "add_rms_norm"),  # residual add + norm
    (("rms_norm",), None, "rms_norm"),
    (("topkgating",), None, "topk_gating"),
    (("moe_align", "count_and_sort_expert"), None, "moe_align"),
    (("moe_sum",), None, "moe_sum"),
    (("swigluoai_and_mul",), None, "swigluoai_and_mul"),
    (("silu_and_mul", "act_and_mul"), None, "silu_and_mul"),
    (("rotary_embedding", "index_select_mul_split"), None, "rotary_"),  # Inductor: cos/sin gather, rotate
    (("gemm", "gemvx", "dot+reduce", "splitkreduce"), "other", "lm_head"),  # the LM head (block other)
    (("gemm", "gemvx", "dot+reduce", "splitkreduce"), None, "merged_linear"),  # QKV, o_proj, router, ...
    (("softmax", "distribution_elementwise", "binaryfunctor", "reduce_kernel"), "other", "sample"),  # sampler
)

# Arithmetic intensity (FLOPs per byte) assumed for each (class, regime): the shape-less data fixes
# only one size per kernel. Compute-bound prefill work uses high intensities, streaming work low ones.
_INTENSITY = {"gemm": 1000.0, "gemv": 32.0, "grouped_gemm:prefill": 500.0, "grouped_gemm:decode": 16.0,
              "attention:prefill": 500.0, "attention:decode": 8.0, "reduction": 2.0, "scan": 1.0,
              "embedding": 0.0, "copy": 0.0, "elementwise": 1.0}
_TENSOR = ("gemm", "gemv", "grouped_gemm", "attention")


@dataclass(frozen=True)
class MeasuredKernel:
    """One measured kernel position: its class, phase, block, time on each part and Tessera identity."""

    phase: str
    block: str
    name: str
    cost_class: str
    launches: int
    reference_s: float
    target_s: float
    identity: str | None = None  # the Tessera fused op it stands for (see kernel_identity)

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


def kernel_identity(names: str | tuple[str, ...], phase: str, block: str) -> str | None:
    """The Tessera fused op (``merged_linear``, ``add_rms_norm``, ``kv_write``...) a measured kernel stands
    for, from its names on either part, its phase and its block; None when Tessera has no counterpart."""
    low = " ".join([names] if isinstance(names, str) else names).lower()
    for frags, only_block, identity in _NAME_IDENTITIES:
        if (only_block is None or only_block == block) and any(f in low for f in frags):
            return identity.format(phase=phase)
    return None


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
        ident = kernel_identity((r["name_a100"], r["name_l40s"]), r["phase"], r["category"])
        kernels.append(MeasuredKernel(r["phase"], r["category"], r["name_a100"], classify_kernel_name(r["name_a100"]),
                                      int(r["launches"]), a100, a100 * float(r["ratio_median"]), ident))
    return [k for k in kernels if _usable(k)], [k for k in kernels if not _usable(k)]


def load_points(path: Path = POINTS_FILE) -> tuple[list[MeasuredKernel], list[MeasuredKernel]]:
    """(usable, mismatched) kernels of the points file (absolute times on both parts)."""
    kernels = [MeasuredKernel(r["phase"], r["category"], r["kernel"], classify_kernel_name(r["kernel"]), 1,
                              float(r["a100_us"]) * 1e-6, float(r["l40s_us"]) * 1e-6,
                              kernel_identity(r["kernel"], r["phase"], r["category"])) for r in _read_tsv(path)]
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


IDENTITY_MARGIN = 0.75  # an identity's leave-one-out error must beat its class factors' by this factor
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
    op_fits: dict[str, ClassFit] = field(default_factory=dict)  # per Tessera identity, where kept
    op_classes: dict[str, str] = field(default_factory=dict)  # identity -> the class its fit started from


def _majority_class(rows: list[MeasuredKernel]) -> str:
    counts: dict[str, int] = {}
    for k in rows:
        counts[k.cost_class] = counts.get(k.cost_class, 0) + 1
    return max(sorted(counts), key=lambda c: counts[c])


def _cross_validate_identity(rows: list[MeasuredKernel], ref: DeviceSpec, tgt: DeviceSpec,
                             ref_classes: dict[str, ClassEfficiency], tgt_classes: dict[str, ClassEfficiency],
                             cls: str) -> tuple[ClassFit, float, float]:
    """(fit on all rows of one identity, its leave-one-out median error, median error of the class-level
    factors on the same rows) - the class factors were fitted on these rows, so the comparison favours them."""
    loo, base = [], []
    for i, k in enumerate(rows):
        f = fit_class(rows[:i] + rows[i + 1:], ref, tgt, ref_classes[cls], tgt_classes[cls])
        pred = predict_target(k, ref, tgt, replace(ref_classes[k.cost_class], floor_cycles=f.floor_cycles),
                              ClassEfficiency(f.target_compute, f.target_memory, f.floor_cycles))
        loo.append(abs(pred / k.target_s - 1))
        base.append(abs(predict_target(k, ref, tgt, ref_classes[k.cost_class], tgt_classes[k.cost_class])
                        / k.target_s - 1))
    return fit_class(rows, ref, tgt, ref_classes[cls], tgt_classes[cls]), float(np.median(loo)), float(np.median(base))


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
                   progress=None, fold: int | None = None, by_identity: bool = True) -> GpuCalibration:
    """Fit on two thirds of the measured positions (a class's fit is kept only if its leave-one-out error
    beats the priors'), then (``by_identity``) per Tessera identity with at least 3 fit positions (kept
    only if its leave-one-out error beats the class factors'), and predict the held-out third (``fold``
    of :func:`split`) with both: identity factors where kept, else class factors."""
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
    op_fits: dict[str, ClassFit] = {}
    op_classes: dict[str, str] = {}
    ref_ops: dict[str, ClassEfficiency] = {}
    tgt_ops: dict[str, ClassEfficiency] = {}
    for ident in sorted({k.identity for k in fit_rows if k.identity} if by_identity else ()):
        rows = [k for k in fit_rows if k.identity == ident]
        if len(rows) < 3 or len({k.cost_class for k in rows}) > 1:  # too few, or a mix of kernel kinds
            continue
        cls = _majority_class(rows)
        fit, loo, base = _cross_validate_identity(rows, ref, tgt, ref_classes, tgt_classes, cls)
        if progress:
            progress(f"{ident} ({cls})", loo, base)
        if loo < IDENTITY_MARGIN * base:  # a clear gain only: groups of 3-9 positions select noisily
            op_fits[ident], op_classes[ident] = fit, cls
            ref_ops[ident] = replace(ref_classes[cls], floor_cycles=fit.floor_cycles)
            tgt_ops[ident] = ClassEfficiency(fit.target_compute, fit.target_memory, fit.floor_cycles)
    source = (f"fitted on {len(fit_rows)} of {len(kernels)} measured GPT-oss-20B kernel positions "
              f"(A100-80G PCIe vs L40S, vLLM 0.18, FluidGPU artifact cdccfb2); "
              "floor cycles per class and per Tessera fused-op identity where the data supports it; "
              "L40S efficiencies relative to the A100-PCIE priors")
    ref_fit = DeviceEfficiency(ref.id, ref_classes, source, tuple(fits), ref_ops)
    tgt_fit = DeviceEfficiency(tgt.id, tgt_classes, source, tuple(fits), tgt_ops)
    held_pred = []
    for k in held:
        r_eff = ref_ops.get(k.identity) or ref_classes[k.cost_class]
        t_eff = tgt_ops.get(k.identity) or tgt_classes[k.cost_class]
        if k.identity in ref_ops:  # identity floors sit on the kernel's own class roofline
            r_eff = replace(ref_classes[k.cost_class], floor_cycles=r_eff.floor_cycles)
        cal = predict_target(k, ref, tgt, r_eff, t_eff)
        prior = predict_target(k, ref, tgt, ref_prior.classes[k.cost_class], tgt_prior.classes[k.cost_class])
        held_pred.append((k, cal, prior))
    return GpuCalibration(ref_fit, tgt_fit, fits, held_pred, excluded or 0, lm_head_anchor(kernels, ref),
                          op_fits, op_classes)


def cross_validated(kernels: list[MeasuredKernel], folds: int = 3, by_identity: bool = True
                    ) -> list[tuple[MeasuredKernel, float, float]]:
    """Every kernel predicted by factors fitted without it: the held-out thirds of ``folds`` splits."""
    out = []
    for fold in range(folds):
        out += calibrate_gpus(kernels, fold=fold, by_identity=by_identity).held_out
    return out


def identity_error_table(rows: list[tuple[MeasuredKernel, float, float]]) -> dict[str, dict[str, float]]:
    """:func:`error_table` grouped by Tessera identity (``-`` for kernels without one)."""
    relabelled = [(replace(k, cost_class=k.identity or "-"), c, p) for k, c, p in rows]
    return error_table(relabelled)


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
            "held_out_error_by_identity": identity_error_table(cal.held_out),
            "identity_fits": {i: {"from_class": cal.op_classes[i], "fit_kernels": f.fit_kernels,
                                  "floor_cycles": f.floor_cycles, "target_compute": f.target_compute,
                                  "target_memory": f.target_memory, "fit_error": f.fit_error}
                              for i, f in cal.op_fits.items()},
            "lm_head_a100_pcie_memory_efficiency": cal.anchor,
            "command": "python benchmarks/bench_gpu_calibration.py --write",
        },
        "devices": {cal.reference.device: cal.reference.to_dict(), cal.target.device: cal.target.to_dict()},
    }
    if cv is not None:
        doc["provenance"]["cross_validated_error"] = error_table(cv)
    return doc
