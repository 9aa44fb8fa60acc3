"""Running on cpu workers the placement a policy plans for another cluster (GPUs, e.g. ``A100:1,L40S:1``).

The plan is made for the run's own step graphs (same shapes, batch, M and graph kind as a plan for the
workers, so the graph hashes match) but with that cluster's cost model; each of its placement targets (one
per device type, in cluster order) is run by one worker: target i on cpu:i. The workers stand in for the
GPUs: every kernel, transfer and state move of the plan happens as planned, only slower.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tessera.graph.ir import KernelGraph
from tessera.hardware.catalog import HOST_ID
from tessera.hardware.cluster import parse_cluster
from tessera.runtime.config import RunSetupError
from tessera.runtime.session import RunPlacement, placements_from_plan, policy_placement, runtime_context


@dataclass(frozen=True)
class TargetMap:
    """The targets of the cluster planned for, in order; target i runs on worker cpu:i."""

    cluster: str  # the cluster, described
    targets: tuple[str, ...]

    @property
    def worker_of(self) -> dict[str, int]:
        """Target name -> the worker standing in for it."""
        return {name: i for i, name in enumerate(self.targets)}

    def describe(self) -> str:
        """``A100 -> cpu:0, L40S -> cpu:1``."""
        return ", ".join(f"{name} -> cpu:{i}" for i, name in enumerate(self.targets))


def target_map(cluster: str, workers: int) -> TargetMap:
    """The map of ``cluster``'s targets onto ``workers`` cpu workers, checked: the cluster has no cpu workers
    of its own, and as many targets as there are workers.

    Raises:
        RunSetupError: the cluster names cpu workers, or its target count differs from ``workers``.
    """
    from tessera.plan.targets import cluster_targets

    parsed = parse_cluster(cluster)
    if any(d.spec.id == HOST_ID for d in parsed.devices):
        raise RunSetupError(f"--placement-for names the cluster to plan for (GPUs, e.g. A100:1,L40S:1); "
                            f"{parsed.describe()} has cpu workers: plan for the workers themselves with --policy")
    names = tuple(t.name for t in cluster_targets(parsed))
    if len(names) != workers:
        raise RunSetupError(f"--placement-for {parsed.describe()} has {len(names)} placement target"
                            f"{'s' if len(names) != 1 else ''} ({', '.join(names)}; one per device type) and each "
                            f"runs on one cpu worker, but --cluster has {workers} workers; use --cluster "
                            f"cpu:{len(names)}")
    return TargetMap(parsed.describe(), names)


def placement_for(model: str, graphs: dict[str, KernelGraph], workers: int, cluster: str, policy: str,
                  max_tokens: int, device: str | None = None, fallback_profile=None,
                  log: Callable[[str], None] = lambda s: None) -> RunPlacement:
    """Plan ``policy`` on ``cluster`` (its cost model) for these graphs and map its targets onto the workers.
    Re-planning after a lost worker plans ``tessera`` for the surviving workers themselves (with
    ``fallback_profile``, this host's measured kernel times), as for a plan file.

    Raises:
        RunSetupError: see :func:`target_map`.
        PlanFileError: the plan cannot run on one runner (replicas, expert splits, not feasible).
    """
    from tessera.plan.planner import plan_policy

    mapping = target_map(cluster, workers)
    prefill = graphs["prefill"]
    pctx = runtime_context(model, workers, prefill.meta["seq"], max_tokens, prefill.meta["ctx"], log=log,
                           cluster=cluster)
    plan = plan_policy(pctx, policy, "throughput", device)
    placements, mbs = placements_from_plan(plan, graphs, workers, f"the {policy} plan for {mapping.cluster}",
                                           mapping.worker_of)
    per_token = f"{plan.latency_s * 1e3:.3g} ms" if plan.latency_s < 1 else f"{plan.latency_s:.3g} s"
    how = (f"{policy} plan for {mapping.cluster} (its cost model: {per_token} per token predicted"
           f"{'; ' + plan.reason if plan.reason else ''}), run on stand-in workers {mapping.describe()}")

    def replan(n: int) -> dict[str, list[int]]:
        return policy_placement(model, graphs, n, "tessera", max_tokens, fallback_profile, log=log).placements

    return RunPlacement(placements, mbs, how, replan, plan)
