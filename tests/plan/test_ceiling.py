"""Candidates of Tessera's search that cannot beat the plan in hand: the cycle floor is below every
assignment's evaluated cycle, the throughput ceiling above every plan the candidate assembles, and skipping
the candidates below the best baseline leaves Tessera's plan as it was."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.hardware.cluster import parse_cluster
from tessera.plan import policies
from tessera.plan.ceiling import MARGIN, cannot_beat, cycle_floor, throughput_ceiling
from tessera.plan.context import PlanContext
from tessera.plan.planner import baselines
from tessera.plan.step_evaluation import evaluate
from tessera.plan.targets import cluster_targets
from tessera.workload import parse_workload

TINY = "fixed:in=16,out=8,requests=4"


def _context(progress=None) -> PlanContext:  # engines admit from memory (no fixed batch)
    return PlanContext("smollm2-135m", parse_cluster("A100:1,L40S:1"), parse_workload(TINY), TINY, gap=0.01,
                       progress=progress)


@pytest.fixture(scope="module")
def ctx():
    return _context()


def test_the_floor_is_below_every_evaluated_cycle(ctx):
    targets = cluster_targets(ctx.cluster, 1)
    rng = np.random.default_rng(0)
    for m in ctx.micro_batch_options(ctx.main_phase):
        problem = ctx.step_problem(ctx.main_phase, targets, m).problem
        floor = cycle_floor(ctx, targets, m, 1)
        assert floor > 0
        for a in [np.zeros(problem.kernels, int), np.ones(problem.kernels, int),
                  *rng.integers(0, 2, size=(6, problem.kernels))]:
            assert floor <= evaluate(problem, a).cycle_s * (1 + 1e-9)


def _by_hand(ctx: PlanContext, targets, m: int, main_on: int, prompt_on: int):
    """Every main-phase kernel on one target, every prefill kernel on one target."""
    out = []
    for ph in ctx.phases:
        mm = m if ph is ctx.main_phase else 1
        on = main_on if ph is ctx.main_phase else prompt_on
        out.append((ph, mm, (on,) * ctx.step_problem(ph, targets, mm).problem.kernels, {}))
    return out


@pytest.mark.parametrize("workload", [TINY, "offline:prompts=azure-conv,out=8,requests=8"])
def test_the_ceiling_is_above_every_plan_of_the_candidate(workload):
    ctx = PlanContext("smollm2-135m", parse_cluster("A100:1,L40S:1"), parse_workload(workload), workload, gap=0.01)
    for r in ctx.replica_counts():
        widest = policies._replica(ctx, r)
        targets = cluster_targets(ctx.cluster, r)
        for m in widest.micro_batch_options(widest.main_phase):
            ceiling = throughput_ceiling(widest, targets, r, m, 1)
            chains = [chosen for follow in (True, False) for chosen in
                      policies._phase_chain(widest, targets, m, "throughput", None, None, follow, follow, memory=False)]
            # the lanes' cases: both phases on one target (taking turns), each alone on its own target
            by_hand = [_by_hand(widest, targets, m, a, b) for a in range(len(targets)) for b in range(len(targets))]
            for chosen in chains + by_hand:
                plan = widest.assemble_admitted("tessera", targets, r, chosen)
                assert plan.throughput <= ceiling * (1 + 1e-9), (r, m, [c[2][:1] for c in chosen])


def test_cannot_beat():
    assert cannot_beat(99.0, 100.0)
    assert not cannot_beat(100.0, 100.0)  # a tie may still be found: not skipped
    assert not cannot_beat(100.0 * (1 - MARGIN / 2), 100.0)
    assert not cannot_beat(1.0, None)  # nothing feasible in hand yet


def test_skipping_hopeless_candidates_keeps_the_plan(monkeypatch):
    said: list[str] = []
    pruned = _context(said.append)
    base = baselines(pruned)
    with_pruning = policies.tessera(pruned, "throughput", base)
    assert any("skipped" in s and "tessera.plan.ceiling" in s for s in said)
    monkeypatch.setattr(policies, "_incumbent", lambda *a: None)  # every candidate searched
    full = _context()
    without = policies.tessera(full, "throughput", baselines(full))
    assert with_pruning.throughput == without.throughput and with_pruning.reason == without.reason
    assert [s.assignment for s in with_pruning.steps] == [s.assignment for s in without.steps]
    assert with_pruning.extra.get("tie_with") == without.extra.get("tie_with")
