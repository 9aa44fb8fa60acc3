"""A kernel-placement problem: kernels with a time on each device, data edges with bytes, and links.

This is the solver's view of a step, independent of how it was built (a traced graph and the cost
model, or a hand-written test case): the planner fills it, :mod:`tessera.plan.milp` solves it exactly,
and :mod:`tessera.plan.enumerate` checks small instances by brute force.

The two objectives (both in seconds):

* **throughput**: the pipelined cycle time of a step run as ``micro_batches`` (M) micro-batches,
  ``max(M x busiest device, M x busiest directed link, critical path of one micro-batch)``. Kernel
  times and edge bytes are per micro-batch; a cut edge costs ``messages`` x the link's per-message
  latency plus bytes / bandwidth on its directed link. The critical-path term is what cannot overlap:
  one micro-batch cannot finish its step faster than its own dependency chain (with M = 1 nothing
  overlaps and the cycle is the critical path).
* **latency**: the critical path of one micro-batch: compute plus the transfers of cut edges on it.

Both count a critical path over the dependency graph (plus the transfers of cut loop edges): kernels
without a path between them may overlap even on one device. They are therefore lower bounds, not the
figures plans report: :mod:`tessera.plan.step_evaluation` list-schedules the step as the runtime runs it
(each device's kernels one after another), and for every assignment its cycle is at least the throughput
objective and its critical path at least the latency objective (`tests/plan/test_objective_bound.py`); it
is often above them (``test_evaluate_by_hand`` in `tests/plan/test_fold.py`: a cycle of 11 s against an objective of 9 s). The
solver minimises the bound and every plan is compared on the evaluation.

Memory (optional): ``items`` are resident objects (weights, state) with bytes; an item lives on every
device that runs a kernel reading it, and each device's items must fit its ``capacity``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from tessera.errors import TesseraError

OBJECTIVES = ("throughput", "latency")
MICRO_BATCHES = (1, 2, 4, 8)


class PlacementProblemError(TesseraError, ValueError):
    """A placement problem with inconsistent sizes or impossible constraints."""


@dataclass
class MemorySpec:
    """Resident items and device capacities: ``item_bytes[w]`` bytes of item w (per device holding it),
    ``reads``: (kernel, item) pairs, ``capacity[d]``: bytes device d has for items."""

    item_bytes: np.ndarray  # [W]
    reads: list[tuple[int, int]]
    capacity: np.ndarray  # [D]
    item_names: list[str] | None = None

    def __post_init__(self) -> None:
        self.item_bytes = np.asarray(self.item_bytes, dtype=float)
        self.capacity = np.asarray(self.capacity, dtype=float)

    def held(self, assignment) -> list[tuple[int, int]]:
        """(item, device) for every item a kernel reads on the device ``assignment`` gives it, each pair once,
        in the order ``reads`` first meets it."""
        if not self.reads:
            return []
        reads = self._read_array
        devices = np.asarray(assignment, dtype=np.int64)[reads[:, 0]]
        width = int(devices.max()) + 1
        pairs, first = np.unique(reads[:, 1] * width + devices, return_index=True)
        pairs = pairs[np.argsort(first, kind="stable")]
        return list(zip((pairs // width).tolist(), (pairs % width).tolist(), strict=True))

    @cached_property
    def _read_array(self) -> np.ndarray:
        return np.asarray(self.reads, dtype=np.int64).reshape(-1, 2)  # ``reads`` does not change once built

    def readers(self) -> dict[int, list[int]]:
        """item -> kernels that read it."""
        out: dict[int, list[int]] = {}
        for k, w in self.reads:
            out.setdefault(w, []).append(k)
        return out


@dataclass
class PlacementProblem:
    """Place each of K kernels on one of D devices (or device groups).

    ``times[i, d]``: seconds of kernel i on device d for one micro-batch (``inf``: it cannot run there).
    ``edges``: (src, dst, bytes) data dependencies, src before dst in program order. ``messages[n]``:
    how many messages edge n's transfer takes (default 1; folded problems stand for several layers).
    ``pinned``: kernels that must run on a given device (state that is not moved). ``together``: pairs of
    kernels that must share a device (state touched by both; kernels whose PTX is indirect or opaque
    stay with their neighbours). ``micro_batches``: M of the throughput objective. ``loop_edges``:
    (src, dst, bytes, messages) edges of folded problems between layers that share one placement (any
    program order): a cut one loads its link like an edge and adds its transfer to the critical path
    (the chain of layers crosses every layer boundary).
    """

    devices: list[str]
    times: np.ndarray  # [K, D]
    edges: list[tuple[int, int, float]]
    bandwidth: np.ndarray  # [D, D] bytes/s from d to e
    latency: np.ndarray  # [D, D] seconds per message from d to e
    pinned: dict[int, int] = field(default_factory=dict)
    together: list[tuple[int, int]] = field(default_factory=list)
    micro_batches: int = 1
    messages: list[float] | None = None
    memory: MemorySpec | None = None
    loop_edges: list[tuple[int, int, float, float]] = field(default_factory=list)

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
        for src, dst, nbytes, count in self.loop_edges:
            if not (0 <= src < k and 0 <= dst < k) or nbytes < 0 or count < 0:
                raise PlacementProblemError(f"loop edge {src}->{dst} ({nbytes} bytes, {count} messages) is invalid")
        if self.messages is None:
            self.messages = [1.0] * len(self.edges)
        elif len(self.messages) != len(self.edges) or min(self.messages, default=1.0) < 0:
            raise PlacementProblemError(f"messages needs one count >= 0 per edge ({len(self.edges)} edges)")
        for i, dev in self.pinned.items():
            if not (0 <= i < k and 0 <= dev < d) or not np.isfinite(self.times[i, dev]):
                raise PlacementProblemError(f"kernel {i} is pinned to device {dev}, where it cannot run")
        if not np.isfinite(self.times).any(axis=1).all():
            bad = int(np.flatnonzero(~np.isfinite(self.times).any(axis=1))[0])
            raise PlacementProblemError(f"kernel {bad} cannot run on any device")
        if self.micro_batches < 1:
            raise PlacementProblemError(f"micro_batches must be >= 1 (got {self.micro_batches})")
        if self.memory is not None:
            m = self.memory
            if m.capacity.shape != (d,):
                raise PlacementProblemError(f"memory capacity needs one entry per device ({d})")
            for i, w in m.reads:
                if not (0 <= i < k and 0 <= w < len(m.item_bytes)):
                    raise PlacementProblemError(f"memory read ({i}, {w}) names a kernel or item that does not exist")

    @property
    def kernels(self) -> int:
        return self.times.shape[0]

    @cached_property
    def evaluations(self) -> dict[bytes, Any]:
        """`tessera.plan.step_evaluation.evaluate`'s answers for this problem by assignment (a search assembles
        the same placements many times; a problem is not changed after it is built)."""
        return {}

    @cached_property
    def edge_arrays(self) -> EdgeArrays:
        """The edges, loop edges and memory reads as arrays (built once; a problem is not changed after it is
        built)."""
        preds: list[list[tuple[int, int]]] = [[] for _ in range(self.kernels)]
        for n, (src, dst, _) in enumerate(self.edges):
            preds[dst].append((n, src))
        loops = self.loop_edges
        items, read_kernel, read_item = np.zeros(0, dtype=int), np.zeros(0, dtype=int), np.zeros(0, dtype=int)
        if self.memory is not None:
            readers = self.memory.readers()
            items = np.array(list(readers), dtype=int)
            position = {w: i for i, w in enumerate(readers)}
            read_kernel = np.array([k for w, ks in readers.items() for k in ks], dtype=int)
            read_item = np.array([position[w] for w, ks in readers.items() for _ in ks], dtype=int)
        return EdgeArrays(np.array([e[0] for e in self.edges], dtype=int), np.array([e[1] for e in self.edges], dtype=int),
                          np.array([e[2] for e in self.edges], dtype=float), np.asarray(self.messages, dtype=float),
                          np.array([e[0] for e in loops], dtype=int), np.array([e[1] for e in loops], dtype=int),
                          np.array([e[2] for e in loops], dtype=float), np.array([e[3] for e in loops], dtype=float),
                          preds, items, read_kernel, read_item)

    def transfer_time(self, nbytes: float, src: int, dst: int, messages: float = 1.0) -> float:
        """Seconds to move ``nbytes`` from device src to dst in ``messages`` messages (0 on the same device)."""
        if src == dst:
            return 0.0
        return float(messages * self.latency[src, dst] + nbytes / self.bandwidth[src, dst])

    def transfer_matrix(self, nbytes: float, messages: float = 1.0) -> np.ndarray:
        """[D, D] seconds to move ``nbytes`` between each pair of devices (0 on the diagonal)."""
        m = messages * self.latency + nbytes / self.bandwidth
        np.fill_diagonal(m, 0.0)
        return m


@dataclass(frozen=True)
class EdgeArrays:
    """A problem's edges (``src``, ``dst``, ``nbytes``, ``messages``), loop edges and memory reads as arrays,
    for the vectorised evaluators; ``preds[k]``: (edge number, producer) of kernel k's incoming edges;
    ``items``: items with readers in :meth:`MemorySpec.readers` order, ``read_kernel``/``read_item``: each
    read's kernel and its item's position in ``items``."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    messages: np.ndarray
    loop_src: np.ndarray
    loop_dst: np.ndarray
    loop_bytes: np.ndarray
    loop_messages: np.ndarray
    preds: list[list[tuple[int, int]]]
    items: np.ndarray
    read_kernel: np.ndarray
    read_item: np.ndarray


@dataclass(frozen=True)
class Placement:
    """A solved placement: each kernel's device and the objective's value."""

    assignment: tuple[int, ...]
    objective: str
    value: float  # seconds: cycle time (throughput) or critical path (latency)
    bound: float  # the solver's proven lower bound
    gap: float  # relative gap between value and bound
    optimal: bool
    solve_s: float = 0.0
