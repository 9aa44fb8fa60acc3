"""Plan a deployment: one policy, or every policy side by side (``tessera plan --compare``); every plan
carries the case's upper bound on throughput (:mod:`tessera.plan.bound`)."""

from __future__ import annotations

from tessera.plan.bound import upper_bound
from tessera.plan.collector import without_collector
from tessera.plan.config import POLICIES, check_policy
from tessera.plan.context import PlanContext, PlanningError
from tessera.plan.deployment import DeploymentPlan
from tessera.plan.engines import engine_layout
from tessera.plan.milp import SolverError
from tessera.plan.policies import (
    applicability,
    attention_ffn,
    homogeneous,
    layer_pipeline,
    prefill_decode,
    request_dist,
    tessera,
)

_BASELINES = {"request-dist": request_dist, "prefill-decode": prefill_decode, "attention-ffn": attention_ffn,
              "layer-pipeline": layer_pipeline}


def _not_applicable(ctx: PlanContext, policy: str, reason: str, device: str | None = None) -> DeploymentPlan:
    return DeploymentPlan(model=ctx.model, cluster=ctx.cluster.describe(), workload=ctx.workload_text,
                          policy=policy, applicable=False, feasible=False, reason=reason, device=device,
                          unit=ctx.unit, price_scenario=ctx.price_scenario)


def _infeasible(ctx: PlanContext, policy: str, reason: str, device: str | None = None) -> DeploymentPlan:
    plan = _not_applicable(ctx, policy, reason, device)
    plan.applicable = True
    return plan


@without_collector
def baselines(ctx: PlanContext, objective: str = "throughput") -> list[DeploymentPlan]:
    """Every baseline policy's best plan (homogeneous once per device type), in the policy list's order."""
    out = []
    for rid in ctx.cluster.placement_types():
        ctx.say(f"homogeneous on {rid}")
        out.append(homogeneous(ctx, objective, rid))
    for policy, solve in _BASELINES.items():
        reason = applicability(ctx, policy)
        if reason:
            out.append(_not_applicable(ctx, policy, reason))
            continue
        ctx.say(policy)
        try:
            out.append(solve(ctx, objective))
        except (PlanningError, SolverError) as e:
            out.append(_infeasible(ctx, policy, str(e)))
    return out


def with_bound(ctx: PlanContext, plans: list[DeploymentPlan]) -> list[DeploymentPlan]:
    """The plans with the case's upper bound on throughput set (computed once per context), and the engines
    and routes that serve each (`tessera.plan.engines`)."""
    bound = upper_bound(ctx).throughput
    for p in plans:
        p.bound = bound
        p.layout = engine_layout(p, ctx.cluster, ctx.admission.memory_utilization)
    return plans


@without_collector
def plan_policy(ctx: PlanContext, policy: str = "tessera", objective: str = "throughput",
                device: str | None = None) -> DeploymentPlan:
    """The best plan of one policy (Tessera also weighs the baselines, which its search space contains),
    with the case's upper bound on throughput."""
    return with_bound(ctx, [_plan_policy(ctx, policy, objective, device)])[0]


def _plan_policy(ctx: PlanContext, policy: str, objective: str, device: str | None) -> DeploymentPlan:
    check_policy(policy)
    if policy == "homogeneous":
        return homogeneous(ctx, objective, device)
    reason = applicability(ctx, policy)
    if reason:
        if policy == "tessera" or len(ctx.cluster.placement_types()) == 1:
            plan = homogeneous(ctx, objective, device)
            plan.policy = policy
            plan.reason = f"one device type: the {policy} plan is the homogeneous plan" + \
                          (f"; {plan.reason}" if plan.reason else "")
            return plan
        return _not_applicable(ctx, policy, reason)
    if policy == "tessera":
        if len(ctx.cluster.devices) == 1 or len(ctx.cluster.placement_types()) == 1:
            plan = homogeneous(ctx, objective, device)
            plan.policy = "tessera"
            plan.reason = ("one device: the plan is the homogeneous plan" if len(ctx.cluster.devices) == 1 else
                           "one device type: kernel placement over identical devices is the homogeneous plan") + \
                (f"; {plan.reason}" if plan.reason else "")
            return plan
        return tessera(ctx, objective, baselines(ctx, objective))
    return _BASELINES[policy](ctx, objective)


@without_collector
def compare(ctx: PlanContext, objective: str = "throughput") -> list[DeploymentPlan]:
    """Every policy's best plan: the baselines, then Tessera (which weighs them all); each with the case's
    upper bound on throughput."""
    base = baselines(ctx, objective)
    if len(ctx.cluster.placement_types()) == 1:
        best = _plan_policy(ctx, "tessera", objective, None)
    else:
        ctx.say("tessera")
        best = tessera(ctx, objective, base)
    ctx.say("upper bound")
    return with_bound(ctx, [*base, best])


__all__ = ["POLICIES", "baselines", "compare", "plan_policy", "with_bound"]
