"""The placement figure of a plan: which target runs each kernel class of each layer."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from tessera.cost.features import cost_class
from tessera.plan.context import PlanContext
from tessera.plan.deployment import DeploymentPlan
from tessera.plan.objective_steps import plan_targets
from tessera.report.placement import PlacementCell, plot_placement


def placement_figure(ctx: PlanContext, plan: DeploymentPlan, path: str | Path, phase: str | None = None) -> Path:
    """Draw the plan's step of ``phase`` (default: the main phase) as a layer x kernel-class grid."""
    phase = phase or ctx.main_phase.phase
    step = plan.step(phase)
    spec = next(p for p in ctx.for_batch(step.batch * plan.replicas).phases if p.phase == phase)
    targets = plan_targets(ctx, plan)
    sp = ctx.for_batch(step.batch).step_problem(spec, targets, step.micro_batches, step.solver.get("expert_parts", 1))
    times = sp.problem.times
    on = sp.problem_assignment(step.assignment, step.expert_parts)
    first_layer = min((k.index for k in sp.graph.kernels if k.layer is not None), default=0)
    cells: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    order: list[str] = []
    for k, own in zip(sp.graph.kernels, sp.problem_kernels(), strict=True):
        label = str(k.layer) if k.layer is not None else ("embed" if k.index < first_layer else "head")
        if label not in order:
            order.append(label)
        for i in own:  # an expert GEMM split into parts counts each part where it runs
            cells[(label, cost_class(k))][targets[on[i]].name] += float(times[i, on[i]])
    rows = [PlacementCell(layer, cls, dict(share), sum(share.values()))
            for (layer, cls), share in sorted(cells.items(), key=lambda kv: order.index(kv[0][0]))]
    title = (f"{plan.model} {phase} on {plan.cluster}: {plan.policy} "
             f"(M={step.micro_batches}, {plan.throughput:,.0f} {plan.unit}, predicted)")
    return plot_placement(rows, [t.name for t in targets], path, title)
