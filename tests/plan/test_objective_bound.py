"""The solver's objective (`tessera.plan.enumerate.objective_values`, what the MILP minimises) bounds the
evaluated step (`tessera.plan.step_evaluation.evaluate`, what plans report) from below, for every assignment:
the throughput objective max(M x busiest device, M x busiest link, critical path) is at most the evaluated
cycle, and the latency objective (the critical path) at most the evaluated critical path. They are not equal:
the list schedule serialises independent kernels on one device, which the objective lets overlap."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.capture.api import trace_model
from tessera.graph.dataflow import colocation_units
from tessera.graph.layers import layer_structure
from tessera.hardware.cluster import parse_cluster
from tessera.plan.build import build_step_problem
from tessera.plan.enumerate import objective_values
from tessera.plan.fold import fold_groups, merge
from tessera.plan.milp import solve_placement
from tessera.plan.problem import MemorySpec, PlacementProblem
from tessera.plan.step_evaluation import evaluate
from tessera.plan.targets import cluster_targets
from tessera.program.placements import synthetic_placement


def assert_bounded(problem: PlacementProblem, assignment) -> tuple[float, float]:
    """The objectives of ``assignment``, checked against its evaluation; (throughput gap, latency gap)."""
    a = np.asarray(assignment)[None, :]
    ev = evaluate(problem, assignment)
    throughput = float(objective_values(problem, a, "throughput")[0])
    latency = float(objective_values(problem, a, "latency")[0])
    assert throughput <= ev.cycle_s * (1 + 1e-12)
    assert latency <= ev.critical_path_s * (1 + 1e-12)
    return ev.cycle_s - throughput, ev.critical_path_s - latency


@pytest.fixture(scope="module")
def traced():
    graph = trace_model("llama-3.1-8b", "decode", batch=8, ctx=256)
    cluster = parse_cluster("A100:1,L40S:1,H100:1")
    return graph, build_step_problem(graph, cluster_targets(cluster), cluster, micro_batches=4)


def test_the_objective_bounds_the_evaluated_step_of_a_traced_graph(traced):
    graph, sp = traced
    p = sp.problem
    units = np.array(colocation_units(graph))
    placements = [[d] * p.kernels for d in range(3)]  # one device
    placements += [synthetic_placement(graph, 3, kind, seed) for kind in ("alternate", "random") for seed in range(3)]
    half = p.kernels // 2
    placements.append([0] * half + [1] * (p.kernels - half))  # a two-stage pipeline
    rng = np.random.default_rng(0)
    placements.append(rng.integers(0, 3, units.max() + 1)[units].tolist())
    folded = merge(p, fold_groups(layer_structure(graph), p.kernels, 4))
    placements.append(folded.unfold(solve_placement(folded.problem, "throughput", gap=0.01, time_limit_s=2).assignment))
    gaps = [assert_bounded(p, a) for a in placements]
    assert any(g > 0 for g, _ in gaps)  # a bound, not the same figure: some placements evaluate above it


def test_the_objective_bounds_the_evaluated_step_of_random_problems():
    rng = np.random.default_rng(1)
    for _ in range(30):
        k, d = int(rng.integers(3, 12)), int(rng.integers(2, 4))
        edges = sorted({(int(s), int(t)) for s, t in rng.integers(0, k, (2 * k, 2)) if s < t})
        bandwidth = rng.uniform(1e9, 1e10, (d, d))
        np.fill_diagonal(bandwidth, np.inf)
        p = PlacementProblem([f"d{i}" for i in range(d)], rng.uniform(1e-6, 1e-3, (k, d)),
                             [(s, t, float(rng.uniform(0, 1e7))) for s, t in edges], bandwidth,
                             rng.uniform(0, 1e-5, (d, d)), micro_batches=int(rng.choice([1, 2, 4, 8])),
                             memory=MemorySpec(np.ones(2), [(0, 0), (k - 1, 1)], np.full(d, 10.0)),
                             loop_edges=[(k - 1, 0, float(rng.uniform(0, 1e6)), 3.0)] if rng.random() < 0.5 else [])
        for a in rng.integers(0, d, (5, k)):
            assert_bounded(p, a)
