"""`tessera serve --engine vllm`: a plan's engines started as vLLM processes on this host, Tessera's router
in front. And the router alone over engines someone else started (`tessera route`, what `tessera deploy`
prints for a GPU cluster).

The plan comes from a plan file (``--plan``, made by `tessera plan` for this cluster or, with cpu
workers standing in, for a GPU cluster) or is planned on the spot (``--policy``, for ``--placement-for``'s
GPU cluster or for the cpu workers themselves). Each engine gets a loopback port of its own.
"""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tessera.engines.deployment import Deployment, cpu_deployment
from tessera.engines.kvstore import new_store
from tessera.engines.process import Supervisor
from tessera.engines.vllm import VLLMOptions, VLLMSetupError, check_python
from tessera.errors import TesseraError
from tessera.plan.deployment import DeploymentPlan, PlannedEngine, PlannedRoute
from tessera.plan.shares import ShareSwitch
from tessera.router.app import Router, RouterOptions
from tessera.router.table import Endpoint, RouteTable


@dataclass
class VLLMServeConfig:
    """What `tessera serve --engine vllm` starts: the model, ``cpu:N`` workers, the plan (a file, or a policy
    planned for ``placement_for`` or the workers), the vLLM environment's interpreter, the engines' options,
    where their logs go, and the router's route shares (`tessera.plan.shares`) with their cool-down."""

    model: str
    cluster: str = "cpu:2"
    plan_file: str | None = None
    policy: str = "tessera"
    placement_for: str | None = None
    mix_min_gain: float | None = None
    python: str = ""
    max_model_len: int = 1024
    enforce_eager: bool = True
    prefix_caching: bool = True
    kv_bytes: int = 1 << 30
    log_dir: str | None = None
    threads: int | None = None  # cores per worker (default: the host's cores split evenly)
    shares: str = "auto"
    cooldown_s: float = 1.0


def serving_plan(cfg: VLLMServeConfig, log: Callable[[str], None]) -> tuple[DeploymentPlan, str]:
    """The plan to serve and where it came from: the plan file, or ``cfg.policy`` planned now."""
    if cfg.plan_file:
        plan = DeploymentPlan.load(cfg.plan_file)
        return plan, f"plan file {cfg.plan_file} ({plan.policy} for {plan.cluster})"
    from tessera.plan.config import DEFAULT_MIX_MIN_GAIN, PlanConfig
    from tessera.plan.context import PlanContext
    from tessera.plan.planner import plan_policy

    cluster = cfg.placement_for or cfg.cluster
    gain = DEFAULT_MIX_MIN_GAIN if cfg.mix_min_gain is None else cfg.mix_min_gain
    config = PlanConfig(cfg.model, cluster, policy=cfg.policy, mix_min_gain=gain)
    log(f"planning {cfg.policy} for {cfg.model} on {cluster}")
    ctx = PlanContext.from_config(config, progress=None)
    plan = plan_policy(ctx, cfg.policy, "throughput")
    return plan, f"{cfg.policy} planned for {ctx.cluster.describe()}"


def model_folder(model: str) -> str:
    """The folder of ``model``'s real weights (what vLLM loads)."""
    from tessera.capture.models import resolve_model
    from tessera.capture.pretrained import weights_dir

    spec = resolve_model(model)
    if spec.family not in ("llm", "moe"):
        raise VLLMSetupError(f"--engine vllm serves text models (llm, moe) here; {spec.name} is a {spec.family} model")
    try:
        return str(weights_dir(spec))
    except TesseraError as e:
        raise VLLMSetupError(f"{model}: vLLM needs the model's real weights: {e}") from None


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class Prepared:
    """A deployment ready to start on this host: its engines, the folder of their logs, the example
    connector's KV store and where the plan came from."""

    deployment: Deployment
    logs: Path
    store: Path
    how: str


def prepare_vllm(cfg: VLLMServeConfig, log: Callable[[str], None]) -> Prepared:
    """The plan (read or planned now) as vLLM processes to start on this host's cpu workers. Nothing is
    started.

    Raises:
        TesseraError: the plan cannot run on vLLM, the vLLM environment or the model's weights are missing.
    """
    from tessera.hardware.cluster import parse_cluster

    cluster = parse_cluster(cfg.cluster)
    if any(d.spec.id != "cpu" for d in cluster.devices):
        raise VLLMSetupError(f"--cluster {cluster.describe()} has GPUs: `tessera serve` starts engines on this host's "
                             "cpu workers (--cluster cpu:N); for a GPU cluster, `tessera deploy PLAN --engine vllm` "
                             "prints every engine's command and the router's, to start under your supervisor")
    check_python(cfg.python)
    folder = model_folder(cfg.model)
    plan, how = serving_plan(cfg, log)
    logs = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="tessera-vllm-"))
    store = new_store(logs)
    options = VLLMOptions(cfg.python, folder, cfg.model, cfg.max_model_len, enforce_eager=cfg.enforce_eager,
                          prefix_caching=cfg.prefix_caching, connector="tessera-store", kv_store=str(store),
                          cpu_kv_bytes=cfg.kv_bytes)
    options.check()
    deployment = cpu_deployment(plan, len(cluster.devices), options, free_ports(len(plan.layout.engines)),
                                threads=cfg.threads)
    return Prepared(deployment, logs, store, how)


def router_for(deployment_routes: tuple[PlannedRoute, ...], engines: dict[str, tuple[PlannedEngine, str, str | None]],
               options: RouterOptions, supervisor: Supervisor | None = None) -> Router:
    """The router over ``engines`` (name -> (planned engine, URL, KV connector)) along the plan's routes, in
    the shares ``options.shares`` chooses; with a ``supervisor``, its restarts and exits show in /health and
    /metrics.

    Raises:
        ShareSwitchError: the shares asked for cannot be used with these routes.
    """
    endpoints = {name: Endpoint(e, url.rstrip("/"), connector) for name, (e, url, connector) in engines.items()}
    switch = ShareSwitch(list(deployment_routes), {n: e for n, (e, _, _) in engines.items()}, options.shares,
                         cooldown_s=options.cooldown_s)
    table = RouteTable(endpoints, list(deployment_routes), switch)
    status = None
    if supervisor is not None:
        def status() -> dict[str, dict]:
            return {n: {"state": s.state, "detail": s.detail, "restarts": s.restarts, "exits": s.exits}
                    for n, s in supervisor.status.items()}

        def changed(name: str, state: str, detail: str) -> None:  # a process seen ending or healthy: at once
            if name in endpoints:
                endpoints[name].state, endpoints[name].detail = state, detail

        supervisor.listeners.append(changed)
    return Router(table, options, status)


def deployment_router(deployment: Deployment, options: RouterOptions, supervisor: Supervisor | None = None) -> Router:
    """The router over a started deployment's engines."""
    engines = {ln.engine.name: (ln.engine, ln.url, ln.connector) for ln in deployment.launches}
    return router_for(deployment.routes, engines, options, supervisor)


__all__ = ["Prepared", "VLLMServeConfig", "deployment_router", "free_ports", "model_folder", "prepare_vllm",
           "router_for", "serving_plan"]
