"""The vectorised evaluators of `tessera.plan.enumerate` give exactly the figures of their literal definitions
(one edge, one item after another), for one assignment and for many."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.plan import enumerate as enumerate_module
from tessera.plan.enumerate import critical_paths, link_loads, memory_fits, memory_use
from tessera.plan.problem import MemorySpec, PlacementProblem
from tessera.plan.step_evaluation import evaluate


def literal_link_loads(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
    nd = problem.times.shape[1]
    link = np.zeros((len(a), nd, nd))
    rows = np.arange(len(a))
    for (src, dst, nbytes), count in zip(problem.edges, problem.messages, strict=True):
        np.add.at(link, (rows, a[:, src], a[:, dst]), problem.transfer_matrix(nbytes, count)[a[:, src], a[:, dst]])
    for src, dst, nbytes, count in problem.loop_edges:
        np.add.at(link, (rows, a[:, src], a[:, dst]), problem.transfer_matrix(nbytes, count)[a[:, src], a[:, dst]])
    return link


def literal_critical_paths(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
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


def literal_memory_use(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
    nd = problem.times.shape[1]
    use = np.zeros((len(a), nd))
    rows = np.arange(len(a))
    for w, readers in problem.memory.readers().items():
        held = np.zeros((len(a), nd), dtype=bool)
        for i in set(readers):
            held[rows, a[:, i]] = True
        use += held * problem.memory.item_bytes[w]
    return use


def random_problem(seed: int, k: int = 14, d: int = 3) -> PlacementProblem:
    rng = np.random.default_rng(seed)
    edges = sorted({(int(s), int(t)) for s, t in rng.integers(0, k, (3 * k, 2)) if s < t})
    bandwidth = rng.uniform(1e9, 5e10, (d, d))
    np.fill_diagonal(bandwidth, np.inf)
    items = rng.uniform(1e6, 1e9, 9)
    reads = sorted({(int(i), int(w)) for i, w in zip(rng.integers(0, k, 20), rng.integers(0, 9, 20), strict=True)})
    return PlacementProblem(
        [f"d{i}" for i in range(d)], rng.uniform(1e-6, 1e-3, (k, d)),
        [(s, t, float(rng.uniform(0, 1e7))) for s, t in edges], bandwidth, rng.uniform(1e-6, 1e-5, (d, d)),
        micro_batches=2, messages=[float(x) for x in rng.integers(1, 4, len(edges))],
        memory=MemorySpec(items, reads, np.full(d, 2e9)),
        loop_edges=[(int(rng.integers(0, k)), int(rng.integers(0, k)), float(rng.uniform(0, 1e6)), 2.0)
                    for _ in range(3)])


@pytest.mark.parametrize("summed_at_once", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_vectorised_evaluators_equal_their_literal_definitions(seed, summed_at_once, monkeypatch):
    if not summed_at_once:  # memory use of one assignment too: summed item after item over arrays
        monkeypatch.setattr(enumerate_module, "_FEW_ASSIGNMENTS", 0)
    p = random_problem(seed)
    many = np.random.default_rng(seed + 100).integers(0, 3, (40, p.kernels))
    for a in (many, many[:1], many[7:8]):
        assert np.array_equal(link_loads(p, a), literal_link_loads(p, a))
        assert np.array_equal(critical_paths(p, a), literal_critical_paths(p, a))
        assert np.array_equal(memory_use(p, a), literal_memory_use(p, a))
        cap = p.memory.capacity * (1 + 1e-9)
        assert np.array_equal(memory_fits(p, a), (literal_memory_use(p, a) <= cap).all(axis=1))


def test_an_evaluation_is_computed_once_per_problem_and_assignment():
    p = random_problem(3)
    a = np.random.default_rng(7).integers(0, 3, p.kernels)
    first = evaluate(p, a)
    assert evaluate(p, a.tolist()) is first and evaluate(p, tuple(int(x) for x in a)) is first
    assert len(p.evaluations) == 1
    fresh = random_problem(3)  # the same problem built again: nothing remembered, the same answer
    assert not fresh.evaluations and evaluate(fresh, a) == first
    other = (a + 1) % 3
    assert evaluate(p, other) != first and evaluate(p, other) == evaluate(random_problem(3), other)
    assert len(p.evaluations) == 2
