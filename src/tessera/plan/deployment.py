"""Deployment plans: where weights and state live, the step plans that share it, and what they achieve.

A deployment serves requests through phases (prefill and decode; encode for images; denoising steps
for diffusion). Each phase has a step plan per objective: every kernel's target, the micro-batch count
M and the step's evaluation. The throughput model is per request: each resource (a target's compute,
a directed link) spends ``repeats / rows`` of a phase's cycle load per request (a decode cycle serves
``rows`` = batch requests one token each; a request takes ``out`` of them), plus explicit state moves;
a phase also cannot run faster than its own cycle. So a request costs

    T = max(max over resources of the summed per-request load,
            max over lanes of the sum over the lane's phases of repeats/rows x cycle)

seconds of the deployment, ``replicas`` copies serve in parallel, and the throughput is
``replicas x out / T`` tokens/s (images/s for diffusion) in the steady state. A lane is a set of
phases whose step plans share a target (transitively, see :func:`lanes`): an engine runs one step of a
lane at a time and a step holds its targets for its whole cycle, so the phases of a lane take turns;
phases on disjoint targets overlap (prefill-decode disaggregation). A finite workload that arrives at
once (``fixed:``, ``images:``) reports outputs over its makespan.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tessera.errors import TesseraError

PLAN_VERSION = 3  # 2: engine admission, the upper bound, `bound` renamed `bottleneck`; 3: the engine layout
WHOLE, PREFILL, DECODE, SPLIT = "whole", "prefill", "decode", "split"  # engine roles
ROLES = (WHOLE, PREFILL, DECODE, SPLIT)


class PlanFileError(TesseraError):
    """A plan file that cannot be read, or that was made for another graph, cluster or model."""


@dataclass(frozen=True)
class StateMove:
    """An explicit copy of a state buffer between phases' targets, per request (e.g. KV after prefill)."""

    buffer: str
    src: int  # target index
    dst: int
    bytes_per_request: float
    seconds_per_request: float


@dataclass(frozen=True)
class EngineAdmission:
    """How many sequences (images) one engine of the deployment admits, and what limits it. Under
    memory-bound admission an engine admits while its devices' state memory lasts (paged KV in blocks of
    ``block_size`` tokens, after weights and activations, at the memory-utilisation fraction), up to
    ``max_num_seqs``."""

    max_seqs: int  # sequences (images) in flight per engine: the batch its repeated phase runs at
    kv_tokens: int | None  # cache tokens its free memory holds (None: the state does not grow with the context)
    block_size: int
    limited_by: str  # what set max_seqs: memory on a device, --max-num-seqs, the workload, a fixed --max-batch

    @property
    def kv_blocks(self) -> int | None:
        """Blocks of ``block_size`` tokens the engine's cache holds."""
        return None if self.kv_tokens is None else self.kv_tokens // self.block_size


@dataclass(frozen=True)
class PlannedEngine:
    """One engine of a plan (derived by `tessera.plan.engines.engine_layout`): its roles (``whole``: serves
    requests from prompt to last token; ``prefill``: computes prompts and hands their KV on; ``decode``: continues from handed-on KV; ``split``: a kernel-level
    placement over several devices), the cluster targets and device ids it runs on, its admission
    (``max_num_seqs``, cache tokens, block size) and the share of each device's memory it may use."""

    name: str
    roles: tuple[str, ...]
    targets: tuple[str, ...]  # cluster placement targets (a target may be a group of GPUs of one type)
    devices: tuple[str, ...]  # cluster device ids ("A100:0"), in target order
    nodes: tuple[str, ...]  # the node of each device
    max_num_seqs: int
    kv_tokens: int | None  # cache tokens its memory holds (None: state does not grow with the context)
    block_size: int
    memory_fraction: float  # of each of its devices' memory (vLLM's gpu_memory_utilization)

    @property
    def runs_on_vllm(self) -> bool:
        """Whether a whole-model engine (vLLM) can run it: one target, no kernel split."""
        return SPLIT not in self.roles and len(self.targets) == 1

    @property
    def kv_role(self) -> str | None:
        """Its side of a KV handoff: ``kv_producer`` (prefills for others), ``kv_consumer`` (decodes what
        others prefilled, and computes a prompt itself when nothing was handed on), or None."""
        if PREFILL in self.roles and DECODE in self.roles:
            return "kv_both"
        if PREFILL in self.roles:
            return "kv_producer"
        if DECODE in self.roles:
            return "kv_consumer"
        return None


@dataclass(frozen=True)
class PlannedRoute:
    """A path requests take: ``hops`` are engine names (one: served whole; two: prefill, then decode),
    ``share`` the fraction of requests the plan sends along it, and ``latency_s`` its planned request latency
    (None in plan files written before routes carried it)."""

    name: str
    share: float
    hops: tuple[str, ...]
    latency_s: float | None = None


@dataclass(frozen=True)
class EngineLayout:
    """A plan's engines and routes (empty for a plan that is not applicable or does not fit)."""

    engines: tuple[PlannedEngine, ...] = ()
    routes: tuple[PlannedRoute, ...] = ()

    def engine(self, name: str) -> PlannedEngine:
        """The engine named ``name`` (KeyError naming the engines it has)."""
        for e in self.engines:
            if e.name == name:
                return e
        raise KeyError(f"no engine {name!r}; the plan has: {', '.join(e.name for e in self.engines)}")

    @property
    def runnable_on(self) -> tuple[str, ...]:
        """The serving engines that can run the layout: ``vllm`` where every engine is a whole-model engine
        (no kernel split), ``tessera`` (its own runtime) where requests take one route, or one whole engine
        each (request-dist's replicas), since that runtime runs one placement per engine and no mixes."""
        if not self.engines:
            return ()
        vllm = all(e.runs_on_vllm for e in self.engines)
        tessera = len(self.routes) == 1 or all(len(r.hops) == 1 and WHOLE in self.engine(r.hops[0]).roles
                                               and len(self.engine(r.hops[0]).roles) == 1 for r in self.routes)
        return tuple(name for name, ok in (("vllm", vllm), ("tessera", tessera)) if ok)

    def to_dict(self) -> dict[str, Any]:
        return {"engines": [e.__dict__ | {"roles": list(e.roles), "targets": list(e.targets),
                                          "devices": list(e.devices), "nodes": list(e.nodes)} for e in self.engines],
                "routes": [r.__dict__ | {"hops": list(r.hops)} for r in self.routes]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineLayout:
        """The layout written by :meth:`to_dict` (KeyError / TypeError on missing or unknown fields)."""
        engines = tuple(PlannedEngine(**{**e, "roles": tuple(e["roles"]), "targets": tuple(e["targets"]),
                                         "devices": tuple(e["devices"]), "nodes": tuple(e["nodes"])})
                        for e in d["engines"])
        routes = tuple(PlannedRoute(**{**r, "hops": tuple(r["hops"])}) for r in d["routes"])
        return cls(engines, routes)


@dataclass
class StepPlan:
    """One phase's placement under one objective: kernel -> target, M, and the evaluated costs."""

    phase: str
    objective: str
    batch: int  # sequences (images) per step
    micro_batches: int
    repeats: float  # steps of this phase per request
    rows: int  # requests served per cycle
    graph_hash: str  # of the graph traced at the micro-batch size
    assignment: list[int]  # per kernel of that graph, the target index
    cycle_s: float
    critical_path_s: float
    busy_s: list[float]  # per target, per cycle
    link_s: list[list[float]]  # per directed target pair, per cycle
    cut_edges: int
    cut_bytes: float
    solver: dict[str, Any] = field(default_factory=dict)  # how it was found: method, gap, bound, seconds
    expert_parts: dict[str, list[int]] = field(default_factory=dict)  # split expert GEMM -> target per part

    @property
    def per_request(self) -> float:
        return self.repeats / self.rows

    @property
    def used_targets(self) -> set[int]:
        """The target indices the step runs kernels on (split expert parts included)."""
        return set(self.assignment) | {t for parts in self.expert_parts.values() for t in parts}


def lanes(steps: list[StepPlan]) -> list[list[StepPlan]]:
    """The step plans grouped into lanes: steps whose targets overlap, directly or through another step,
    share a lane and take turns; different lanes run concurrently. In the order of each lane's first step."""
    groups: list[tuple[list[StepPlan], set[int]]] = []
    for s in steps:
        used = s.used_targets
        merged = [g for g in groups if g[1] & used]
        members, targets = [s], set(used)
        for g in merged:
            groups.remove(g)
            members = g[0] + members
            targets |= g[1]
        groups.append((members, targets))
    order = {id(s): i for i, s in enumerate(steps)}
    return sorted((sorted(g[0], key=lambda s: order[id(s)]) for g in groups), key=lambda g: order[id(g[0])])


def busiest_lane(steps: list[StepPlan]) -> tuple[float, list[StepPlan]]:
    """The longest lane's time per request (the cycles of its phases, one after another) and that lane."""
    return max(((sum(s.cycle_s * s.per_request for s in lane), lane) for lane in lanes(steps)),
               key=lambda x: x[0], default=(0.0, []))


@dataclass
class DeploymentPlan:
    """A policy's deployment of a model on a cluster for a workload."""

    model: str
    cluster: str
    workload: str
    policy: str
    applicable: bool
    reason: str = ""  # why not applicable / not feasible; or notes (ties)
    feasible: bool = True
    targets: list[str] = field(default_factory=list)
    replicas: int = 1
    device: str | None = None  # homogeneous: the device type
    residency: dict[str, list[int]] = field(default_factory=dict)  # item (weight/state) -> target indices
    memory_bytes: list[float] = field(default_factory=list)  # per target: resident items + activations
    memory_capacity: list[float] = field(default_factory=list)
    steps: list[StepPlan] = field(default_factory=list)
    state_moves: list[StateMove] = field(default_factory=list)
    throughput: float = 0.0  # tokens/s (images/s for diffusion), all replicas
    unit: str = "tokens/s"
    request_time_s: float = 0.0
    latency_s: float = 0.0  # time per output token (decode cycle); one image for diffusion
    ttft_s: float = 0.0
    cost_per_hour: float = 0.0
    price_scenario: str = "relative"
    bottleneck: str = ""  # what limits throughput
    admission: EngineAdmission | None = None  # per engine (request-dist: per device type, in extra["replicas"])
    bound: float | None = None  # the case's upper bound on throughput (fractional kernels, least transfers)
    layout: EngineLayout = field(default_factory=EngineLayout)  # its engines and routes
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput_per_cost(self) -> float:
        return self.throughput / self.cost_per_hour if self.cost_per_hour > 0 else 0.0

    def step(self, phase: str, objective: str = "throughput") -> StepPlan | None:
        """The step plan of ``phase`` under ``objective`` (None if the deployment has none)."""
        return next((s for s in self.steps if s.phase == phase and s.objective == objective), None)

    def summary(self) -> dict[str, Any]:
        """The per-policy entry of ``tessera plan --json``."""
        decode = next((s for s in self.steps if s.objective == "throughput" and s.repeats > 1), None)
        return {"policy": self.policy, "device": self.device, "applicable": self.applicable,
                "feasible": self.feasible, "reason": self.reason, "throughput": self.throughput,
                "unit": self.unit, "cost_per_hour": self.cost_per_hour, "price_scenario": self.price_scenario,
                "throughput_per_cost": self.throughput_per_cost, "latency_s": self.latency_s,
                "ttft_s": self.ttft_s, "replicas": self.replicas, "targets": self.targets,
                "micro_batches": decode.micro_batches if decode else None,
                "memory_gb": [round(b / 1e9, 3) for b in self.memory_bytes], "bottleneck": self.bottleneck,
                "admission": asdict(self.admission) if self.admission else None, "bound": self.bound,
                "mix_declined": self.extra.get("mix_declined"), "runs_on": list(self.layout.runnable_on),
                "engines": [e.name for e in self.layout.engines]}

    def to_dict(self) -> dict[str, Any]:
        """The plan file's JSON form."""
        d = asdict(self)
        d["layout"] = self.layout.to_dict()
        d["version"] = PLAN_VERSION
        return d

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1, default=_json_default))
        return path

    @classmethod
    def load(cls, path: str | Path) -> DeploymentPlan:
        """Read a plan file (clear errors for unreadable or incompatible files)."""
        from tessera.documents import read_json

        path = Path(path)
        d = read_json(path, "plan file", PlanFileError, "make it with `tessera plan ... -o FILE`")
        if not isinstance(d, dict) or d.get("version") != PLAN_VERSION:
            raise PlanFileError(f"plan file {path}: not a Tessera plan of version {PLAN_VERSION}; make it again "
                                "with `tessera plan ... -o FILE`")
        d.pop("version")
        try:
            steps = [StepPlan(**s) for s in d.pop("steps")]
            moves = [StateMove(**m) for m in d.pop("state_moves")]
            admission = d.pop("admission", None)
            layout = EngineLayout.from_dict(d.pop("layout"))
            return cls(**d, steps=steps, state_moves=moves, layout=layout,
                       admission=EngineAdmission(**admission) if admission else None)
        except (TypeError, KeyError) as e:
            raise PlanFileError(f"plan file {path}: missing or unknown fields ({e})") from None

    def check_graph(self, phase: str, graph_hash: str, objective: str = "throughput") -> StepPlan:
        """The step plan for ``phase`` if it was made for the graph with ``graph_hash``, else a clear error."""
        step = self.step(phase, objective)
        if step is None:
            raise PlanFileError(f"the plan ({self.policy} for {self.model}) has no {objective} step plan for "
                                f"phase {phase!r}; it has: {', '.join(sorted({s.phase for s in self.steps}))}")
        if step.graph_hash != graph_hash:
            raise PlanFileError(f"the plan's {phase} step was made for graph {step.graph_hash[:12]}, not for this "
                                f"graph ({graph_hash[:12]}): a different model, shape or batch; plan again for it")
        return step


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"cannot write {type(value).__name__} to a plan file")
