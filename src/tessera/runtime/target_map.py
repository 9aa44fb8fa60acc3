"""Which cpu worker stands in for each target of a plan made for another cluster (GPUs, e.g.
``A100:1,L40S:1``): target i (one per device type, in cluster order) runs on worker cpu:i, so every kernel,
transfer and state move of the plan happens as planned, only slower. The plan itself is made by
:func:`tessera.runtime.session.placement_for` (or read from a plan file)."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import TesseraError
from tessera.hardware.catalog import HOST_ID
from tessera.hardware.cluster import parse_cluster


class TargetMapError(TesseraError):
    """A cluster or plan whose targets cannot be mapped onto the run's cpu workers one to one."""


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
        TargetMapError: the cluster names cpu workers, or its target count differs from ``workers``.
    """
    from tessera.plan.targets import cluster_targets

    parsed = parse_cluster(cluster)
    if any(d.spec.id == HOST_ID for d in parsed.devices):
        raise TargetMapError(f"--placement-for names the cluster to plan for (GPUs, e.g. A100:1,L40S:1); "
                            f"{parsed.describe()} has cpu workers: plan for the workers themselves with --policy")
    names = tuple(t.name for t in cluster_targets(parsed))
    if len(names) != workers:
        raise TargetMapError(f"--placement-for {parsed.describe()} has {len(names)} placement target"
                            f"{'s' if len(names) != 1 else ''} ({', '.join(names)}; one per device type) and each "
                            f"runs on one cpu worker, but --cluster has {workers} workers; use --cluster "
                            f"cpu:{len(names)}")
    return TargetMap(parsed.describe(), names)


def plan_target_map(targets: list[str], cluster: str, workers: int, source: str) -> TargetMap | None:
    """The map of a plan's ``targets`` onto ``workers`` cpu workers in order, or None when the plan was made
    for cpu workers (its targets are the workers themselves).

    Raises:
        TargetMapError: the plan has GPU targets and their count differs from ``workers``.
    """
    if all(t.startswith(f"{HOST_ID}:") for t in targets):
        return None
    if len(targets) != workers:
        raise TargetMapError(f"{source} has {len(targets)} target{'s' if len(targets) != 1 else ''} "
                            f"({', '.join(targets)}) and each runs on one cpu worker, but --cluster has {workers} "
                            f"workers; use --cluster cpu:{len(targets)}")
    return TargetMap(cluster, tuple(targets))
