"""The placement MILP (HiGHS) is exact: its optimum equals exhaustive enumeration on small problems."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.plan.enumerate import solve_by_enumeration
from tessera.plan.milp import SolverError, solve_placement
from tessera.plan.problem import PlacementProblem, PlacementProblemError


def random_problem(seed: int, kernels: int, devices: int, *, constraints: bool = False) -> PlacementProblem:
    rng = np.random.default_rng(seed)
    # device-dependent speeds: each device is fast for some kernels (the heterogeneity placement exploits)
    times = rng.lognormal(mean=np.log(50e-6), sigma=0.8, size=(kernels, devices))
    edges = [(i, i + 1, float(rng.uniform(1e4, 2e6))) for i in range(kernels - 1)]
    for _ in range(kernels // 2):  # skip connections (residuals, KV reads)
        i, j = sorted(rng.choice(kernels, size=2, replace=False))
        edges.append((int(i), int(j), float(rng.uniform(1e4, 2e6))))
    bandwidth = rng.uniform(3e9, 50e9, size=(devices, devices))
    latency = rng.uniform(1e-6, 2e-5, size=(devices, devices))
    pinned, together = {}, []
    if constraints:
        times[rng.integers(kernels), rng.integers(devices)] = np.inf  # a kernel that cannot run somewhere
        pinned = {0: 0}
        together = [(2, kernels - 1)]
    return PlacementProblem([f"dev{d}" for d in range(devices)], times, edges, bandwidth, latency, pinned, together)


CASES = [(seed, 14, 2) for seed in range(4)] + [(seed, 10, 3) for seed in range(4)]


@pytest.mark.parametrize("objective", ["throughput", "latency"])
@pytest.mark.parametrize("seed,kernels,devices", CASES)
def test_milp_optimum_equals_enumeration(seed, kernels, devices, objective):
    p = random_problem(seed, kernels, devices, constraints=seed % 2 == 1)
    best = solve_by_enumeration(p, objective)
    milp = solve_placement(p, objective, gap=1e-9)
    assert milp.optimal
    assert milp.value == pytest.approx(best.value, rel=1e-6)
    assert milp.bound <= milp.value * (1 + 1e-6)
    # the MILP's assignment really achieves its value (re-verified by the enumerator's evaluator)
    again = solve_by_enumeration(PlacementProblem(p.devices, p.times, p.edges, p.bandwidth, p.latency,
                                                  {i: d for i, d in enumerate(milp.assignment)}), objective)
    assert again.value == pytest.approx(milp.value, rel=1e-6)


def test_constraints_are_respected():
    p = random_problem(1, 10, 3, constraints=True)
    for objective in ("throughput", "latency"):
        a = solve_placement(p, objective).assignment
        assert a[0] == 0 and a[2] == a[9]
        assert all(np.isfinite(p.times[i, d]) for i, d in enumerate(a))


def test_a_slow_link_keeps_a_chain_on_one_device():
    times = np.array([[1.0, 2.0], [2.0, 1.0], [1.0, 2.0]]) * 1e-3
    edges = [(0, 1, 1e9), (1, 2, 1e9)]  # 1 GB between kernels: any cut costs far more than compute
    slow = PlacementProblem(["a", "b"], times, edges, np.full((2, 2), 1e9), np.full((2, 2), 1e-5))
    assert len(set(solve_placement(slow, "latency").assignment)) == 1
    fast = PlacementProblem(["a", "b"], times, [(0, 1, 1.0), (1, 2, 1.0)], np.full((2, 2), 1e12),
                            np.zeros((2, 2)))
    assert solve_placement(fast, "latency").assignment == (0, 1, 0)  # each kernel on its faster device


def test_infeasible_and_bad_problems():
    times = np.ones((3, 2))
    p = PlacementProblem(["a", "b"], times, [], np.ones((2, 2)), np.zeros((2, 2)), pinned={0: 0, 1: 1},
                         together=[(0, 1)])
    with pytest.raises(SolverError, match="infeasible"):
        solve_placement(p)
    with pytest.raises(PlacementProblemError, match="objective"):
        solve_placement(PlacementProblem(["a"], np.ones((1, 1)), [], np.ones((1, 1)), np.zeros((1, 1))), "speed")
    with pytest.raises(PlacementProblemError, match="program order"):
        PlacementProblem(["a", "b"], times, [(2, 1, 1.0)], np.ones((2, 2)), np.zeros((2, 2)))
    with pytest.raises(PlacementProblemError, match="cannot run on any device"):
        PlacementProblem(["a", "b"], np.array([[1.0, np.inf], [np.inf, np.inf]]), [], np.ones((2, 2)),
                         np.zeros((2, 2)))
    with pytest.raises(PlacementProblemError, match="2x2"):
        PlacementProblem(["a", "b"], times, [], np.ones((3, 3)), np.zeros((2, 2)))


@pytest.mark.parametrize("objective", ["throughput", "latency"])
def test_a_start_assignment_is_never_lost(objective):
    from tessera.plan.enumerate import critical_paths, cycle_times

    p = random_problem(7, 40, 4)
    start = tuple([int(np.argmin(p.times.sum(axis=0)))] * p.kernels)
    evaluate = cycle_times if objective == "throughput" else critical_paths
    value = float(evaluate(p, np.array([start]))[0])
    r = solve_placement(p, objective, time_limit_s=0.05, start=start)
    assert r.value <= value * (1 + 1e-6)
    assert float(evaluate(p, np.array([r.assignment]))[0]) == pytest.approx(r.value, rel=1e-6)
    with pytest.raises(PlacementProblemError, match="start assignment"):
        solve_placement(p, objective, start=(0,))
