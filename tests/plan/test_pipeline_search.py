"""The layer-pipeline search keeps what scoring every candidate keeps, and tries one order of interchangeable
devices."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.plan.admission import MemoryShape, admit
from tessera.plan.config import AdmissionConfig
from tessera.plan.pipeline_search import (
    admitted_counts,
    best_pipelines,
    fixed_scorer,
    layer_devices,
    pipelines,
)
from tessera.plan.problem import MemorySpec, PlacementProblem
from tessera.plan.symmetry import canonical, device_classes


def chain(seed: int, layers: int = 9, devices: int = 4, same: bool = False, m: int = 2) -> PlacementProblem:
    """A chain of layers with random times (identical devices where ``same``), one weight item per layer."""
    rng = np.random.default_rng(seed)
    times = rng.uniform(1e-4, 1e-3, (layers, 1 if same else devices)) * np.ones((1, devices))
    bandwidth = np.full((devices, devices), 2e10)
    np.fill_diagonal(bandwidth, np.inf)
    memory = MemorySpec(rng.uniform(1e8, 1e9, layers), [(k, k) for k in range(layers)], np.full(devices, 4e9))
    return PlacementProblem([f"d{i}" for i in range(devices)], times,
                            [(k, k + 1, float(rng.uniform(1e5, 1e7))) for k in range(layers - 1)], bandwidth,
                            np.full((devices, devices), 5e-6), micro_batches=m, memory=memory)


def exhaustive(candidates, layers, scorer, keep=3):
    scored = []
    for order, cuts in candidates:
        stage_of = np.searchsorted(np.array(cuts), np.arange(layers), side="right")
        a = tuple(order[s] for s in stage_of)
        key = scorer.score(a)
        if key is not None:
            scored.append((key, a, order, cuts))
    scored.sort(key=lambda s: s[0])
    return scored[:keep]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("objective", ["throughput", "latency"])
def test_the_bounded_search_keeps_what_scoring_every_candidate_keeps(seed, objective):
    p = chain(seed)
    candidates = list(pipelines(p.kernels, 4))
    scorer = fixed_scorer(p, 64.0, 16, objective)
    got = best_pipelines(candidates, layer_devices(candidates, p.kernels), scorer)
    want = exhaustive(candidates, p.kernels, scorer)
    assert [(s, a, tuple(o), list(c)) for s, a, o, c in got] == [(s, a, tuple(o), list(c)) for s, a, o, c in want]


def test_identical_devices_are_one_class_and_orders_among_them_score_alike():
    p = chain(1, same=True)
    assert device_classes(p) == [0, 0, 0, 0]
    assert device_classes(chain(1)) == [0, 1, 2, 3]
    scorer = fixed_scorer(p, 64.0, 16, "throughput")
    every = list(pipelines(p.kernels, 4))
    firsts = list(pipelines(p.kernels, 4, device_classes(p)))
    assert len(firsts) < len(every) / 4 and all(canonical(o, [0] * 4) for o, _ in firsts)
    # the best of one order per class is the best of all orders
    assert best_pipelines(firsts, layer_devices(firsts, p.kernels), scorer, 1)[0][0] == exhaustive(every, p.kernels, scorer, 1)[0][0]


def test_admitted_counts_are_admits():
    rng = np.random.default_rng(3)
    config = AdmissionConfig()
    capacity = np.array([80e9, 48e9])
    for _ in range(200):
        fixed = rng.uniform(0, 80e9, (1, 2))
        per_seq = rng.uniform(0, 2e9, (1, 2)) * (rng.random((1, 2)) > 0.2)
        cap, m = int(rng.integers(1, 300)), int(rng.choice([1, 2, 4, 8]))
        want = admit(MemoryShape(["a", "b"], capacity, fixed[0], per_seq[0], 100.0), config, cap, m).max_seqs
        assert admitted_counts(fixed, per_seq, capacity * config.memory_utilization, cap, m)[0] == want


@pytest.mark.parametrize("seed", range(4))
def test_the_bounded_search_with_admission_keeps_what_scoring_every_candidate_keeps(seed):
    from tessera.plan.pipeline_search import admitted_scorer

    big, small = chain(seed), chain(seed + 50)
    small.memory.item_bytes = big.memory.item_bytes * 0.8  # state shrinks with the batch
    candidates = list(pipelines(big.kernels, 4))
    scorer = admitted_scorer(big, small, 64, 32, 2, 64.0, np.full(4, 3e9), 1e8, 100.0, list(big.devices),
                             AdmissionConfig())
    got = best_pipelines(candidates, layer_devices(candidates, big.kernels), scorer)
    want = exhaustive(candidates, big.kernels, scorer)
    assert got and [(s, a) for s, a, *_ in got] == [(s, a) for s, a, *_ in want]


def test_layer_devices_put_each_layer_on_its_stage():
    from tessera.plan.pipeline_search import layer_devices

    got = layer_devices([((2, 0), [3]), ((1, 3, 0), [1, 4]), ((0, 1), [5])], 6)
    assert got.tolist() == [[2, 2, 2, 0, 0, 0], [1, 3, 3, 3, 0, 0], [0, 0, 0, 0, 0, 1]]
