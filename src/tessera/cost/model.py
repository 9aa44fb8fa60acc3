"""The cost model: time of every kernel of a graph on a device, measured where profiled, else the
calibrated roofline; and the step time with its breakdown by class and block."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from tessera.cost.efficiency import DeviceEfficiency, efficiency_for
from tessera.cost.features import FeatureExtractor, KernelFeatures
from tessera.cost.options import CostOptions, check_weights_supported
from tessera.cost.profile import Profile, kernel_signature
from tessera.cost.roofline import KernelCost, kernel_time
from tessera.errors import TesseraError
from tessera.graph.ir import Kernel, KernelGraph
from tessera.hardware.catalog import DeviceSpec


@dataclass(frozen=True)
class MemoryFootprint:
    """What a step keeps resident on a device that runs all of it: weights and engine state."""

    weight_bytes: float  # in the deployed weight dtype (matrices; vectors such as norms stay as traced)
    state_bytes: float  # KV cache in the deployed KV dtype, plus other state (SSM) as traced

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.state_bytes


def memory_footprint(graph: KernelGraph, options: CostOptions = CostOptions()) -> MemoryFootprint:
    """Resident bytes of a step's weights and state under the deployment options."""
    from tessera.cost.features import is_kv_buffer

    weights = state = 0.0
    for b in graph.buffers.values():
        if b.kind == "weight":
            weights += b.nbytes * (options.weight_scale(b.dtype) if len(b.shape) >= 2 else 1.0)
        elif b.kind == "state":
            state += b.nbytes * (options.kv_scale(b.dtype) if is_kv_buffer(b.name) else 1.0)
    return MemoryFootprint(weights, state)


class ProfileDeviceError(TesseraError):
    """A profile measured on one device was given for another."""


@dataclass(frozen=True)
class StepEstimate:
    """A step's predicted time on one device, with per-kernel costs."""

    device: str
    step_time_s: float
    kernels: list[KernelCost]
    measured: int  # kernels whose time came from a profile

    def by(self, key: str, graph: KernelGraph) -> dict[str, dict[str, float]]:
        """Time, kernel count and share grouped by ``cost_class`` or ``block``."""
        from tessera.cost.features import block_of

        rows: dict[str, dict[str, float]] = defaultdict(lambda: {"kernels": 0, "time_s": 0.0})
        for c in self.kernels:
            name = c.cost_class if key == "cost_class" else block_of(graph.kernels[c.index])
            rows[name]["kernels"] += 1
            rows[name]["time_s"] += c.time_s
        total = self.step_time_s or 1.0
        return {k: v | {"share": v["time_s"] / total} for k, v in sorted(rows.items(), key=lambda kv: -kv[1]["time_s"])}


def device_efficiency(device: DeviceSpec, options: CostOptions = CostOptions(),
                      efficiency: DeviceEfficiency | None = None) -> DeviceEfficiency:
    """The factors the cost model uses on ``device``: ``efficiency`` or the device's own (fitted or priors),
    with the time multipliers of the options' factors file for that device."""
    eff = efficiency or efficiency_for(device)
    if options.factors is None:
        return eff
    return eff.with_scales(options.factors.for_device(device.id, tuple(eff.classes)), options.factors.describe())


class CostModel:
    """Kernel times on one device: a profile's measured median where it has the kernel (or, for a decode kernel
    whose time follows the cache position, its fit at the planned position), else the roofline; with the
    profile's host overhead (Tessera's engine on this CPU) each kernel as it runs inside a step."""

    def __init__(self, device: DeviceSpec, options: CostOptions = CostOptions(), profile: Profile | None = None,
                 efficiency: DeviceEfficiency | None = None):
        if profile is not None and profile.device != device.id:
            raise ProfileDeviceError(f"the profile was measured on {profile.device}, not {device.id}; profile "
                                     f"on {device.id} or drop --profile")
        check_weights_supported(options, device)
        self.device, self.options = device, options
        self._checked: set[int] = set()  # graphs whose native weight formats were checked against the device
        self.efficiency = device_efficiency(device, options, efficiency)
        self.measured = profile.by_signature() if profile is not None else {}
        # Tessera's engine on this host: the executor's dispatch and cold weights, per kernel (`cost.host_overhead`)
        self.overhead = profile.overhead if profile is not None else None
        self.positions = profile.positions if profile is not None else None  # decode kernels by cache position

    def kernel_costs(self, graph: KernelGraph, features: list[KernelFeatures] | None = None) -> list[KernelCost]:
        """Cost of every kernel of ``graph`` in program order (``features``: the graph's, if already
        extracted with this model's options, e.g. shared by the cost models of several devices)."""
        if id(graph) not in self._checked:
            check_weights_supported(self.options, self.device, graph)
            self._checked.add(id(graph))
        features = FeatureExtractor(graph, self.options).all() if features is None else features
        out = []
        reads = _weight_reads(graph) if self.overhead is not None else {}
        for k, f in zip(graph.kernels, features, strict=True):
            cost = kernel_time(f, self.device, self.efficiency.for_kernel(f.cost_class, f.op), self.options)
            t = self.measured.get(kernel_signature(k)) if self.measured else None
            if t is None and self.positions is not None and self.positions.planned is not None:
                # a decode step no profile timed (other rows): its attention at the planned mean position
                t = self.positions.kernel_s(k, self.positions.planned)
            if t is not None:
                cost = KernelCost(k.index, f.cost_class, t, cost.compute_s, cost.memory_s, cost.floor_s, "measured")
            if self.overhead is not None:
                gemm = reads.get(k.index) if f.cost_class in ("gemm", "gemv") else None
                rows = f.gemm[0] * f.gemm[1] if gemm and f.gemm else None  # the GEMM's rows (tokens)
                cost = KernelCost(k.index, f.cost_class,
                                  self.overhead.kernel_s(cost.time_s, f.weight_bytes, gemm, rows),
                                  cost.compute_s, cost.memory_s, cost.floor_s, cost.bound)
            out.append(cost)
        return out

    def positional_s(self, kernel: Kernel, position: int) -> float | None:
        """Seconds of a decode ``kernel`` whose time follows the cache position, in a step whose furthest position
        is ``position`` (the profile's `PositionModel`, with the host overhead as `kernel_costs` charges it);
        None for any other kernel, and on a device without such a model (every GPU: its kernels' times are the
        roofline's at the traced shapes)."""
        t = self.positions.kernel_s(kernel, position) if self.positions is not None else None
        if t is None or self.overhead is None:
            return t
        return self.overhead.kernel_s(t, 0.0)  # attention reads the KV cache, no weights

    def estimate(self, graph: KernelGraph) -> StepEstimate:
        """The step's time (kernels run back to back on one device) and its per-kernel costs."""
        costs = self.kernel_costs(graph)
        return StepEstimate(self.device.id, sum(c.time_s for c in costs), costs,
                            sum(c.bound == "measured" for c in costs))

    def step_time(self, graph: KernelGraph) -> float:
        """Predicted seconds of one step of ``graph`` on this device."""
        return self.estimate(graph).step_time_s


def _weight_reads(graph: KernelGraph) -> dict[int, list[tuple[tuple[int, ...], float]]]:
    """Per kernel, (shape, bytes) of every weight it reads (a GEMM's matrices, and any bias)."""
    out: dict[int, list[tuple[tuple[int, ...], float]]] = defaultdict(list)
    for a in graph.accesses:
        buf = graph.buffers[a.buffer]
        if buf.kind == "weight" and a.mode == "read":
            out[a.kernel].append((tuple(buf.shape), float(math.prod(a.sizes) * a.itemsize)))
    return out
