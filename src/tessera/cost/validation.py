"""Measured times against Tessera's predictions (`tessera validate`): per device and op class the median and
p90 of |predicted - measured| / measured and the signed median; the cross-device ratios (measured vs
predicted) where one op/shape is measured on two devices; and time factors fitted on them (`--fit`).

How each measurement is predicted:

- a step (documented CSV): the step traced at its shape and costed by :class:`CostModel` on the device
  (the whole step, or the sum over its kernels of one cost class);
- a profiled kernel: the profile's step retraced at its shape, the kernel found by its signature and
  costed by the roofline (the profile's own time is not used);
- shape-less kernels (Nsight, calibration set): from the same kernel measured on a reference device, by
  the GPU calibration's method (:func:`tessera.cost.gpu_calibration.predict_target`: the kernel's size
  inferred from the reference time, the other part's time predicted at that size); the reference itself
  is not predicted.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tessera.capture.shapes import DEFAULT_GRAPH
from tessera.cost.factors import ANY_CLASS, MIN_FIT_MEASUREMENTS, TimeFactors
from tessera.cost.measurements import KERNEL, PAIRED, STEP, STEP_CLASS, TRACE, Measurement, MeasurementError
from tessera.cost.options import CostOptions
from tessera.errors import TesseraError
from tessera.hardware.catalog import HOST_ID, DeviceSpec


@dataclass(frozen=True)
class ValidationConfig:
    """What `tessera validate` compares: the measurement files, the cost options the predictions use (with
    ``options.factors`` from `--factors`), the phase of Nsight kernels and the reference device of
    shape-less kernels (None: the first device a file names)."""

    files: tuple[Path, ...]
    options: CostOptions = field(default_factory=CostOptions)
    nsys_phase: str = "decode"
    reference: str | None = None
    graph: str = DEFAULT_GRAPH


@dataclass(frozen=True)
class Comparison:
    """One measurement with Tessera's prediction: ``predicted_s`` with the factors file applied,
    ``unscaled_s`` without it (what a new fit is relative to)."""

    measurement: Measurement
    predicted_s: float
    unscaled_s: float
    basis: str  # "roofline" | "from <reference device>"

    @property
    def error(self) -> float:
        """Signed relative error: predicted / measured - 1."""
        return self.predicted_s / self.measurement.seconds - 1


@dataclass(frozen=True)
class ErrorStats:
    """Relative errors of a group of predictions."""

    count: int
    median_abs: float
    p90_abs: float
    median_signed: float

    @classmethod
    def of(cls, errors: list[float]) -> ErrorStats:
        a = np.abs(np.array(errors))
        return cls(len(errors), float(np.median(a)), float(np.percentile(a, 90)), float(np.median(errors)))


@dataclass(frozen=True)
class GroupRow:
    """Errors of one device and op class."""

    device: str
    op_class: str
    stats: ErrorStats
    basis: str


@dataclass(frozen=True)
class RatioRow:
    """One pair of devices and op class: t(device_b) / t(device_a), measured against predicted."""

    device_a: str
    device_b: str
    op_class: str
    count: int
    measured_median: float
    predicted_median: float
    stats: ErrorStats  # of predicted ratio / measured ratio - 1
    faster_side_agreement: float  # share of pairs where prediction and measurement agree which is faster


@dataclass
class Validation:
    """The comparisons of every measurement and their summaries."""

    comparisons: list[Comparison]
    groups: list[GroupRow]
    overall: dict[str, ErrorStats]  # per device
    ratios: list[RatioRow]
    references: dict[str, int]  # reference device -> measurements used only to predict others
    excluded: list[str]
    unpaired: list[str]  # shape-less kernels measured on one device only: nothing to predict them from

    def to_dict(self) -> dict:
        """A JSON-ready summary (``--json``)."""
        def stats(s: ErrorStats) -> dict:
            return {"count": s.count, "median_abs_error": s.median_abs, "p90_abs_error": s.p90_abs,
                    "median_signed_error": s.median_signed}
        return {
            "groups": [{"device": g.device, "op_class": g.op_class, "basis": g.basis} | stats(g.stats)
                       for g in self.groups],
            "overall": {d: stats(s) for d, s in self.overall.items()},
            "ratios": [{"device_a": r.device_a, "device_b": r.device_b, "op_class": r.op_class,
                        "measured_median_ratio": r.measured_median, "predicted_median_ratio": r.predicted_median,
                        "faster_side_agreement": r.faster_side_agreement} | stats(r.stats) for r in self.ratios],
            "references": self.references,
            "excluded": self.excluded,
            "unpaired": len(self.unpaired),
        }


def _spec(device: str, threads: int | None) -> DeviceSpec:
    from tessera.hardware.devices import resolve_device
    from tessera.hardware.host import host_spec

    return host_spec(threads) if device == HOST_ID else resolve_device(device)


def _step_predictions(rows: list[Measurement], options: CostOptions, graph_kind: str,
                      progress: Callable[[str], None]) -> list[Comparison]:
    """Whole steps and per-class sums of steps: each distinct (model, phase, shape) traced once."""
    from tessera.capture.api import trace_model
    from tessera.cost.model import CostModel

    plain = replace(options, factors=None)
    out = []
    by_step: dict[tuple, list[Measurement]] = {}
    for m in rows:
        by_step.setdefault((m.model, m.phase, m.shape), []).append(m)
    for (model, phase, shape), ms in by_step.items():
        sh = dict(shape)
        progress(f"tracing {model} {phase} ({', '.join(f'{k} {v}' for k, v in shape) or 'default shape'})")
        try:
            graph = trace_model(model, phase, batch=sh.get("batch"), seq=sh.get("seq"), ctx=sh.get("ctx"),
                                image=sh.get("image"), resolution=sh.get("resolution"), graph=graph_kind)
        except TesseraError as e:  # a shape the model cannot take (a limit, a bad image size): name the row
            raise MeasurementError(f"{ms[0].where}: cannot trace {model} {phase} at this shape: {e}") from None
        costs: dict[tuple[str, int | None], tuple[list, list]] = {}
        for m in ms:
            if (m.device, m.threads) not in costs:
                spec = _spec(m.device, m.threads)
                costs[(m.device, m.threads)] = (CostModel(spec, options).kernel_costs(graph),
                                                CostModel(spec, plain).kernel_costs(graph))
            scaled, unscaled = costs[(m.device, m.threads)]
            pick = [i for i, c in enumerate(unscaled) if m.part is None or c.cost_class == m.part]
            if not pick:
                present = sorted({c.cost_class for c in unscaled})
                raise MeasurementError(f"{m.where}: {model} {phase} has no {m.part} kernels (its classes: "
                                       f"{', '.join(present)}); measure one of those or the whole step")
            out.append(Comparison(m, sum(scaled[i].time_s for i in pick), sum(unscaled[i].time_s for i in pick),
                                  "roofline"))
    return out


def _kernel_predictions(rows: list[Measurement], options: CostOptions, graph_kind: str,
                        progress: Callable[[str], None]) -> list[Comparison]:
    """Profiled kernels: the profile's step retraced, each kernel costed by the roofline (found by signature)."""
    from tessera.capture.api import trace_model
    from tessera.cost.model import CostModel
    from tessera.cost.profile import kernel_signature

    plain = replace(options, factors=None)
    out = []
    by_step: dict[tuple, list[Measurement]] = {}
    for m in rows:
        by_step.setdefault((m.model, m.phase, m.shape, m.device, m.threads), []).append(m)
    for (model, phase, shape, device, threads), ms in by_step.items():
        sh = dict(shape)
        progress(f"retracing {model} {phase} for its profile on {device}")
        graph = trace_model(model, phase, batch=sh.get("batch"), seq=sh.get("seq"), ctx=sh.get("ctx"),
                            image=sh.get("image"), resolution=sh.get("resolution"), graph=graph_kind)
        spec = _spec(device, threads)
        scaled = CostModel(spec, options).kernel_costs(graph)
        unscaled = CostModel(spec, plain).kernel_costs(graph)
        by_sig = {}
        for k in graph.kernels:
            by_sig.setdefault(kernel_signature(k), k.index)
        for m in ms:
            i = by_sig.get(m.signature)
            if i is None:
                raise MeasurementError(f"{m.where}: kernel {m.op} is not in {model} {phase} traced at "
                                       f"{dict(shape)}: the profile is of another graph; re-profile it with "
                                       "this version of Tessera")
            out.append(Comparison(replace(m, op_class=unscaled[i].cost_class), scaled[i].time_s,
                                  unscaled[i].time_s, "roofline"))
    return out


def _cross_predictions(rows: list[Measurement], options: CostOptions, reference: str | None
                       ) -> tuple[list[Comparison], dict[str, int], list[str]]:
    """Shape-less kernels predicted from their measurement on the reference device."""
    from tessera.cost.gpu_calibration import MeasuredKernel, predict_target
    from tessera.cost.model import device_efficiency

    by_key: dict[tuple, dict[str, Measurement]] = {}
    for m in rows:
        by_key.setdefault(m.key, {})[m.device] = m
    order = list(dict.fromkeys(m.device for m in rows))
    if reference is not None and reference not in order:
        raise MeasurementError(f"--reference {reference}: no shape-less kernel was measured on it (devices: "
                               f"{', '.join(order)})")
    out, refs, unpaired = [], {}, []
    effs: dict[str, tuple] = {}
    for per_device in by_key.values():
        paired = next((m for m in per_device.values() if m.reference is not None), None)
        ref_id = paired.reference.device if paired else (reference or order[0])
        ref = per_device.get(ref_id)
        if ref is None or len(per_device) < 2:
            unpaired += [m.where for m in per_device.values()]
            continue
        refs[ref_id] = refs.get(ref_id, 0) + 1
        for device, m in per_device.items():
            if device == ref_id:
                continue
            for d in (ref_id, device):
                if d not in effs:
                    spec = _spec(d, None)
                    effs[d] = (spec, device_efficiency(spec, options))
            (ref_spec, ref_eff), (tgt_spec, tgt_eff) = effs[ref_id], effs[device]
            k = MeasuredKernel(m.phase or "decode", m.block or "-", m.op, m.op_class, m.launches, ref.seconds,
                               m.seconds, m.identity)
            r = ref_eff.for_kernel(m.op_class, m.identity)
            if m.identity in ref_eff.ops:  # identity floors sit on the kernel's own class roofline
                r = replace(ref_eff.for_kernel(m.op_class), floor_cycles=r.floor_cycles)
            t = tgt_eff.for_kernel(m.op_class, m.identity)
            # the calibration's ratio prediction; the factors file scales the target's time over the reference's
            base = predict_target(k, ref_spec, tgt_spec, replace(r, scale=1.0), replace(t, scale=1.0))
            out.append(Comparison(replace(m, reference=ref), base * t.scale / r.scale, base, f"from {ref_id}"))
    return out, refs, unpaired


def _ratio_rows(comparisons: list[Comparison]) -> list[RatioRow]:
    """Cross-device ratios: every key measured on two devices (shape-less ones against their reference)."""
    by_key: dict[tuple, list[Comparison]] = {}
    for c in comparisons:
        by_key.setdefault(c.measurement.key, []).append(c)
    pairs: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for cs in by_key.values():
        for c in cs:
            ref = c.measurement.reference
            if ref is not None:
                pairs.setdefault((ref.device, c.measurement.device, c.measurement.op_class), []).append(
                    (c.measurement.seconds / ref.seconds, c.predicted_s / ref.seconds))
        absolute = [c for c in cs if c.measurement.reference is None]
        for i, a in enumerate(absolute):
            for b in absolute[i + 1:]:
                if a.measurement.device != b.measurement.device:
                    pairs.setdefault((a.measurement.device, b.measurement.device, a.measurement.op_class), []).append(
                        (b.measurement.seconds / a.measurement.seconds, b.predicted_s / a.predicted_s))
    rows = []
    for (da, db, cls), rs in sorted(pairs.items()):
        measured = [m for m, _ in rs]
        predicted = [p for _, p in rs]
        agree = sum((p > 1) == (m > 1) for m, p in rs) / len(rs)
        rows.append(RatioRow(da, db, cls, len(rs), statistics.median(measured), statistics.median(predicted),
                             ErrorStats.of([p / m - 1 for m, p in rs]), agree))
    return rows


def summarize(comparisons: list[Comparison], references: dict[str, int] | None = None,
              excluded: list[str] | None = None, unpaired: list[str] | None = None) -> Validation:
    """Errors per device and op class, per device overall, and the cross-device ratios."""
    groups: dict[tuple[str, str], list[Comparison]] = {}
    for c in comparisons:
        groups.setdefault((c.measurement.device, c.measurement.op_class), []).append(c)
    rows = [GroupRow(d, cls, ErrorStats.of([c.error for c in cs]), ", ".join(sorted({c.basis for c in cs})))
            for (d, cls), cs in sorted(groups.items())]
    overall = {}
    for d in dict.fromkeys(c.measurement.device for c in comparisons):
        overall[d] = ErrorStats.of([c.error for c in comparisons if c.measurement.device == d])
    return Validation(comparisons, rows, overall, _ratio_rows(comparisons), references or {}, excluded or [],
                      unpaired or [])


def validate(config: ValidationConfig, progress: Callable[[str], None] = lambda s: None) -> Validation:
    """Read every measurement file and compare each measurement with Tessera's prediction."""
    from tessera.cost.measurements import read_measurements

    measurements: list[Measurement] = []
    excluded: list[str] = []
    for path in config.files:
        s = read_measurements(path, config.nsys_phase)
        measurements += s.measurements
        excluded += [e if e.startswith(str(path)) else f"{path}: {e}" for e in s.excluded]
    if config.reference is not None:
        from tessera.hardware.catalog import UnknownDeviceError, canonical_id

        try:
            config = replace(config, reference=canonical_id(config.reference))
        except UnknownDeviceError as e:
            raise MeasurementError(f"--reference: {e}") from None
    comparisons = _step_predictions([m for m in measurements if m.kind == STEP], config.options, config.graph,
                                    progress)
    comparisons += _kernel_predictions([m for m in measurements if m.kind == KERNEL], config.options,
                                       config.graph, progress)
    cross, refs, unpaired = _cross_predictions([m for m in measurements if m.kind in (TRACE, PAIRED)],
                                               config.options, config.reference)
    comparisons += cross
    if not comparisons:
        raise MeasurementError("nothing to compare: shape-less kernels (Nsight, calibration) are predicted from "
                               "the same kernel on a reference device, and none was measured on two devices")
    return summarize(comparisons, refs, excluded, unpaired)


def fit_factors(result: Validation, source: str, min_count: int = MIN_FIT_MEASUREMENTS) -> TimeFactors:
    """Per device and op class, 1 / the median of predicted-without-factors / measured: the time factor that
    makes the median signed error of that group zero (the median is scale-equivariant, also for an even count).
    Whole-step rows give the device's ``*`` factor; groups of fewer than ``min_count`` measurements none."""
    groups: dict[tuple[str, str], list[float]] = {}
    for c in result.comparisons:
        groups.setdefault((c.measurement.device, c.measurement.op_class), []).append(
            c.unscaled_s / c.measurement.seconds)
    factors: dict[str, dict[str, float]] = {}
    fit: dict[str, dict] = {}
    for (device, cls), ratios in sorted(groups.items()):
        if len(ratios) < min_count:
            continue
        name = ANY_CLASS if cls == STEP_CLASS else cls
        factors.setdefault(device, {})[name] = 1.0 / float(np.median(ratios))
        measured_over_predicted = 1.0 / np.array(ratios)
        fit.setdefault(device, {})[name] = {"measurements": len(ratios), "measured_over_predicted_p10_p90": [
            float(np.percentile(measured_over_predicted, 10)), float(np.percentile(measured_over_predicted, 90))]}
    if not factors:
        raise MeasurementError(f"no device and op class has {min_count} or more measurements to fit a factor on; "
                               "measure more kernels or lower --min-count")
    return TimeFactors.from_mapping(factors, source, fit=fit)
