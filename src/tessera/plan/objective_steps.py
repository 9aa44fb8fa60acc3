"""Step plans for the other objective, inside a deployment's residency (weights and state stay put).

A deployment switches between its throughput and latency step plans online; both run over the same
resident weights and state, so under Tessera's own policy the second objective is solved with every kernel
restricted to the targets that already hold everything it reads or touches. A named policy's placement is
the policy (prefill-decode keeps its decode on the decode target, layer-pipeline its stages): its other
objective's step plans keep every kernel where the policy put it, at their own batch and M. Latency plans are
made for the low-load bucket (at most ``LATENCY_BUCKET`` sequences in flight, M = 1), where the serving
monitor uses them.
"""

from __future__ import annotations

from tessera.plan.config import LATENCY_BUCKET
from tessera.plan.context import PlanContext
from tessera.plan.deployment import DeploymentPlan, StepPlan
from tessera.plan.targets import Target, cluster_targets


def plan_targets(ctx: PlanContext, plan: DeploymentPlan) -> list[Target]:
    """The targets of one replica of ``plan`` (rebuilt from the cluster, checked against the plan)."""
    targets = cluster_targets(ctx.cluster, plan.replicas, [plan.device] if plan.device else None)
    if [t.name for t in targets] != plan.targets:
        raise ValueError(f"the plan's targets {plan.targets} are not the cluster's {[t.name for t in targets]}")
    return targets


def add_objective_steps(ctx: PlanContext, plan: DeploymentPlan, objective: str) -> DeploymentPlan:
    """Add ``objective`` step plans (M = 1 for latency; the primary plan's M for throughput) to ``plan``: solved
    anew under Tessera's own policy, the primary plan's placement carried to their shapes under any other."""
    from tessera.plan.build import transfer_assignment
    from tessera.plan.policies import _solve_folded, residency_allowed

    if (not plan.applicable or "replicas" in plan.extra or "routes" in plan.extra
            or any(s.objective == objective for s in plan.steps)):
        return plan  # request distribution, route mixes: each engine is a deployment of its own
    targets = plan_targets(ctx, plan)
    primary = {s.phase: s for s in plan.steps}
    main = max(primary.values(), key=lambda s: s.repeats)
    per_replica = max(1, ctx.batch // plan.replicas) if ctx.shared_batch else main.batch  # else the engine's own
    planned = {ph.phase: ctx.graph(ph, primary[ph.phase].micro_batches) for ph in ctx.phases}
    ctx = ctx.for_batch(min(per_replica, LATENCY_BUCKET) if objective == "latency" else per_replica)
    chosen = []
    for ph in ctx.phases:
        m = 1 if objective == "latency" else primary[ph.phase].micro_batches
        parts = primary[ph.phase].solver.get("expert_parts", 1)
        if plan.policy != "tessera":  # the policy's placement, at this objective's shape
            a = transfer_assignment(planned[ph.phase], ctx.graph(ph, m), list(primary[ph.phase].assignment))
            chosen.append((ph, m, tuple(a), {"method": "fixed"}))
            continue
        sp = ctx.step_problem(ph, targets, m, parts)
        a, info = _solve_folded(ctx, ph, targets, m, objective, residency_allowed(sp, plan.residency), memory=False,
                                expert_parts=parts)
        chosen.append((ph, m, a, info))
    other = ctx.assemble(plan.policy, targets, plan.replicas, chosen, objective, device=plan.device)
    for s in other.steps:
        plan.steps.append(StepPlan(**{**s.__dict__, "objective": objective}))
    plan.extra[f"{objective}_plan"] = {"batch": ctx.batch, "latency_s": other.latency_s, "ttft_s": other.ttft_s,
                                       "throughput": other.throughput, "feasible": other.feasible}
    return plan
