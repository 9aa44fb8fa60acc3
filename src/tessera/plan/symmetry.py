"""Interchangeable targets: devices a placement problem cannot tell apart (the same kernel times, links and
memory), so that a search over device orders need only try one order of each class of orders.

Swapping two interchangeable devices in an assignment leaves every figure of :mod:`tessera.plan.step_evaluation`
unchanged (busy times and link loads are permuted, critical paths and schedules are the same sums), so of
the orders a permutation within classes maps onto each other only the first in lexicographic order is needed
(:func:`canonical`): each class's members are used from its lowest index up. Local cpu workers (``cpu:8``)
are one class of eight; a cluster of two GPU types has no two interchangeable targets.
"""

from __future__ import annotations

import numpy as np

from tessera.plan.problem import PlacementProblem


def _swappable(problem: PlacementProblem, i: int, j: int) -> bool:
    """Whether swapping devices i and j maps the problem onto itself."""
    perm = np.arange(len(problem.devices))
    perm[[i, j]] = [j, i]
    same = (np.array_equal(problem.times[:, i], problem.times[:, j])
            and np.array_equal(problem.bandwidth[np.ix_(perm, perm)], problem.bandwidth)
            and np.array_equal(problem.latency[np.ix_(perm, perm)], problem.latency)
            and all(d not in (i, j) for d in problem.pinned.values()))
    if same and problem.memory is not None:
        same = bool(problem.memory.capacity[i] == problem.memory.capacity[j])
    return same


def device_classes(*problems: PlacementProblem) -> list[int]:
    """Per device, the lowest index of the devices interchangeable with it in every one of ``problems``
    (same devices in each)."""
    d = len(problems[0].devices)
    out = list(range(d))
    for j in range(d):
        for i in range(j):
            if out[i] == i and all(_swappable(p, i, j) for p in problems):
                out[j] = i
                break
    return out


def canonical(order: tuple[int, ...], classes: list[int]) -> bool:
    """Whether ``order`` (distinct devices) is the first of its class of equivalent orders: every class's
    devices are used from its lowest index up, in order of use."""
    members: dict[int, list[int]] = {}
    for dev, cls in enumerate(classes):
        members.setdefault(cls, []).append(dev)
    used: dict[int, int] = {}
    for dev in order:
        cls = classes[dev]
        n = used.get(cls, 0)
        if members[cls][n] != dev:
            return False
        used[cls] = n + 1
    return True
