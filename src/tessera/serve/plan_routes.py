"""A plan file read for `tessera serve --plan`: the routes it sends requests along, each with the share of the
requests it takes and, per objective, where its prefill and decode kernels run on the local cpu workers.

Every plan `tessera plan` writes is served as routes: a single-engine plan (homogeneous, prefill-decode,
layer-pipeline, attention-ffn, Tessera's kernel splits) is one route taking every request; request-dist's
replicas are one route each; a route mix's routes are its routes (a whole-request route, a prefill-decode
route). The plan's engines are read through `tessera.plan.engines.engine_parts`. A plan made for GPUs runs
its target i on worker cpu:i, as `tessera run --plan` does (`tessera.runtime.target_map`).

A step plan places kernels by their index in the graph: every serving bucket of a phase has the same kernels
as the graph the plan was solved for (any shape of the same model), so a plan made for `tessera plan`'s
workload places every bucket the engine serves (its micro-batches are not used: the engine runs one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tessera.plan.deployment import DeploymentPlan, PlanFileError
from tessera.plan.engines import EnginePart, engine_parts

PHASES = ("prefill", "decode")
OBJECTIVES = ("latency", "throughput")


@dataclass(frozen=True)
class ServedRoute:
    """One route of a served plan: its name, its share of the requests and, per objective, each phase's
    kernel -> cpu worker."""

    name: str
    share: float
    assignments: dict[str, dict[str, list[int]]]  # objective -> phase -> kernel -> worker
    latency_s: float | None = None  # its planned request latency

    @property
    def workers(self) -> set[int]:
        """The workers any of its phases runs on."""
        return {w for by_phase in self.assignments.values() for a in by_phase.values() for w in a}


@dataclass(frozen=True)
class ServedPlan:
    """The routes of a plan file and how to say what is served."""

    path: str
    policy: str
    routes: list[ServedRoute]
    how: str


def load_served_plan(path: str | Path, model: str, workers: int) -> ServedPlan:
    """Read ``path`` for serving ``model`` on ``workers`` cpu workers (the kernel counts are checked against the
    served graphs by `tessera.serve.backend.route_placements`).

    Raises:
        PlanFileError: the file is not a plan, is for another model, is not runnable, or places a phase's
            kernels in a way these workers cannot run (MoE expert splits, a target beyond the workers).
        TargetMapError: a plan for GPUs whose target count is not the worker count.
    """
    from tessera.runtime.target_map import plan_target_map

    source = f"plan file {path}"
    plan = DeploymentPlan.load(path)
    if plan.model != model:
        raise PlanFileError(f"{source} is a plan for {plan.model}, not for {model}: serve {plan.model} with it, or "
                            f"plan {model} (`tessera plan {model} --cluster ... -o FILE`)")
    if not (plan.applicable and plan.feasible):
        raise PlanFileError(f"{source} ({plan.policy}) is not a runnable plan: {plan.reason}")
    mapping = plan_target_map(list(plan.targets), plan.cluster, workers, f"{source} ({plan.policy})")
    worker_of = mapping.worker_of if mapping is not None else _cpu_workers(plan.targets, workers, source)
    through = engine_parts(plan, "throughput")
    latency = engine_parts(plan, "latency")
    by_objective = {"throughput": through,
                    "latency": latency if _complete(latency, len(through)) else through}
    routes = []
    for k, part in enumerate(through):
        assignments = {o: _assignments(parts[k], worker_of, source) for o, parts in by_objective.items()}
        for r in range(part.replicas):
            name = part.name + (f"#{r}" if part.replicas > 1 else "")
            routes.append(ServedRoute(name, part.share / part.replicas, assignments, part.latency_s))
    if not routes:
        raise PlanFileError(f"{source} ({plan.policy}) has no engines to serve")
    where = f", its targets on stand-in workers {mapping.describe()}" if mapping is not None else ""
    shares = "; ".join(f"{r.name} {r.share:.0%}" for r in routes) if len(routes) > 1 else routes[0].name
    how = f"{plan.policy} plan from {path} ({shares}){where}"
    return ServedPlan(str(path), plan.policy, routes, how)


def _complete(parts: list[EnginePart], count: int) -> bool:
    """Whether ``parts`` has a prefill and a decode step plan for each of ``count`` parts."""
    return len(parts) == count and all({s.phase for s in p.steps} >= set(PHASES) for p in parts)


def _cpu_workers(targets: list[str], workers: int, source: str) -> dict[str, int]:
    """A plan made for cpu workers: target ``cpu:i`` is worker i, which the cluster must have."""
    out = {t: int(t.split(":")[1]) for t in targets}
    beyond = [t for t, w in out.items() if w >= workers]
    if beyond:
        raise PlanFileError(f"{source} places kernels on {', '.join(beyond)}, but --cluster has {workers} worker"
                            f"{'s' if workers != 1 else ''}; use --cluster cpu:{max(out.values()) + 1}")
    return out


def _assignments(part: EnginePart, worker_of: dict[str, int], source: str) -> dict[str, list[int]]:
    """Each phase's kernel -> worker of one part of the plan."""
    steps = {s.phase: s for s in part.steps}
    out = {}
    for phase in PHASES:
        step = steps.get(phase)
        if step is None:
            raise PlanFileError(f"{source}: {part.name} has no {phase} step plan (it has "
                                f"{', '.join(sorted(steps)) or 'none'}); serve plans of text models made by "
                                "`tessera plan`")
        if step.expert_parts:
            raise PlanFileError(f"{source}: {part.name} splits MoE expert GEMMs over devices "
                                f"({len(step.expert_parts)} kernels), which the runtime does not execute yet; plan "
                                "with --no-expert-split")
        try:
            out[phase] = [worker_of[part.targets[a]] for a in step.assignment]
        except (IndexError, KeyError):
            raise PlanFileError(f"{source}: {part.name}'s {phase} step places kernels on a target the plan does not "
                                f"list ({', '.join(part.targets)}); the file is damaged: plan again") from None
    return out


def split_slots(shares: list[float], slots: int) -> list[int]:
    """``slots`` rows divided among routes in proportion to their shares (largest remainders), each at least
    one.

    Raises:
        PlanFileError: fewer slots than routes.
    """
    if slots < len(shares):
        raise PlanFileError(f"the plan has {len(shares)} routes, each an engine with rows of its own, but --slots is "
                            f"{slots}; give --slots {len(shares)} or more")
    total = sum(shares) or 1.0
    spare = slots - len(shares)
    exact = [s / total * spare for s in shares]
    out = [1 + int(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: -(exact[i] - int(exact[i])))
    for i in order[:slots - sum(out)]:
        out[i] += 1
    return out


__all__ = ["ServedPlan", "ServedRoute", "load_served_plan", "split_slots"]
