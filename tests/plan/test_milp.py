"""The placement MILP (HiGHS) is exact: its optimum equals exhaustive enumeration on small problems.

The enumerator is the reference: hand-computed cases check it against the objective's definition
(problem.py), and random cases check the MILP against it with micro-batches, per-edge message counts,
loop edges and memory capacities that forbid replicating everything.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tessera.plan.enumerate import (
    all_assignments,
    critical_paths,
    cycle_times,
    memory_fits,
    memory_use,
    objective_values,
    solve_by_enumeration,
)
from tessera.plan.milp import SolverError, solve_placement
from tessera.plan.problem import MICRO_BATCHES, MemorySpec, PlacementProblem, PlacementProblemError


def random_problem(seed: int, kernels: int, devices: int, *, constraints: bool = False, extras: bool = False,
                   micro_batches: int = 1) -> PlacementProblem:
    """Kernels with device-dependent speeds, a chain plus skip edges; ``extras`` adds message counts, loop
    edges and items whose capacity forbids holding them all on one device."""
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
    messages, memory, loops = None, None, []
    if extras:
        messages = [float(c) for c in rng.integers(1, 5, size=len(edges))]
        loops = [(kernels - 1, 0, float(rng.uniform(1e5, 4e6)), 3.0),  # layer l's output -> layer l+1's input
                 (int(rng.integers(kernels)), int(rng.integers(kernels)), float(rng.uniform(1e4, 1e6)), 2.0)]
        items = kernels // 2
        item_bytes = rng.uniform(1e9, 8e9, size=items)
        reads = [(i, int(rng.integers(items))) for i in range(kernels)]
        held = np.zeros(items, dtype=bool)
        held[[w for _, w in reads]] = True
        capacity = np.full(devices, 0.7 * item_bytes[held].sum())  # no device holds every item
        memory = MemorySpec(item_bytes, reads, capacity)
    return PlacementProblem([f"dev{d}" for d in range(devices)], times, edges, bandwidth, latency, pinned, together,
                            micro_batches, messages, memory, loops)


def assert_matches_enumeration(p: PlacementProblem, objective: str) -> None:
    best = solve_by_enumeration(p, objective)
    milp = solve_placement(p, objective, gap=1e-9)
    assert milp.optimal
    assert milp.value == pytest.approx(best.value, rel=1e-6)
    assert milp.bound <= milp.value * (1 + 1e-6)
    assert milp.solve_s > 0
    # the MILP's assignment is feasible and really achieves its value (the enumerator's evaluator)
    a = np.array([milp.assignment])
    assert memory_fits(p, a)[0]
    assert all(np.isfinite(p.times[i, d]) for i, d in enumerate(milp.assignment))
    assert objective_values(p, a, objective)[0] == pytest.approx(milp.value, rel=1e-6)


CASES = [(seed, 14, 2) for seed in range(4)] + [(seed, 10, 3) for seed in range(4)]


@pytest.mark.parametrize("objective", ["throughput", "latency"])
@pytest.mark.parametrize("seed,kernels,devices", CASES)
def test_milp_optimum_equals_enumeration(seed, kernels, devices, objective):
    assert_matches_enumeration(random_problem(seed, kernels, devices, constraints=seed % 2 == 1), objective)


@pytest.mark.parametrize("micro_batches", MICRO_BATCHES)
@pytest.mark.parametrize("seed,kernels,devices", [(10, 14, 2), (11, 14, 2), (12, 10, 3), (13, 10, 3)])
def test_milp_equals_enumeration_with_micro_batches_messages_loops_and_memory(seed, kernels, devices,
                                                                              micro_batches):
    p = random_problem(seed, kernels, devices, constraints=seed % 2 == 1, extras=True, micro_batches=micro_batches)
    everything_on_one = np.array([[d] * kernels for d in range(devices)])
    assert not memory_fits(p, everything_on_one).any()  # memory really binds
    for objective in ("throughput", "latency"):
        assert_matches_enumeration(p, objective)


def test_throughput_terms_by_hand():
    # two 1 ms kernels, identical devices, 1 MB edge over 1 GB/s (1 ms) + 0.5 ms latency per message
    p = PlacementProblem(["a", "b"], np.full((2, 2), 1e-3), [(0, 1, 1e6)], np.full((2, 2), 1e9),
                         np.full((2, 2), 5e-4), messages=[2.0])
    together, apart = np.array([[0, 0]]), np.array([[0, 1]])
    assert critical_paths(p, together)[0] == pytest.approx(2e-3)
    assert critical_paths(p, apart)[0] == pytest.approx(1e-3 + 2e-3 + 1e-3)  # 2 messages x 0.5 ms + 1 ms
    assert cycle_times(p, apart)[0] == pytest.approx(4e-3)  # M = 1: the critical path
    p4 = replace(p, micro_batches=4)
    assert cycle_times(p4, together)[0] == pytest.approx(8e-3)  # 4 x 2 ms busy
    assert cycle_times(p4, apart)[0] == pytest.approx(8e-3)  # 4 x 2 ms on the link a->b
    p8 = replace(p, micro_batches=8, messages=[1.0])
    assert cycle_times(p8, apart)[0] == pytest.approx(8 * 1.5e-3)  # link: 1.5 ms; busy: 1 ms
    r = solve_placement(replace(p, micro_batches=8, latency=np.zeros((2, 2)), bandwidth=np.full((2, 2), 2e9)))
    assert r.assignment in ((0, 1), (1, 0)) and r.value == pytest.approx(8 * 1e-3)  # link 0.5 ms < busy 1 ms


def test_loop_edges_load_links_and_add_to_the_critical_path():
    # kernel 1 (layer l) feeds kernel 0 (layer l+1): 2 MB at 1 GB/s plus 3 messages x 1 ms = 5 ms if cut
    p = PlacementProblem(["a", "b"], np.array([[1e-3, 9e-3], [9e-3, 1e-3]]), [], np.full((2, 2), 1e9),
                         np.full((2, 2), 1e-3), loop_edges=[(1, 0, 2e6, 3.0)], micro_batches=2)
    apart = np.array([[0, 1]])
    assert critical_paths(p, apart)[0] == pytest.approx(1e-3 + 5e-3)  # longest kernel + the loop transfer
    assert cycle_times(p, apart)[0] == pytest.approx(2 * 5e-3)  # link b->a carries 5 ms per micro-batch
    assert cycle_times(p, np.array([[0, 0]]))[0] == pytest.approx(2 * 10e-3)  # busy a: 10 ms
    for objective in ("throughput", "latency"):
        assert solve_placement(p, objective).value == pytest.approx(solve_by_enumeration(p, objective).value)
    assert solve_placement(p, "latency").assignment == (0, 1)  # 6 ms < 10 ms on one device


def test_memory_residency_by_hand():
    # items of 6 and 3 GB; kernel 0 reads both, kernel 1 reads item 0: an item lives wherever a reader runs
    mem = MemorySpec(np.array([6e9, 3e9]), [(0, 0), (0, 1), (1, 0)], np.array([10e9, 7e9]))
    p = PlacementProblem(["a", "b"], np.array([[1.0, 2.0], [2.0, 1.0]]) * 1e-3, [(0, 1, 1e3)],
                         np.full((2, 2), 1e12), np.zeros((2, 2)), memory=mem)
    a = np.array([[0, 0], [0, 1], [1, 1]])
    assert memory_use(p, a).tolist() == [[9e9, 0], [9e9, 6e9], [0, 9e9]]
    assert memory_fits(p, a).tolist() == [True, True, False]  # b holds 7 GB
    assert sorted(map(tuple, all_assignments(p).tolist())) == [(0, 0), (0, 1)]
    assert solve_placement(p, "latency").assignment == (0, 1)


def test_infeasible_memory_names_the_device_and_the_shortfall():
    # 6 GB items, one per kernel; a holds 10 GB, b 5 GB: at best b lacks 1 GB (a cannot take both)
    mem = MemorySpec(np.array([6e9, 6e9]), [(0, 0), (1, 1)], np.array([10e9, 5e9]))
    p = PlacementProblem(["a", "b"], np.ones((2, 2)) * 1e-3, [(0, 1, 1e3)], np.full((2, 2), 1e9),
                         np.zeros((2, 2)), memory=mem)
    with pytest.raises(SolverError, match=r"b lacks 1 GB \(holds 6 GB of items, capacity 5 GB\)"):
        solve_placement(p)
    with pytest.raises(PlacementProblemError, match="no assignment"):
        solve_by_enumeration(p)
    pinned = replace(p, pinned={0: 0, 1: 1}, together=[(0, 1)])  # the constraints alone are infeasible
    with pytest.raises(SolverError, match="pinned and together"):
        solve_placement(pinned, "latency")


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
    p = random_problem(7, 40, 4)
    start = tuple([int(np.argmin(p.times.sum(axis=0)))] * p.kernels)
    value = float(objective_values(p, np.array([start]), objective)[0])
    r = solve_placement(p, objective, time_limit_s=0.05, start=start)
    assert r.value <= value * (1 + 1e-6)
    assert float(objective_values(p, np.array([r.assignment]), objective)[0]) == pytest.approx(r.value, rel=1e-6)
    with pytest.raises(PlacementProblemError, match="start assignment"):
        solve_placement(p, objective, start=(0,))
    with pytest.raises(PlacementProblemError, match="pinned"):
        solve_placement(replace(p, pinned={3: (start[3] + 1) % 4}), objective, start=start)


# ---- the relaxation's bound and the heuristics ------------------------------------------------------------


@pytest.mark.parametrize("micro_batches", [1, 4])
@pytest.mark.parametrize("seed,kernels,devices", [(20, 12, 2), (21, 9, 3), (23, 9, 3)])
def test_relaxation_bound_never_exceeds_the_optimum(seed, kernels, devices, micro_batches):
    from tessera.plan.milp import _relaxation_lp, balance_bound, simple_bound

    p = random_problem(seed, kernels, devices, constraints=seed % 2 == 0, extras=True, micro_batches=micro_batches)
    for objective in ("throughput", "latency"):
        optimum = solve_by_enumeration(p, objective).value
        relaxation = _relaxation_lp(p, objective, 10.0)
        assert 0 < relaxation.bound <= optimum * (1 + 1e-7)
        assert 0 < simple_bound(p, objective) <= relaxation.bound * (1 + 1e-7)
        if objective == "throughput":
            assert 0 < balance_bound(p, 10.0) <= relaxation.bound * (1 + 1e-7)
        assert relaxation.split.shape == p.times.shape


def test_evaluator_window_moves_are_exact():
    from tessera.plan.heuristics import Evaluator, repair

    rng = np.random.default_rng(5)
    checked = 0
    for seed in range(6):
        p = random_problem(30 + seed, 14, 3, constraints=seed % 2 == 1, extras=seed % 3 != 0,
                           micro_batches=[1, 4][seed % 2])
        if p.memory is not None:  # room for some moves
            p = replace(p, memory=replace(p.memory, capacity=p.memory.capacity * 1.6))
        for objective in ("throughput", "latency"):
            a = repair(p, rng.integers(0, 3, size=14))
            while not memory_fits(p, a[None])[0]:
                a = repair(p, rng.integers(0, 3, size=14))
            ev = Evaluator(p, objective, a)
            assert ev.value() == pytest.approx(objective_values(p, a[None], objective)[0], rel=1e-12)
            for _ in range(60):
                i = int(rng.integers(0, 14))
                j = int(rng.integers(i + 1, 15))
                move = ev.window_move(i, j, int(rng.integers(0, 3)), ev.value(), 40.0)
                if move is None:
                    continue
                b = np.array(ev.a)
                b[i:j] = move.device
                exact = objective_values(p, b[None], objective)[0]
                assert move.value == pytest.approx(exact, rel=1e-9)
                ev.apply(move)
                assert ev.value() == pytest.approx(exact, rel=1e-9)
                assert memory_fits(p, b[None])[0]
                checked += 1
    assert checked > 200


def test_incremental_paths_and_pruning_match_a_fresh_evaluation():
    """After every applied move the incrementally updated paths equal a fresh evaluator's, and pruning
    (prune=True) never drops a move that lowers the soft maximum."""
    from tessera.plan.heuristics import Evaluator, repair

    rng = np.random.default_rng(7)
    kept = pruned = 0
    for seed in range(4):
        p = random_problem(60 + seed, 16, 3, constraints=seed % 2 == 1, extras=seed >= 2, micro_batches=4)
        if p.memory is not None:
            p = replace(p, memory=replace(p.memory, capacity=p.memory.capacity * 1.6))
        a = repair(p, rng.integers(0, 3, size=16))
        while not memory_fits(p, a[None])[0]:
            a = repair(p, rng.integers(0, 3, size=16))
        ev = Evaluator(p, "throughput", a)
        for _ in range(40):
            ref = ev.value()
            for i in range(16):
                for j in range(i + 1, min(i + 6, 16) + 1):
                    for e in range(3):
                        full = ev.window_move(i, j, e, ref, 80.0)
                        if full is not None and full.potential < -1e-9:
                            assert ev.window_move(i, j, e, ref, 80.0, prune=True) is not None
                            kept += 1
                        elif full is not None:
                            pruned += ev.window_move(i, j, e, ref, 80.0, prune=True) is None
            i = int(rng.integers(0, 16))
            move = ev.window_move(i, int(rng.integers(i + 1, 17)), int(rng.integers(0, 3)), ref, 80.0)
            if move is None:
                continue
            ev.apply(move)
            fresh = Evaluator(p, "throughput", ev.a)
            for name in ("fin", "tail", "before", "after"):
                np.testing.assert_allclose(getattr(ev, name), getattr(fresh, name), rtol=1e-12, atol=1e-15)
            assert ev.critical == fresh.critical
            np.testing.assert_allclose(ev.own_prefix, fresh.own_prefix, rtol=1e-12, atol=1e-15)
    assert kept > 100 and pruned > 100


def test_pipelines_cut_a_chain_into_balanced_stages():
    from tessera.plan.heuristics import pipeline_assignments

    # 6 kernels of 1 ms on device a, 2 ms on b (b is half as fast): the best two-stage split gives a 4
    # kernels and b 2 (4 ms each)
    times = np.array([[1.0, 2.0]] * 6) * 1e-3
    p = PlacementProblem(["a", "b"], times, [(i, i + 1, 1.0) for i in range(5)], np.full((2, 2), 1e12),
                         np.zeros((2, 2)), micro_batches=2)
    stages = {tuple(a) for a in pipeline_assignments(p)}
    assert (0, 0, 0, 0, 1, 1) in stages and (1, 1, 0, 0, 0, 0) in stages
    assert min(cycle_times(p, np.array(sorted(stages)))) == pytest.approx(2 * 4e-3)


@pytest.mark.parametrize("objective", ["throughput", "latency"])
def test_heuristic_placements_are_feasible_and_near_optimal(objective):
    from tessera.plan.heuristics import best_start

    for seed in (40, 41):
        p = random_problem(seed, 12, 3, constraints=True, extras=True, micro_batches=4)
        value, a = best_start(p, objective, 0.5)
        assert memory_fits(p, a[None])[0]
        assert a[0] == 0 and a[2] == a[11] and np.isfinite(p.times[np.arange(12), a]).all()
        assert value == pytest.approx(objective_values(p, a[None], objective)[0], rel=1e-12)
        assert value <= 1.25 * solve_by_enumeration(p, objective).value


def test_a_loose_gap_returns_early_with_an_honest_bound():
    p = random_problem(50, 14, 2, extras=True, micro_batches=4)
    optimum = solve_by_enumeration(p, "throughput").value
    r = solve_placement(p, "throughput", gap=0.05)
    assert r.optimal and r.gap <= 0.05
    assert r.bound <= optimum * (1 + 1e-7) <= r.value * (1 + 1e-7)
    assert r.value <= optimum / 0.95 * (1 + 1e-9)
    assert r.gap == pytest.approx((r.value - r.bound) / r.value)


def test_a_large_problem_returns_within_its_time_limit():
    rng = np.random.default_rng(3)
    k, nd = 400, 4
    times = rng.lognormal(np.log(20e-6), 1.0, size=(k, nd))
    edges = [(i, i + 1, 6.5e4) for i in range(k - 1)] + [(i, i + 7, 6.5e4) for i in range(0, k - 7, 5)]
    p = PlacementProblem([f"d{d}" for d in range(nd)], times, edges, np.full((nd, nd), 3.125e9),
                         np.full((nd, nd), 5e-6), micro_batches=4)
    r = solve_placement(p, "throughput", gap=0.01, time_limit_s=2.0)
    assert r.solve_s < 3.0
    assert r.bound <= r.value and r.gap == pytest.approx((r.value - r.bound) / r.value)
    assert cycle_times(p, np.array([r.assignment]))[0] == pytest.approx(r.value, rel=1e-9)
    single = min(cycle_times(p, np.full((1, k), d))[0] for d in range(nd))
    assert r.value < 0.5 * single  # four devices in a pipeline, not one
