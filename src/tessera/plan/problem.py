"""A kernel-placement problem: kernels with a time on each device, data edges with bytes, and links.

This is the solver's view of a step, independent of how it was built (a traced graph and the cost
model, or a hand-written test case): the planner fills it, :mod:`tessera.plan.milp` solves it exactly,
and :mod:`tessera.plan.enumerate` checks small instances by brute force.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tessera.errors import TesseraError

OBJECTIVES = ("throughput", "latency")


class PlacementProblemError(TesseraError, ValueError):
    """A placement problem with inconsistent sizes or impossible constraints."""


@dataclass
class PlacementProblem:
    """Place each of K kernels on one of D devices (or device groups).

    ``times[i, d]``: seconds of kernel i on device d (``inf``: it cannot run there). ``edges``: (src, dst,
    bytes) data dependencies, src before dst in program order; a cut edge costs the link's per-message
    latency plus bytes / bandwidth. ``pinned``: kernels that must run on a given device (state that is
    not moved). ``together``: pairs of kernels that must share a device (state touched by both; kernels
    whose PTX is indirect or opaque stay with their neighbours).
    """

    devices: list[str]
    times: np.ndarray  # [K, D]
    edges: list[tuple[int, int, float]]
    bandwidth: np.ndarray  # [D, D] bytes/s from d to e
    latency: np.ndarray  # [D, D] seconds per message from d to e
    pinned: dict[int, int] = field(default_factory=dict)
    together: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.times = np.asarray(self.times, dtype=float)
        self.bandwidth = np.asarray(self.bandwidth, dtype=float)
        self.latency = np.asarray(self.latency, dtype=float)
        k, d = self.times.shape
        if d != len(self.devices) or d < 1:
            raise PlacementProblemError(f"times has {d} device columns for {len(self.devices)} devices")
        if self.bandwidth.shape != (d, d) or self.latency.shape != (d, d):
            raise PlacementProblemError(f"bandwidth and latency must be {d}x{d} (one entry per device pair)")
        for src, dst, nbytes in self.edges:
            if not 0 <= src < dst < k:
                raise PlacementProblemError(f"edge {src}->{dst}: kernels must exist and run in program order")
            if nbytes < 0:
                raise PlacementProblemError(f"edge {src}->{dst} moves {nbytes} bytes")
        for i, dev in self.pinned.items():
            if not (0 <= i < k and 0 <= dev < d) or not np.isfinite(self.times[i, dev]):
                raise PlacementProblemError(f"kernel {i} is pinned to device {dev}, where it cannot run")
        if not np.isfinite(self.times).any(axis=1).all():
            bad = int(np.flatnonzero(~np.isfinite(self.times).any(axis=1))[0])
            raise PlacementProblemError(f"kernel {bad} cannot run on any device")

    @property
    def kernels(self) -> int:
        return self.times.shape[0]

    def transfer_time(self, nbytes: float, src: int, dst: int) -> float:
        """Seconds to move ``nbytes`` from device src to dst (0 on the same device)."""
        if src == dst:
            return 0.0
        return float(self.latency[src, dst] + nbytes / self.bandwidth[src, dst])

    def transfer_matrix(self, nbytes: float) -> np.ndarray:
        """[D, D] seconds to move ``nbytes`` between each pair of devices (0 on the diagonal)."""
        m = self.latency + nbytes / self.bandwidth
        np.fill_diagonal(m, 0.0)
        return m


@dataclass(frozen=True)
class Placement:
    """A solved placement: each kernel's device and the objective's value."""

    assignment: tuple[int, ...]
    objective: str
    value: float  # seconds: cycle time (throughput) or critical path (latency)
    bound: float  # the solver's proven lower bound
    gap: float  # relative gap between value and bound
    optimal: bool
