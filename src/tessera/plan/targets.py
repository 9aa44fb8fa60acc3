"""Placement targets: the logical devices a step plan places kernels on.

A target is one GPU, or several GPUs of one type acting as one device (a device group, sharded by
tensor and expert parallelism with the costs of :mod:`tessera.plan.groups`). A cluster offers its
devices as one target per type, optionally cut into ``replicas`` identical copies (each copy gets
count / replicas GPUs of every type), which is how hybrids of replicas and kernel placement arise.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from tessera.errors import TesseraError
from tessera.hardware.catalog import HOST_ID, DeviceSpec
from tessera.hardware.cluster import SAME_DEVICE, Cluster, Link
from tessera.plan.config import DEFAULT_MEMORY_UTILIZATION


class TargetError(TesseraError, ValueError):
    """A cluster that offers no targets, or a replica count that does not divide it."""


@dataclass(frozen=True)
class Target:
    """One placement target: ``size`` GPUs of type ``spec`` (cluster ids ``members``) acting as one device."""

    spec: DeviceSpec
    members: tuple[str, ...]
    intra: Link  # between the members (loopback for a single GPU)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def name(self) -> str:
        if self.spec.id == HOST_ID:  # local cpu workers are targets one by one
            return self.members[0]
        return self.spec.id if self.size == 1 else f"{self.spec.id}x{self.size}"

    def usable_bytes(self, utilization: float = DEFAULT_MEMORY_UTILIZATION) -> float:
        """Bytes an engine may use for weights, state and activations over all the target's GPUs: the
        ``utilization`` share of their memory (:func:`usable_memory`)."""
        return usable_memory(self.device_bytes, utilization)

    @property
    def device_bytes(self) -> float:
        """The memory of all the target's GPUs as their datasheets give it (engines admitting from memory
        keep their own utilisation share of it)."""
        return float(self.spec.memory_bytes * self.size)

    def price(self, scenario: str = "relative") -> float:
        """Price per hour of all the target's GPUs."""
        return self.spec.price(scenario) * self.size


def usable_memory(device_bytes, utilization: float = DEFAULT_MEMORY_UTILIZATION):
    """The memory an engine may use of ``device_bytes`` (a number or an array): its ``utilization`` share,
    as vLLM's ``gpu_memory_utilization`` (the rest is the CUDA context, allocator slack and workspaces).
    Every plan, admission and bound counts usable memory through this one function."""
    return device_bytes * utilization


def replica_counts(cluster: Cluster, types: list[str] | None = None) -> list[int]:
    """Replica counts that split every (selected) device type evenly, ascending."""
    counts = [len(v) for k, v in cluster.placement_types().items() if types is None or k in types]
    if not counts:
        raise TargetError(f"cluster {cluster.describe()} has no devices of the selected types")
    g = 0
    for c in counts:
        g = gcd(g, c)
    return [r for r in range(1, g + 1) if g % r == 0]


def cluster_targets(cluster: Cluster, replicas: int = 1, types: list[str] | None = None) -> list[Target]:
    """The targets of one replica: per device type (in cluster order), count / replicas GPUs as one target."""
    if not cluster.devices:
        raise TargetError("the cluster has no devices; give at least one, e.g. --cluster A100:1,L40S:1")
    out = []
    for rid, devices in cluster.placement_types().items():
        if types is not None and rid not in types:
            continue
        if len(devices) % replicas:
            raise TargetError(f"{len(devices)} {rid} cannot be split into {replicas} equal replicas")
        members = devices[: len(devices) // replicas]
        intra = SAME_DEVICE if len(members) == 1 else cluster.link(members[0].id, members[1].id)
        out.append(Target(members[0].spec, tuple(d.id for d in members), intra))
    if not out:
        raise TargetError(f"cluster {cluster.describe()} has none of the device types {types}")
    return out


def link_between(cluster: Cluster, a: Target, b: Target) -> Link:
    """The link carrying transfers from target a to target b (their first GPUs')."""
    return cluster.link(a.members[0], b.members[0])
