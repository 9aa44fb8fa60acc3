"""A plan's engines as processes to start: where each runs and how (`EngineLaunch` per engine).

On a GPU cluster each engine gets its devices (``CUDA_VISIBLE_DEVICES`` counts the plan's devices on each
node in cluster order) and listens on every interface, for a router on another node; on this host each
target of the plan is stood in for by a cpu worker (target i on worker i, as ``tessera run
--placement-for`` maps them), the host's cores split evenly between the workers, and engines listen on
loopback ports. `tessera deploy` prints a GPU deployment; `tessera serve --engine vllm` starts a cpu one.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from tessera.engines.vllm import (
    NIXL_SIDE_CHANNEL_PORT,
    WHOLE_ONLY,
    EngineLaunch,
    Placement,
    VLLMOptions,
    VLLMSetupError,
    vllm_launch,
)
from tessera.hardware.catalog import HOST_ID
from tessera.plan.deployment import WHOLE, DeploymentPlan, PlannedEngine, PlannedRoute
from tessera.runtime.target_map import plan_target_map


@dataclass(frozen=True)
class Deployment:
    """The engines of a plan as processes, and the routes between them."""

    plan: DeploymentPlan
    launches: tuple[EngineLaunch, ...]
    routes: tuple[PlannedRoute, ...]
    host_cores: tuple[int, ...] = ()  # cpu deployments: this host's cores no engine computes on (router, schedulers)

    def launch(self, name: str) -> EngineLaunch:
        """The launch of engine ``name``."""
        for launch in self.launches:
            if launch.engine.name == name:
                return launch
        raise KeyError(name)


def runnable(plan: DeploymentPlan, source: str) -> None:
    """Raise `VLLMSetupError` unless vLLM can run every engine of ``plan`` (``source`` names it)."""
    layout = plan.layout
    if not (plan.applicable and plan.feasible):
        raise VLLMSetupError(f"{source} ({plan.policy}) is not a runnable plan: {plan.reason}")
    if not layout.engines:
        raise VLLMSetupError(f"{source} ({plan.policy}) names no engines; plan it again with this version "
                             "(`tessera plan ... -o FILE`)")
    split = [e.name for e in layout.engines if not e.runs_on_vllm]
    if split:
        raise VLLMSetupError(f"{source} ({plan.policy}) splits kernels over devices in {', '.join(split)}; "
                             f"{WHOLE_ONLY}")


def gpu_deployment(plan: DeploymentPlan, options: VLLMOptions, first_port: int = 8100,
                   host: str = "0.0.0.0") -> Deployment:
    """The plan's engines on its GPU cluster: each on its own devices, ports counted up from ``first_port``
    per node; a node's name stands for its address (NIXL's handshake channel, the router's engine URLs)."""
    runnable(plan, "the plan")
    gpu_index = _gpu_indices(plan)
    launches, next_port, side = [], {}, {}
    for engine in plan.layout.engines:
        node = engine.nodes[0] if engine.nodes else "node0"
        if len(set(engine.nodes)) > 1:
            raise VLLMSetupError(f"engine {engine.name} spans nodes {', '.join(sorted(set(engine.nodes)))}; one vLLM "
                                 "engine per node here (pipeline parallelism across nodes is not launched)")
        port = next_port.get(node, first_port)
        next_port[node] = port + 1
        side[node] = side.get(node, 0) + 1
        placement = Placement(node, gpus=tuple(gpu_index[d] for d in engine.devices))
        launches.append(vllm_launch(engine, placement, port, options, host,
                                    side_channel_port=NIXL_SIDE_CHANNEL_PORT + side[node] - 1))
    return Deployment(plan, tuple(launches), plan.layout.routes)


def cpu_deployment(plan: DeploymentPlan, workers: int, options: VLLMOptions, ports: list[int],
                   cores: int | None = None, threads: int | None = None) -> Deployment:
    """The plan's engines on ``workers`` cpu workers of this host (target i of a GPU plan on worker i), each
    worker with ``cores / workers`` cores (the first ``threads`` of them, if given), engines on loopback
    ``ports`` (one per engine)."""
    runnable(plan, "the plan")
    mapping = plan_target_map(list(plan.targets), plan.cluster, workers, "the plan")
    total = cores or os.cpu_count() or 1
    per = max(1, total // workers)
    if threads is not None and threads > per:
        raise VLLMSetupError(f"--threads {threads}: each of {workers} workers has {per} of this host's {total} cores")
    if len(ports) < len(plan.layout.engines):
        raise VLLMSetupError(f"{len(plan.layout.engines)} engines need as many ports; got {len(ports)}")
    launches = []
    for engine, port in zip(plan.layout.engines, ports, strict=False):
        target = engine.targets[0]
        worker = mapping.worker_of[target] if mapping is not None else _cpu_index(target, workers)
        cpu = tuple(range(worker * per, worker * per + per)) if total >= workers else tuple(range(total))
        cpu = cpu[:threads] if threads else cpu
        launches.append(vllm_launch(engine, Placement(f"{HOST_ID}:{worker}", cores=cpu), port, options))
    # The engines' compute workers bind to their cores; their API servers and schedulers (a busy loop) and
    # the router would otherwise float onto those cores too and preempt the compute. Where cores are left
    # over, they all start there instead.
    host = set(range(total)) - {c for ln in launches for c in ln.placement.cores}
    if cores is None:  # this host: only the cores this process may run on
        host &= os.sched_getaffinity(0)
    host = tuple(sorted(host))
    launches = [dataclasses.replace(ln, host_cores=host) for ln in launches]
    return Deployment(plan, tuple(launches), plan.layout.routes, host)


def _cpu_index(target: str, workers: int) -> int:
    index = int(target.split(":", 1)[1]) if target.startswith(f"{HOST_ID}:") else 0
    if index >= workers:
        raise VLLMSetupError(f"the plan places an engine on {target}, but --cluster has {workers} workers")
    return index


def _gpu_indices(plan: DeploymentPlan) -> dict[str, int]:
    """Each device id of the plan's engines -> its GPU index on its node (the node's devices in the order of the
    plan's device types, then their index)."""
    order = {t.split("x")[0]: i for i, t in enumerate(plan.targets)}
    seen: dict[str, str] = {}
    for e in plan.layout.engines:
        for d, n in zip(e.devices, e.nodes, strict=False):
            seen[d] = n
    out: dict[str, int] = {}
    for node in sorted(set(seen.values())):
        mine = sorted((d for d, n in seen.items() if n == node),
                      key=lambda d: (order.get(d.split(":")[0], len(order)), int(d.split(":")[1])))
        out.update({d: i for i, d in enumerate(mine)})
    return out


__all__ = ["Deployment", "cpu_deployment", "gpu_deployment", "runnable"]


def cpu_engine(options: VLLMOptions, port: int, max_num_seqs: int, threads: int | None = None,
               cores: int | None = None) -> EngineLaunch:
    """One whole-model engine on this host's first ``threads`` cores (default: all of them), on loopback
    ``port``: what `tessera profile-engine` measures."""
    total = cores or os.cpu_count() or 1
    if threads is not None and not 1 <= threads <= total:
        raise VLLMSetupError(f"--threads {threads}: this host has {total} cores; give 1 to {total}")
    engine = PlannedEngine(name=WHOLE, roles=(WHOLE,), targets=(f"{HOST_ID}:0",), devices=(f"{HOST_ID}:0",),
                           nodes=(HOST_ID,), max_num_seqs=max_num_seqs, kv_tokens=None, block_size=16,
                           memory_fraction=1.0)
    return vllm_launch(engine, Placement(f"{HOST_ID}:0", cores=tuple(range(threads or total))), port, options)
