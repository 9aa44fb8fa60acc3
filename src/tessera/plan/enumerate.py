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


def link_loads(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
    """[N, D, D] seconds each directed link transfers per micro-batch (cut edges and cut loop edges)."""
    nd = problem.times.shape[1]
    link = np.zeros((len(a), nd, nd))
    rows = np.arange(len(a))
    for (src, dst, nbytes), count in zip(problem.edges, problem.messages, strict=True):
        np.add.at(link, (rows, a[:, src], a[:, dst]), problem.transfer_matrix(nbytes, count)[a[:, src], a[:, dst]])
    for src, dst, nbytes, count in problem.loop_edges:
        np.add.at(link, (rows, a[:, src], a[:, dst]), problem.transfer_matrix(nbytes, count)[a[:, src], a[:, dst]])
    return link


def critical_paths(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
    """[N] latency objective: the longest path of compute plus cut-edge transfers, plus the transfers of
    cut loop edges (a constant term: the chain of layers crosses every layer boundary)."""
    k = problem.kernels
    t = problem.times[np.arange(k), a]
    finish = np.zeros_like(t, dtype=float)
    preds: dict[int, list[tuple[int, np.ndarray]]] = {}
    for (src, dst, nbytes), count in zip(problem.edges, problem.messages, strict=True):
        preds.setdefault(dst, []).append((src, problem.transfer_matrix(nbytes, count)))
    for j in range(k):
        start = np.zeros(len(a))
        for src, cost in preds.get(j, []):
            start = np.maximum(start, finish[:, src] + cost[a[:, src], a[:, j]])
        finish[:, j] = start + t[:, j]
    loops = np.zeros(len(a))
    for src, dst, nbytes, count in problem.loop_edges:
        loops += problem.transfer_matrix(nbytes, count)[a[:, src], a[:, dst]]
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
    use = np.zeros((len(a), nd))
    if problem.memory is None:
        return use
    rows = np.arange(len(a))
    for w, readers in problem.memory.readers().items():
        held = np.zeros((len(a), nd), dtype=bool)
        for i in set(readers):
            held[rows, a[:, i]] = True
        use += held * problem.memory.item_bytes[w]
    return use


def memory_fits(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
    """[N] whether each assignment's resident items fit every device's capacity."""
    if problem.memory is None:
        return np.ones(len(a), dtype=bool)
    cap = problem.memory.capacity
    return (memory_use(problem, a) <= cap * (1 + _MEMORY_SLACK)).all(axis=1)


def solve_by_enumeration(problem: PlacementProblem, objective: str = "throughput") -> Placement:
    """The optimal placement by trying every assignment (small problems only)."""
    a = all_assignments(problem)
    if len(a) == 0:
        raise PlacementProblemError("no assignment satisfies the pinned, together and memory constraints")
    values = objective_values(problem, a, objective)
    best = int(np.argmin(values))
    return Placement(tuple(int(x) for x in a[best]), objective, float(values[best]), float(values[best]), 0.0, True)
