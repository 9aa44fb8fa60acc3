"""The kernel census of two devices: which kernels of a model's steps are faster on which device.

For every kernel of one or more traced steps, the cost models of two devices predict a time; the census
counts the kernels faster on each side and the share of step time they carry (measured on the first
device's time), overall, by cost class, by block (attention / ffn / other) and by phase, and keeps the
per-kernel time ratios t(second) / t(first) for plots. Everything here is a pure function of the graphs
and the two cost models, except :func:`run_census`, which traces the steps first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tessera.capture.shapes import DEFAULT_GRAPH
from tessera.cost.features import COST_CLASSES, FeatureExtractor, block_of
from tessera.cost.model import CostModel
from tessera.cost.options import CostOptions
from tessera.errors import TesseraError
from tessera.graph.ir import KernelGraph
from tessera.hardware.catalog import DeviceSpec

BLOCKS = ("attention", "ffn", "other")
EQUAL = "equal"  # the side of a kernel predicted to take the same time on both devices
_REL_TOL = 1e-9  # times this close are equal (float noise, not a prediction)


class CensusError(TesseraError, ValueError):
    """A census asked of the wrong number of devices, no phases, or mismatched graphs."""


@dataclass(frozen=True)
class KernelPair:
    """One kernel's predicted time on both devices."""

    phase: str
    index: int
    op: str
    scope: str
    cost_class: str
    block: str
    flops: float
    bytes: float  # bytes moved, in the deployed weight / KV dtypes
    time_a_s: float  # on the first device
    time_b_s: float  # on the second device
    bound_a: str
    bound_b: str

    @property
    def ratio(self) -> float:
        """t(second) / t(first): below 1 the second device is faster."""
        return self.time_b_s / self.time_a_s if self.time_a_s > 0 else math.inf

    @property
    def faster(self) -> str:
        """``"a"``, ``"b"`` or ``"equal"``: the side predicted to run this kernel faster."""
        if math.isclose(self.time_a_s, self.time_b_s, rel_tol=_REL_TOL, abs_tol=0.0):
            return EQUAL
        return "a" if self.time_a_s < self.time_b_s else "b"


@dataclass(frozen=True)
class RatioSummary:
    """Distribution of the per-kernel ratios t(second) / t(first) of a group of kernels."""

    kernels: int
    geomean: float
    median: float
    p10: float
    p90: float
    min: float
    max: float

    @classmethod
    def of(cls, ratios: Sequence[float]) -> RatioSummary:
        """The summary of ``ratios`` (NaN everywhere for an empty group)."""
        r = sorted(x for x in ratios if 0 < x < math.inf)
        if not r:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan, nan, nan)
        return cls(len(r), math.exp(sum(math.log(x) for x in r) / len(r)), _quantile(r, 0.5), _quantile(r, 0.1),
                   _quantile(r, 0.9), r[0], r[-1])


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class Share:
    """A group of kernels split by the side that runs them faster.

    ``kernels_*`` count kernels; ``time_*_s`` sum their time **on the first device** (the basis of the
    step-time shares); ``total_b_s`` is the group's time on the second device."""

    kernels: int
    kernels_a: int
    kernels_b: int
    kernels_equal: int
    total_a_s: float
    total_b_s: float
    time_a_s: float  # first-device time of the kernels faster on the first device
    time_b_s: float  # first-device time of the kernels faster on the second device
    time_equal_s: float
    ratios: RatioSummary

    @classmethod
    def of(cls, pairs: Sequence[KernelPair]) -> Share:
        """Count and time the kernels of ``pairs`` by their faster side."""
        count = {"a": 0, "b": 0, EQUAL: 0}
        time = {"a": 0.0, "b": 0.0, EQUAL: 0.0}
        for p in pairs:
            side = p.faster
            count[side] += 1
            time[side] += p.time_a_s
        return cls(kernels=len(pairs), kernels_a=count["a"], kernels_b=count["b"], kernels_equal=count[EQUAL],
                   total_a_s=sum(p.time_a_s for p in pairs), total_b_s=sum(p.time_b_s for p in pairs),
                   time_a_s=time["a"], time_b_s=time["b"], time_equal_s=time[EQUAL],
                   ratios=RatioSummary.of([p.ratio for p in pairs]))

    def kernel_share(self, side: str) -> float:
        """Share of the group's kernels faster on ``side`` ("a", "b" or "equal"); 0 for an empty group."""
        n = {"a": self.kernels_a, "b": self.kernels_b, EQUAL: self.kernels_equal}[side]
        return n / self.kernels if self.kernels else 0.0

    def time_share(self, side: str) -> float:
        """Share of the group's first-device time carried by the kernels faster on ``side``."""
        t = {"a": self.time_a_s, "b": self.time_b_s, EQUAL: self.time_equal_s}[side]
        return t / self.total_a_s if self.total_a_s > 0 else 0.0

    def to_dict(self, a: str, b: str) -> dict:
        """JSON form, sides named by device id."""
        names = {"a": a, "b": b, EQUAL: EQUAL}
        return {"kernels": self.kernels,
                "kernel_share": {names[s]: self.kernel_share(s) for s in names},
                "time_share": {names[s]: self.time_share(s) for s in names},
                "time_share_basis": f"predicted time on {a}",
                "time_s": {a: self.total_a_s, b: self.total_b_s},
                "ratio": {"of": f"t({b}) / t({a})"} | vars(self.ratios)}


@dataclass(frozen=True)
class Census:
    """Which kernels of a model's steps are predicted faster on each of two devices."""

    model: str
    device_a: str
    device_b: str
    phases: tuple[str, ...]
    shapes: dict[str, dict]  # phase -> the step's shape (batch, seq, ctx, image, resolution)
    options: CostOptions
    pairs: tuple[KernelPair, ...]
    overall: Share
    by_class: dict[str, Share]
    by_block: dict[str, Share]
    by_phase: dict[str, Share]
    step_time_s: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> device -> seconds

    def side_name(self, side: str) -> str:
        """The device id of a side ("a" or "b"); "equal" stays as is."""
        return {"a": self.device_a, "b": self.device_b}.get(side, side)

    def to_dict(self) -> dict:
        """The census as JSON-ready data (every time a prediction of the cost model)."""
        a, b = self.device_a, self.device_b
        return {"model": self.model, "devices": [a, b], "predicted": True, "phases": list(self.phases),
                "shapes": self.shapes,
                "options": {"weights_dtype": self.options.weights_dtype, "kv_dtype": self.options.kv_dtype,
                            "cuda_graphs": self.options.cuda_graphs},
                "overall": self.overall.to_dict(a, b),
                "by_class": {k: v.to_dict(a, b) for k, v in self.by_class.items()},
                "by_block": {k: v.to_dict(a, b) for k, v in self.by_block.items()},
                "by_phase": {k: v.to_dict(a, b) for k, v in self.by_phase.items()},
                "step_time_s": self.step_time_s,
                "ratios": {"of": f"t({b}) / t({a})", "overall": vars(self.overall.ratios),
                           "by_phase": {k: vars(v.ratios) for k, v in self.by_phase.items()},
                           "by_class": {k: vars(v.ratios) for k, v in self.by_class.items()}}}


def kernel_pairs(graph: KernelGraph, a: CostModel, b: CostModel) -> list[KernelPair]:
    """Every kernel of ``graph`` with its predicted time on the devices of ``a`` and ``b``."""
    features = FeatureExtractor(graph, a.options).all()
    if a.options != b.options:
        raise CensusError("both devices of a census are costed under the same options (weight/KV dtypes, launches)")
    costs_a, costs_b = a.kernel_costs(graph, features), b.kernel_costs(graph, features)
    out = []
    for k, f, ca, cb in zip(graph.kernels, features, costs_a, costs_b, strict=True):
        out.append(KernelPair(phase=graph.phase, index=k.index, op=k.op, scope=k.scope, cost_class=ca.cost_class,
                              block=block_of(k), flops=f.flops, bytes=f.bytes, time_a_s=ca.time_s,
                              time_b_s=cb.time_s, bound_a=ca.bound, bound_b=cb.bound))
    return out


def _grouped(pairs: Iterable[KernelPair], key: str, order: Sequence[str]) -> dict[str, Share]:
    groups: dict[str, list[KernelPair]] = {}
    for p in pairs:
        groups.setdefault(getattr(p, key), []).append(p)
    ranked = [g for g in order if g in groups] + sorted(g for g in groups if g not in order)
    return {g: Share.of(groups[g]) for g in ranked}


def census(graphs: Sequence[KernelGraph] | Mapping[str, KernelGraph], a: CostModel, b: CostModel) -> Census:
    """The census of the steps ``graphs`` (one per phase, all of one model) on the devices of ``a`` and ``b``."""
    graph_list = list(graphs.values()) if isinstance(graphs, Mapping) else list(graphs)
    if not graph_list:
        raise CensusError("a census needs at least one traced step")
    models = {g.model for g in graph_list}
    if len(models) != 1:
        raise CensusError(f"a census covers one model's steps; got graphs of {', '.join(sorted(models))}")
    phases = [g.phase for g in graph_list]
    if len(set(phases)) != len(phases):
        raise CensusError(f"one graph per phase; got phases {', '.join(phases)}")
    if a.device.id == b.device.id:
        raise CensusError(f"a census compares two different devices; both are {a.device.id}")
    pairs: list[KernelPair] = []
    step_time: dict[str, dict[str, float]] = {}
    for g in graph_list:
        ps = kernel_pairs(g, a, b)
        pairs += ps
        step_time[g.phase] = {a.device.id: sum(p.time_a_s for p in ps), b.device.id: sum(p.time_b_s for p in ps)}
    shapes = {g.phase: {k: g.meta[k] for k in ("batch", "seq", "ctx", "image", "resolution") if k in g.meta}
              for g in graph_list}
    return Census(model=graph_list[0].model, device_a=a.device.id, device_b=b.device.id, phases=tuple(phases),
                  shapes=shapes, options=a.options, pairs=tuple(pairs), overall=Share.of(pairs),
                  by_class=_grouped(pairs, "cost_class", COST_CLASSES), by_block=_grouped(pairs, "block", BLOCKS),
                  by_phase=_grouped(pairs, "phase", phases), step_time_s=step_time)


def parse_devices(text: str) -> tuple[DeviceSpec, DeviceSpec]:
    """Exactly two comma-separated devices (catalog ids or aliases), resolved; they must differ."""
    from tessera.hardware.devices import resolve_device

    names = [n.strip() for n in str(text).split(",")]
    if len(names) != 2 or not all(names):
        raise CensusError(f"--devices takes exactly two devices separated by a comma, e.g. A100,L40S "
                          f"(got {text!r})")
    a, b = resolve_device(names[0]), resolve_device(names[1])
    if a.id == b.id:
        raise CensusError(f"--devices {text!r} names {a.id} twice; give two different devices, e.g. A100,L40S")
    return a, b


def census_phases(model: str, phases: Sequence[str] | None = None) -> tuple[str, ...]:
    """The phases a census of ``model`` covers: those given (checked, duplicates dropped), else all of its family's."""
    from tessera.capture.models import resolve_model
    from tessera.capture.phases import check_phase
    from tessera.capture.shapes import PHASES

    spec = resolve_model(model)
    if not phases:
        return PHASES[spec.family]
    for p in phases:
        check_phase(spec, p)
    return tuple(dict.fromkeys(phases))


def run_census(model: str, devices: tuple[DeviceSpec, DeviceSpec], phases: Sequence[str] | None = None, *,
               options: CostOptions = CostOptions(), batch: int | None = None, seq: int | None = None,
               ctx: int | None = None, image: str | None = None, resolution: str | None = None,
               graph: str = DEFAULT_GRAPH, progress=None) -> Census:
    """Trace ``model``'s phases on meta (default: all of them, at the default shapes) as the ``graph`` kind and
    take their census.

    ``progress(phase)``, if given, is called before each phase is traced."""
    from tessera.capture.api import trace_model

    chosen = census_phases(model, phases)
    graphs = []
    for p in chosen:
        if progress is not None:
            progress(p)
        graphs.append(trace_model(model, p, batch=batch, seq=seq, ctx=ctx, image=image, resolution=resolution,
                                  graph=graph))
    return census(graphs, CostModel(devices[0], options), CostModel(devices[1], options))
