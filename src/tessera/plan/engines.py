"""The engines a deployment plan runs and the routes requests take through them: what a launcher reads.

A plan is served by engines, each holding its devices for whole steps: a request-dist plan's replicas, a
prefill-decode plan's prefill and decode roles, a route mix's engines (two on one device where its routes
share it), one engine whose decode device also serves whole requests. Each `PlannedEngine` says its roles,
the devices it runs on and its admission knobs; each `PlannedRoute` says which engines a request visits
(one engine, or a prefill engine then a decode engine) and the share of the requests it takes.

An engine whose steps split kernels over several devices (attention-ffn, layer-pipeline, Tessera's kernel
placements) has the role ``split``: only Tessera's own runtime runs it (``--engine tessera``); the other roles
are whole-model engines that a production engine (vLLM) runs as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessera.hardware.cluster import Cluster
from tessera.plan.deployment import (
    DECODE,
    PREFILL,
    SPLIT,
    WHOLE,
    DeploymentPlan,
    EngineAdmission,
    EngineLayout,
    PlannedEngine,
    PlannedRoute,
    StateMove,
    StepPlan,
    lanes,
)

PROMPT_PHASES = ("prefill", "encode")  # the phases a request passes once, before its repeated phase


@dataclass
class EnginePart:
    """One single-engine plan inside a deployment, with its step plans: the plan itself, a request-dist
    replica group (``kind`` ``replica``) or a mix's route (``route``). The one reader of the plan's per-part
    records (``extra["replicas"]``, ``extra["routes"]``); the engine layout, the launcher and the simulator
    all start from these."""

    kind: str  # plan | replica | route
    name: str  # of its routes: the policy, and the device of a single-device part
    steps: list[StepPlan]
    targets: list[str]  # the part's own target names, indexed by its steps' assignments
    replicas: int
    share: float  # of all requests, over all its replicas
    admission: EngineAdmission | None
    memory: dict[str, float] = field(default_factory=dict)  # target -> planned bytes of one replica
    group: int = 0  # parts of one group that decode on one device are one engine there (a one-engine mix)
    latency_s: float | None = None  # its planned request latency
    throughput: float = 0.0  # planned, over all its replicas (the plan's unit)
    rate: float | None = None  # a route's planned requests per second
    state_moves: list[StateMove] = field(default_factory=list)  # explicit state copies between its phases
    device: str | None = None  # a single-device part's device type (request-dist's replicas, homogeneous)
    index: int = 0  # its place among the deployment's parts

    @property
    def one_engine(self) -> bool:
        """Whether this route runs on another route's engine (a one-engine mix)."""
        return self.kind == "route" and self.group != self.index


def engine_layout(plan: DeploymentPlan, cluster: Cluster, memory_utilization: float,
                  objective: str = "throughput") -> EngineLayout:
    """The engines and routes that serve ``plan`` on ``cluster`` (its throughput step plans by default);
    engines alone on a device may use ``memory_utilization`` of it, engines sharing one split that share in
    proportion to their planned memory. A route mix's engine that decodes for another route and also serves
    its own route whole is one engine with both roles."""
    if not (plan.applicable and plan.feasible) or not plan.steps:
        return EngineLayout()
    parts = engine_parts(plan, objective)
    devices = _devices_by_target(cluster)
    drafts: list[dict[str, Any]] = []
    routes: list[tuple[EnginePart, int, list[int]]] = []
    for part in parts:
        for r in range(part.replicas):
            hops = []
            for roles, targets in _roles(part.steps, part.targets):
                merged = next((i for i, d in enumerate(drafts) if d["group"] == part.group and d["replica"] == r
                               and d["targets"] == targets and {*d["roles"], *roles} == {DECODE, WHOLE}), None)
                if merged is not None:  # one engine decodes for another route and serves its own whole
                    drafts[merged]["roles"] = (DECODE, WHOLE)
                    hops.append(merged)
                    continue
                drafts.append({"roles": roles, "targets": targets, "replica": r, "part": part, "group": part.group,
                               "memory": sum(part.memory.get(t, 0.0) for t in targets)})
                hops.append(len(drafts) - 1)
            routes.append((part, r, hops))
    names = [_engine_name(d, any(p.replicas > 1 for p in parts)) for d in drafts]
    engines = []
    for d, name in zip(drafts, names, strict=True):
        part = d["part"]
        adm = part.admission
        held = [x for x in drafts if set(x["targets"]) & set(d["targets"]) and x["replica"] == d["replica"]]
        total = sum(x["memory"] for x in held)
        fraction = memory_utilization * (d["memory"] / total if len(held) > 1 and total > 0 else 1.0)
        ids = [dev for t in d["targets"] for dev in _replica_devices(devices, t, d["replica"])]
        engines.append(PlannedEngine(
            name=name, roles=d["roles"], targets=tuple(d["targets"]), devices=tuple(i for i, _ in ids),
            nodes=tuple(n for _, n in ids), max_num_seqs=adm.max_seqs if adm else max(s.batch for s in part.steps),
            kv_tokens=adm.kv_tokens if adm else None, block_size=adm.block_size if adm else 16,
            memory_fraction=round(fraction, 4)))
    planned = [PlannedRoute(_route_name(part, r), part.share / part.replicas, tuple(names[h] for h in hops),
                            part.latency_s) for part, r, hops in routes]
    return EngineLayout(tuple(engines), tuple(planned))


def _engine_name(draft: dict[str, Any], replicated: bool) -> str:
    """``prefill@L40S``, ``decode/whole@A100``, ``whole@A100#1``, ``split@A100+L40S``."""
    return f"{'/'.join(draft['roles'])}@{'+'.join(draft['targets'])}" + (f"#{draft['replica']}" if replicated else "")


def engine_parts(plan: DeploymentPlan, objective: str = "throughput") -> list[EnginePart]:
    """The single-engine plans inside ``plan`` with their ``objective`` step plans: request-dist's replica
    groups, a mix's routes, or the plan itself."""
    steps = [s for s in plan.steps if s.objective == objective]
    if plan.extra.get("replicas"):
        total = sum(p["throughput"] for p in plan.extra["replicas"]) or 1.0
        return [EnginePart("replica", _label(p), [s for s in steps if s.solver.get("replica_of") == p["device"]],
                           list(p["targets"]), p["replicas"], p["throughput"] / total, _admission(p.get("admission")),
                           _memory(p["targets"], p.get("memory_gb")), group=k, latency_s=p.get("latency_s"),
                           throughput=p["throughput"], state_moves=list(plan.state_moves), device=p["device"], index=k)
                for k, p in enumerate(plan.extra["replicas"])]
    if plan.extra.get("routes"):
        return [EnginePart("route", _label(r), [s for s in steps if s.solver.get("route_of") == k], list(r["targets"]),
                           1, float(r["share"]), _admission(r.get("admission")), _memory(r["targets"], r.get("memory_gb")),
                           group=int(r.get("engine", k)), latency_s=r.get("latency_s"), throughput=r["throughput"],
                           rate=float(r["rate"]), state_moves=[StateMove(**m) for m in r["state_moves"]],
                           device=r.get("device"), index=k)
                for k, r in enumerate(plan.extra["routes"])]
    return [EnginePart("plan", _label(plan.summary()), steps, list(plan.targets), max(plan.replicas, 1), 1.0,
                       plan.admission, dict(zip(plan.targets, plan.memory_bytes, strict=False)),
                       latency_s=plan.latency_s, throughput=plan.throughput, state_moves=list(plan.state_moves),
                       device=plan.device)]


def _label(summary: dict[str, Any]) -> str:
    return summary["policy"] + (f" ({summary['device']})" if summary.get("device") else "")


def _admission(d: dict[str, Any] | None) -> EngineAdmission | None:
    return EngineAdmission(**d) if d else None


def _memory(targets: list[str], gb: list[float] | None) -> dict[str, float]:
    return {t: g * 1e9 for t, g in zip(targets, gb or [], strict=False)}


def _roles(steps: list[StepPlan], targets: list[str]) -> list[tuple[tuple[str, ...], list[str]]]:
    """The engines one replica of a single-engine plan needs, in the order a request visits them: (roles,
    target names) per lane of its step plans. One lane on one target is a whole engine; a prompt lane and a
    repeated lane on one target each are a prefill and a decode engine; anything spanning targets is split."""
    groups = lanes(steps)
    used = [sorted({t for s in lane for t in s.used_targets}) for lane in groups]
    names = [[targets[t] for t in u] for u in used]
    if len(groups) == 1:
        return [((WHOLE,) if len(used[0]) == 1 else (SPLIT,), names[0])]
    prompt = [i for i, lane in enumerate(groups) if all(s.phase in PROMPT_PHASES for s in lane)]
    if len(groups) == 2 and len(prompt) == 1 and all(len(u) == 1 for u in used):
        p = prompt[0]
        return [((PREFILL,), names[p]), ((DECODE,), names[1 - p])]
    every = sorted({t for u in used for t in u})
    return [((SPLIT,), [targets[t] for t in every])]


def _route_name(part: EnginePart, replica: int) -> str:
    return part.name + (f"#{replica}" if part.replicas > 1 else "")


def _devices_by_target(cluster: Cluster) -> dict[str, list[tuple[str, str]]]:
    """Per device type (or cpu worker), its devices' (id, node) in cluster order."""
    return {rid: [(d.id, d.node) for d in ds] for rid, ds in cluster.placement_types().items()}


def _replica_devices(devices: dict[str, list[tuple[str, str]]], target: str, replica: int
                     ) -> list[tuple[str, str]]:
    """The devices of replica ``replica`` of ``target`` (``A100``, ``A100x2``, ``cpu:1``): the type's devices
    taken in order, ``size`` per replica."""
    kind, _, size = target.partition("x") if not target.startswith("cpu") else (target, "", "")
    n = int(size) if size.isdigit() else 1
    pool = devices.get(kind) or devices.get(target) or []
    chosen = pool[replica * n:(replica + 1) * n]
    return chosen or pool[:n]


__all__ = ["EnginePart", "engine_layout", "engine_parts"]
