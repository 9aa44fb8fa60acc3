"""Exact objective of every assignment of a small placement problem, by vectorised enumeration.

The evaluators (:func:`busy_times`, :func:`link_loads`, :func:`critical_paths`, :func:`cycle_times`,
:func:`memory_use`) take an ``[N, K]`` array of assignments and follow the definitions of
:mod:`tessera.plan.problem` literally; they are the reference the MILP is checked against.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from tessera.plan.problem import OBJECTIVES, Placement, PlacementProblem, PlacementProblemError

MAX_ASSIGNMENTS = 2_000_000
_MEMORY_SLACK = 1e-9  # relative: a device holding exactly its capacity fits
_FEW_ASSIGNMENTS = 4  # memory_use of at most this many assignments is summed per device in Python


def allowed_devices(problem: PlacementProblem) -> list[list[int]]:
    """Per kernel, the devices it may run on (finite time; only its device when pinned)."""
    finite = np.isfinite(problem.times)
    allowed = [[int(d) for d in np.flatnonzero(row)] for row in finite]
    for i, dev in problem.pinned.items():
        allowed[i] = [dev]
    return allowed


def all_assignments(problem: PlacementProblem) -> np.ndarray:
    """[N, K] every assignment that respects allowed devices, pinned kernels, ``together`` pairs and memory."""
    allowed = allowed_devices(problem)
    count = math.prod(len(devs) for devs in allowed)
    if count > MAX_ASSIGNMENTS:
        raise PlacementProblemError(f"{count} assignments are too many to enumerate (limit {MAX_ASSIGNMENTS})")
    a = np.array(list(itertools.product(*allowed)), dtype=np.int64).reshape(-1, problem.kernels)
    keep = np.ones(len(a), dtype=bool)
    for i, j in problem.together:
        keep &= a[:, i] == a[:, j]
    a = a[keep]
    return a[memory_fits(problem, a)] if problem.memory is not None else a


def busy_times(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
    """[N, D] seconds each device computes per micro-batch."""
    k, nd = problem.times.shape
    t = problem.times[np.arange(k), a]  # [N, K]
    return np.stack([np.where(a == dev, t, 0.0).sum(axis=1) for dev in range(nd)], axis=1)


def _transfers(problem: PlacementProblem, a: np.ndarray, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
               messages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For edges (``src``, ``dst``, ``nbytes``, ``messages``) under assignments ``a`` [N, K]: the sending and
    receiving devices [N, E] and each transfer's seconds (:meth:`PlacementProblem.transfer_time`; 0 where
    both ends share a device)."""
    s, d = a[:, src], a[:, dst]
    cost = messages * problem.latency[s, d] + nbytes / problem.bandwidth[s, d]
    return s, d, np.where(s == d, 0.0, cost)


def link_loads(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
    """[N, D, D] seconds each directed link transfers per micro-batch (cut edges and cut loop edges)."""
    nd = problem.times.shape[1]
    e = problem.edge_arrays
    n = len(a)
    parts = [_transfers(problem, a, e.src, e.dst, e.nbytes, e.messages),
             _transfers(problem, a, e.loop_src, e.loop_dst, e.loop_bytes, e.loop_messages)]
    rows = np.arange(n)[:, None]
    # every assignment's edges, then its loop edges, summed in that order (as one edge after another)
    cells = np.concatenate([(rows * nd + s) * nd + d for s, d, _ in parts], axis=1)
    costs = np.concatenate([c for _, _, c in parts], axis=1)
    return np.bincount(cells.ravel(), costs.ravel(), minlength=n * nd * nd).reshape(n, nd, nd)


def critical_paths(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
    """[N] latency objective: the longest path of compute plus cut-edge transfers, plus the transfers of
    cut loop edges (a constant term: the chain of layers crosses every layer boundary)."""
    k = problem.kernels
    e = problem.edge_arrays
    t = problem.times[np.arange(k), a]
    _, _, cost = _transfers(problem, a, e.src, e.dst, e.nbytes, e.messages)
    _, _, loop_cost = _transfers(problem, a, e.loop_src, e.loop_dst, e.loop_bytes, e.loop_messages)
    loops = np.zeros(len(a))
    for j in range(loop_cost.shape[1]):
        loops += loop_cost[:, j]
    if len(a) == 1:  # one assignment (every plan's evaluation): plain floats
        finish, tt, cc = [0.0] * k, t[0].tolist(), cost[0].tolist()
        for j in range(k):
            start = 0.0
            for n, src in e.preds[j]:
                v = finish[src] + cc[n]
                if v > start:
                    start = v
            finish[j] = start + tt[j]
        return np.array([max(finish, default=0.0)]) + loops
    finish = np.zeros_like(t, dtype=float)
    for j in range(k):
        start = np.zeros(len(a))
        for n, src in e.preds[j]:
            start = np.maximum(start, finish[:, src] + cost[:, n])
        finish[:, j] = start + t[:, j]
    return (finish.max(axis=1) if k else np.zeros(len(a))) + loops


def cycle_times(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
    """[N] throughput objective: max(M x busiest device, M x busiest directed link, critical path)."""
    m = problem.micro_batches
    busy = busy_times(problem, a).max(axis=1)
    link = link_loads(problem, a).reshape(len(a), -1).max(axis=1)
    return np.maximum(np.maximum(m * busy, m * link), critical_paths(problem, a))


def objective_values(problem: PlacementProblem, a: np.ndarray, objective: str) -> np.ndarray:
    """[N] the named objective (``throughput``: cycle time, ``latency``: critical path) of each assignment."""
    if objective not in OBJECTIVES:
        raise PlacementProblemError(f"objective must be one of {', '.join(OBJECTIVES)} (got {objective!r})")
    return cycle_times(problem, a) if objective == "throughput" else critical_paths(problem, a)


def memory_use(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
    """[N, D] bytes of items resident on each device (an item lives where some kernel reading it runs)."""
    nd = problem.times.shape[1]
    if problem.memory is None:
        return np.zeros((len(a), nd))
    e = problem.edge_arrays
    held = np.zeros((len(e.items), len(a), nd), dtype=bool)  # items in the order readers() lists them
    held[e.read_item[None, :], np.arange(len(a))[:, None], a[:, e.read_kernel]] = True
    if not len(e.items):
        return np.zeros((len(a), nd))
    sizes = problem.memory.item_bytes[e.items]
    if len(a) <= _FEW_ASSIGNMENTS:  # Python floats, held items only: the same additions (x + 0.0 is x)
        out = np.zeros((len(a), nd))
        for n, d in np.ndindex(len(a), nd):
            total = 0.0
            for size in sizes[held[:, n, d]].tolist():
                total += size
            out[n, d] = total
        return out
    use = held[0] * sizes[0]
    for j in range(1, len(sizes)):  # summed item after item: the same sums as adding them one by one
        use += held[j] * sizes[j]
    return use


def memory_fits(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
    """[N] whether each assignment's resident items fit every device's capacity."""
    return fits(problem, memory_use(problem, a))


def fits(problem: PlacementProblem, use: np.ndarray) -> np.ndarray:
    """[N] whether resident bytes ``use`` [N, D] (:func:`memory_use`) fit every device's capacity."""
    if problem.memory is None:
        return np.ones(len(use), dtype=bool)
    return (use <= problem.memory.capacity * (1 + _MEMORY_SLACK)).all(axis=1)


def solve_by_enumeration(problem: PlacementProblem, objective: str = "throughput") -> Placement:
    """The optimal placement by trying every assignment (small problems only)."""
    a = all_assignments(problem)
    if len(a) == 0:
        raise PlacementProblemError("no assignment satisfies the pinned, together and memory constraints")
    values = objective_values(problem, a, objective)
    best = int(np.argmin(values))
    return Placement(tuple(int(x) for x in a[best]), objective, float(values[best]), float(values[best]), 0.0, True)
