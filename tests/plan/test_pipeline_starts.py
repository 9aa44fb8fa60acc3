"""The solver's contiguous-pipeline starts cut each device order where numpy's searchsorted would: the stage
bounds come from bisecting Python lists, which must give the same placements on every problem."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tessera.plan.heuristics import _device_orders, _groups, allowed_matrix, pipeline_assignments, repair
from tessera.plan.problem import PlacementProblem


def searchsorted_pipelines(problem: PlacementProblem) -> list[np.ndarray]:
    """The pipelines as first written, with ``np.searchsorted`` on the prefix sums' columns."""
    k, nd = problem.times.shape
    ok, groups = allowed_matrix(problem), _groups(problem)
    finite = np.where(ok, problem.times, 0.0)
    big = 10.0 * float(finite.sum()) + 1.0
    prefix = np.vstack([np.zeros(nd), np.cumsum(np.where(ok, problem.times, big), axis=0)])
    out = []
    for order in _device_orders(nd, finite):
        def split(cap, order=order):
            bounds, b = [0], 0
            for d in order:
                b = int(np.searchsorted(prefix[:, d], prefix[b, d] + cap, side="right")) - 1
                bounds.append(b)
                if b >= k:
                    return bounds
            return None

        lo, hi = 0.0, max(float(prefix[k, d]) for d in order)
        for _ in range(50):
            mid = (lo + hi) / 2
            if split(mid) is not None:
                hi = mid
            else:
                lo = mid
        bounds = split(hi)
        a = np.empty(k, dtype=np.int64)
        for d, (lo_, hi_) in zip(order, itertools.pairwise(bounds), strict=False):
            a[lo_:min(hi_, k)] = d
        fixed = repair(problem, a, ok, groups)
        if fixed is not None:
            out.append(fixed)
    return out


@pytest.mark.parametrize(("seed", "devices"), [(s, d) for s in range(4) for d in (2, 3, 5, 8)])
def test_pipeline_starts_equal_the_searchsorted_ones(seed, devices):
    rng = np.random.default_rng(seed)
    k = 40
    times = rng.uniform(1e-6, 1e-3, (k, devices))
    times[rng.random((k, devices)) < 0.1] = np.inf  # some kernels cannot run on some devices
    times[np.isinf(times).all(axis=1), 0] = 1e-4
    times[rng.integers(0, k, 5)] *= 50  # a few long kernels: ties and empty stages
    bandwidth = np.full((devices, devices), 1e10)
    np.fill_diagonal(bandwidth, np.inf)
    p = PlacementProblem([f"d{i}" for i in range(devices)], times, [(i, i + 1, 1e5) for i in range(k - 1)],
                         bandwidth, np.full((devices, devices), 1e-6), micro_batches=2)
    got, want = pipeline_assignments(p), searchsorted_pipelines(p)
    assert len(got) == len(want) > 0
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
