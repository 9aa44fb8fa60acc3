"""Fit this host's per-class CPU factors (dispatch overhead, compute and memory efficiency) on
measured profiles, and measure the error of the fitted model on other kernels."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.cost.efficiency import ClassEfficiency, DeviceEfficiency, prior_efficiency
from tessera.cost.features import FeatureExtractor, KernelFeatures
from tessera.cost.options import CostOptions
from tessera.cost.profile import Profile
from tessera.cost.roofline import ideal_times
from tessera.errors import TesseraError
from tessera.graph.ir import KernelGraph
from tessera.hardware.catalog import DeviceSpec

_EFF = np.geomspace(0.002, 16.0, 64)
_OVERHEAD = np.geomspace(5e-7, 2e-3, 61)


class CalibrationError(TesseraError):
    """Profiles that cannot be fitted (no kernels, graph mismatch)."""


@dataclass(frozen=True)
class Sample:
    """One profiled kernel: its features and its measured median time."""

    features: KernelFeatures
    measured_s: float
    source: str  # "model phase shape"
    signature: str = ""  # kernel_signature: equal for identical kernels (e.g. the same op in every layer)


def samples(graph: KernelGraph, profile: Profile) -> list[Sample]:
    """Pair a profile's timings with the features of the same kernels in ``graph`` (matched by signature,
    so a profile measured on a CPU trace pairs with a `meta` trace of the same step)."""
    from tessera.cost.profile import kernel_signature

    ex = FeatureExtractor(graph, CostOptions())
    by_sig = {kernel_signature(k): k for k in graph.kernels}
    label = f"{profile.model} {profile.phase} {profile.shape}"
    missing = [t.id for t in profile.kernels if t.signature not in by_sig]
    if missing:
        raise CalibrationError(f"{len(missing)} profiled kernels of {profile.model} {profile.phase} are not in the "
                               f"traced graph (e.g. {missing[0]}): profile and graph must be the same step")
    return [Sample(ex.features(by_sig[t.signature]), t.median_s, label, t.signature) for t in profile.kernels]


def _unit_times(rows: list[Sample], device: DeviceSpec) -> tuple[np.ndarray, np.ndarray]:
    """(compute seconds at full efficiency, memory seconds at full efficiency) per sample."""
    times = np.array([ideal_times(s.features, device) for s in rows]).reshape(len(rows), 2)
    return times[:, 0], times[:, 1]


def fit_class(rows: list[Sample], device: DeviceSpec) -> ClassEfficiency:
    """Grid-search overhead and efficiencies minimising the squared log error of one class's kernels.

    Efficiencies may exceed 1: the host's peaks are measured on one reference kernel (an fp32/bf16
    square matmul, a large copy), which other kernels can beat (e.g. cache-resident data)."""
    cu, mu = _unit_times(rows, device)
    log_measured = np.log(np.array([s.measured_s for s in rows]))[:, None, None]
    work = np.maximum(cu[:, None, None] / _EFF[None, :, None], mu[:, None, None] / _EFF[None, None, :])
    best = None
    for ov in _OVERHEAD:
        loss = ((np.log(ov + work) - log_measured) ** 2).sum(axis=0)
        i, j = np.unravel_index(np.argmin(loss), loss.shape)
        if best is None or loss[i, j] < best[0]:
            best = (loss[i, j], ov, _EFF[i], _EFF[j])
    _, ov, c, m = best
    return ClassEfficiency(compute=float(c), memory=float(m), floor_cycles=0.0, overhead_s=float(ov))


def fit_host(samples_: list[Sample], device: DeviceSpec, min_kernels: int = 3) -> DeviceEfficiency:
    """Per-class CPU factors fitted on the samples (classes with too few kernels keep the priors)."""
    if not samples_:
        raise CalibrationError("no profiled kernels to fit")
    priors = prior_efficiency(device)
    classes = dict(priors.classes)
    fitted = []
    for cls in sorted({s.features.cost_class for s in samples_}):
        rows = [s for s in samples_ if s.features.cost_class == cls]
        if len(rows) >= min_kernels:
            classes[cls] = fit_class(rows, device)
            fitted.append(cls)
    sources = sorted({s.source for s in samples_})
    return DeviceEfficiency(device.id, classes, f"fitted on {len(samples_)} kernels of {'; '.join(sources)} "
                            f"({device.name}, {device.threads} threads)", tuple(fitted))


def relative_errors(samples_: list[Sample], device: DeviceSpec, eff: DeviceEfficiency) -> dict[str, list[float]]:
    """|predicted/measured - 1| per cost class (and 'overall') with the given factors."""
    from tessera.cost.roofline import kernel_time

    out: dict[str, list[float]] = {"overall": []}
    for s in samples_:
        pred = kernel_time(s.features, device, eff.classes[s.features.cost_class]).time_s
        e = abs(pred / s.measured_s - 1)
        out.setdefault(s.features.cost_class, []).append(e)
        out["overall"].append(e)
    return out


def timing_spread(samples_: list[Sample]) -> dict[str, list[float]]:
    """|t / median - 1| of identical kernels timed separately within one step (e.g. the same op in every
    layer), per class and overall: the noise floor no model of shapes alone can beat."""
    groups: dict[tuple[str, str], list[Sample]] = {}
    for s in samples_:
        groups.setdefault((s.source, s.signature), []).append(s)
    out: dict[str, list[float]] = {"overall": []}
    for rows in groups.values():
        if len(rows) >= 3:
            med = float(np.median([r.measured_s for r in rows]))
            for r in rows:
                out.setdefault(r.features.cost_class, []).append(abs(r.measured_s / med - 1))
                out["overall"].append(abs(r.measured_s / med - 1))
    return out
