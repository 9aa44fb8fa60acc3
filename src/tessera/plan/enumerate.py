"""Exact objective of every assignment of a small placement problem, by vectorised enumeration."""

from __future__ import annotations

import itertools

import numpy as np

from tessera.plan.problem import Placement, PlacementProblem, PlacementProblemError

MAX_ASSIGNMENTS = 2_000_000


def all_assignments(problem: PlacementProblem) -> np.ndarray:
    """[N, K] every assignment that respects pinned kernels, ``together`` pairs and allowed devices."""
    k, d = problem.times.shape
    if d**k > MAX_ASSIGNMENTS:
        raise PlacementProblemError(f"{d}^{k} assignments are too many to enumerate (limit {MAX_ASSIGNMENTS})")
    a = np.array(list(itertools.product(range(d), repeat=k)), dtype=np.int64).reshape(-1, k)
    keep = np.isfinite(problem.times[np.arange(k), a]).all(axis=1)
    for i, dev in problem.pinned.items():
        keep &= a[:, i] == dev
    for i, j in problem.together:
        keep &= a[:, i] == a[:, j]
    return a[keep]


def cycle_times(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
    """Throughput objective of each assignment: the busiest device or directed link."""
    k, d = problem.times.shape
    t = problem.times[np.arange(k), a]  # [N, K]
    busy = np.stack([(t * (a == dev)).sum(axis=1) for dev in range(d)], axis=1)
    link = np.zeros((len(a), d, d))
    rows = np.arange(len(a))
    for src, dst, nbytes in problem.edges:
        cost = problem.transfer_matrix(nbytes)[a[:, src], a[:, dst]]
        np.add.at(link, (rows, a[:, src], a[:, dst]), cost)
    return np.maximum(busy.max(axis=1), link.reshape(len(a), -1).max(axis=1))


def critical_paths(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
    """Latency objective of each assignment: the longest path of compute plus cut-edge transfers."""
    k = problem.kernels
    t = problem.times[np.arange(k), a]
    finish = np.zeros_like(t)
    preds: dict[int, list[tuple[int, float]]] = {}
    for src, dst, nbytes in problem.edges:
        preds.setdefault(dst, []).append((src, nbytes))
    for j in range(k):
        start = np.zeros(len(a))
        for src, nbytes in preds.get(j, []):
            start = np.maximum(start, finish[:, src] + problem.transfer_matrix(nbytes)[a[:, src], a[:, j]])
        finish[:, j] = start + t[:, j]
    return finish.max(axis=1)


def solve_by_enumeration(problem: PlacementProblem, objective: str = "throughput") -> Placement:
    """The optimal placement by trying every assignment (small problems only)."""
    a = all_assignments(problem)
    if len(a) == 0:
        raise PlacementProblemError("no assignment satisfies the pinned and together constraints")
    values = cycle_times(problem, a) if objective == "throughput" else critical_paths(problem, a)
    best = int(np.argmin(values))
    return Placement(tuple(int(x) for x in a[best]), objective, float(values[best]), float(values[best]), 0.0, True)
