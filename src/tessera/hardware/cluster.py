"""Clusters: which devices there are, on which nodes, and the links between them.

A cluster is written either as shorthand, "A100:2,L40S:1" (each device type on its own node; same-type
GPUs in a node talk over NVLink when the part has it, else PCIe; nodes over 200 Gb/s InfiniBand; "cpu:N"
= N local workers on this host over a loopback link), or as a YAML file (`load_cluster_yaml`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.documents import read_yaml
from tessera.errors import TesseraError
from tessera.hardware.catalog import HOST_ID, DeviceSpec, UnknownDeviceError, canonical_id
from tessera.hardware.devices import resolve_device
from tessera.hardware.host import host_spec, worker_threads
from tessera.limits import CLUSTER_DEVICES, CPU_WORKERS

LINK_KINDS = ("nvlink", "pcie", "ib", "ethernet", "loopback")
LINK_NAMES = {"nvlink": "NVLink", "pcie": "PCIe", "ib": "IB", "ethernet": "Ethernet", "loopback": "loopback"}
# Per-message latency of each kind, seconds (software stack included; estimates).
DEFAULT_LATENCY_S = {"nvlink": 2e-6, "pcie": 5e-6, "ib": 5e-6, "ethernet": 20e-6, "loopback": 1e-6}
# Network bandwidth when a file names only the kind, Gb/s (bits).
DEFAULT_NETWORK_GBPS = {"ib": 200.0, "ethernet": 100.0}
SHORTHAND_FORMAT = "TYPE or TYPE:COUNT items separated by commas, e.g. 'A100:2,L40S:1' or 'cpu:2'"


class ClusterSpecError(TesseraError):
    """A cluster shorthand or cluster file that cannot be read (the message says where and what is expected)."""


@dataclass(frozen=True)
class Link:
    """A connection between two devices: bandwidth in bytes/s per direction, latency in seconds per message."""

    kind: str
    bandwidth: float
    latency_s: float

    def __post_init__(self):
        if self.kind not in LINK_KINDS:
            raise ClusterSpecError(f"unknown link kind {self.kind!r}; kinds: {', '.join(LINK_KINDS)}")
        if not self.bandwidth > 0 or not self.latency_s >= 0:
            raise ClusterSpecError(f"{self.kind} link needs a positive bandwidth and a latency >= 0, "
                                   f"got {self.bandwidth!r} B/s and {self.latency_s!r} s")

    def transfer_time(self, nbytes: int) -> float:
        """Seconds to move `nbytes` over this link: latency + nbytes / bandwidth (0 bytes take no time)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return 0.0 if nbytes == 0 else self.latency_s + nbytes / self.bandwidth

    def to_dict(self) -> dict[str, Any]:
        """The cluster-file form of this link (bandwidth in Gb/s, latency in microseconds)."""
        return {"kind": self.kind, "bandwidth_gbps": self.bandwidth * 8 / 1e9, "latency_us": self.latency_s * 1e6}


SAME_DEVICE = Link("loopback", math.inf, 0.0)  # a device "talking to itself": nothing moves


@dataclass(frozen=True)
class DeviceInstance:
    """One device of a cluster: id "TYPE:index" (index within its type), its spec and its node."""

    id: str
    spec: DeviceSpec
    node: str
    index: int


@dataclass
class Cluster:
    """Devices on nodes; `intra` links devices within a node, `inter` links nodes."""

    nodes: list[str]
    devices: list[DeviceInstance]
    intra: dict[str, Link]
    inter: Link

    def _instance(self, device_id: str) -> DeviceInstance:
        for d in self.devices:
            if d.id == device_id:
                return d
        raise ClusterSpecError(f"no device {device_id!r} in cluster {self.describe()}; devices: "
                               f"{', '.join(d.id for d in self.devices)}")

    def link(self, a: str, b: str) -> Link:
        """The link between devices `a` and `b` (DeviceInstance ids); a device to itself costs nothing."""
        da, db = self._instance(a), self._instance(b)
        if da.id == db.id:
            return SAME_DEVICE
        return self.intra[da.node] if da.node == db.node else self.inter

    def types(self) -> dict[str, list[DeviceInstance]]:
        """Devices grouped by canonical device id, in order of first appearance."""
        out: dict[str, list[DeviceInstance]] = {}
        for d in self.devices:
            out.setdefault(d.spec.id, []).append(d)
        return out

    def placement_types(self) -> dict[str, list[DeviceInstance]]:
        """Like :meth:`types`, but every local cpu worker is a type of its own ("cpu:0", "cpu:1"): each worker
        is its own placement target, so kernels can be split between the workers."""
        out: dict[str, list[DeviceInstance]] = {}
        for d in self.devices:
            out.setdefault(d.id if d.spec.id == HOST_ID else d.spec.id, []).append(d)
        return out

    def describe(self) -> str:
        """One line, e.g. "A100:2 + L40S:1 (2 nodes, 200 Gb/s IB)"."""
        parts = " + ".join(f"{rid}:{len(ds)}" for rid, ds in self.types().items())
        if len(self.nodes) > 1:
            where = f"{len(self.nodes)} nodes, {self.inter.bandwidth * 8 / 1e9:g} Gb/s {LINK_NAMES[self.inter.kind]}"
        else:
            where = f"1 node, {LINK_NAMES[self.intra[self.nodes[0]].kind]}"
        threads = {d.spec.threads for d in self.devices if d.spec.id == HOST_ID}
        if len(threads) == 1:
            n = threads.pop()
            where += f", {n} thread{'s' if n != 1 else ''} per cpu worker"
        return f"{parts} ({where})"

    def to_dict(self) -> dict[str, Any]:
        """The cluster-file form of this cluster; `load_cluster_yaml` reads it back."""
        nodes = []
        for name in self.nodes:
            counts: dict[str, int] = {}
            for d in self.devices:
                if d.node == name:
                    counts[d.spec.id] = counts.get(d.spec.id, 0) + 1
            nodes.append({"name": name, "devices": counts, "link": self.intra[name].to_dict()})
        return {"nodes": nodes, "network": self.inter.to_dict()}


def _default_intra(specs: list[DeviceSpec]) -> Link:
    """NVLink between same-type parts that have it, loopback between cpu workers, else PCIe."""
    kinds = {s.id for s in specs}
    if kinds == {HOST_ID}:
        return Link("loopback", min(s.pcie_bandwidth for s in specs), DEFAULT_LATENCY_S["loopback"])
    if len(kinds) == 1 and specs[0].nvlink_bandwidth is not None:
        return Link("nvlink", specs[0].nvlink_bandwidth, DEFAULT_LATENCY_S["nvlink"])
    return Link("pcie", min(s.pcie_bandwidth for s in specs), DEFAULT_LATENCY_S["pcie"])


def _cpu_spec(workers: int) -> DeviceSpec | None:
    """This host's spec for one of `workers` local workers (cores // workers threads); None for 0 workers."""
    return host_spec(worker_threads(workers)) if workers else None


def _build(groups: list[tuple[str, dict[str, int]]], links: dict[str, Link | None], inter: Link) -> Cluster:
    """A cluster from (node, {canonical id: count}) groups; a None link takes the default rule."""
    cpu = _cpu_spec(sum(c.get(HOST_ID, 0) for _, c in groups))
    devices, seen, intra = [], {}, {}
    for node, counts in groups:
        specs = []
        for rid, count in counts.items():
            spec = cpu if rid == HOST_ID else resolve_device(rid)
            for _ in range(count):
                index = seen.get(rid, 0)
                seen[rid] = index + 1
                devices.append(DeviceInstance(id=f"{rid}:{index}", spec=spec, node=node, index=index))
                specs.append(spec)
        intra[node] = links.get(node) or _default_intra(specs)
    return Cluster(nodes=[n for n, _ in groups], devices=devices, intra=intra, inter=inter)


def _shorthand_item(spec: str, position: int, item: str) -> tuple[str, int]:
    def fail(problem: str) -> ClusterSpecError:
        return ClusterSpecError(f"cluster spec {spec!r}, item {position} ({item!r}): {problem}; "
                                f"expected {SHORTHAND_FORMAT}")

    name, sep, count = (p.strip() for p in item.partition(":"))
    if not item.strip():
        raise fail("empty item")
    if not name:
        raise fail("no device type before ':'")
    where = f"cluster spec {spec!r}, item {position} ({item.strip()!r})"
    n = CLUSTER_DEVICES.parse(count, where) if sep else 1
    if n is None:
        raise fail(f"count {count!r} is not a whole number")
    if n < 1:
        raise fail("count must be at least 1")
    try:
        rid = canonical_id(name)
    except UnknownDeviceError as e:
        raise fail(str(e)) from None
    _check_counts({rid: n}, where)
    return rid, n


def _check_counts(counts: dict[str, int], where: str) -> None:
    """Refuse more devices, or more local cpu workers, than `tessera.limits` allows (before any is built)."""
    CPU_WORKERS.check(counts.get(HOST_ID, 0), where)
    CLUSTER_DEVICES.check(sum(counts.values()), where)


def parse_cluster(spec: str | Path) -> Cluster:
    """A cluster from shorthand ("A100:2,L40S:1", "cpu:2") or from a .yaml/.yml cluster file.

    Shorthand: each device type is its own node; same-type GPUs in a node use NVLink when the part has
    it, else PCIe; nodes talk over 200 Gb/s InfiniBand. "cpu:N" is N workers on this host, each with
    cores // N threads, over a loopback link (a memory copy).

    Raises:
        ClusterSpecError: a malformed item or an unknown device (the message names the item).
    """
    text = str(spec).strip()
    if text.lower().endswith((".yaml", ".yml")):
        return load_cluster_yaml(text)
    if not text:
        raise ClusterSpecError(f"empty cluster spec; expected {SHORTHAND_FORMAT}")
    groups: dict[str, int] = {}
    for position, item in enumerate(text.split(","), 1):
        rid, count = _shorthand_item(text, position, item)
        if rid in groups:
            raise ClusterSpecError(f"cluster spec {text!r}, item {position} ({item.strip()!r}): {rid} is listed "
                                   f"twice; give one count per type, e.g. '{rid}:{groups[rid] + count}'")
        groups[rid] = count
        _check_counts(groups, f"cluster spec {text!r}")
    inter = Link("ib", DEFAULT_NETWORK_GBPS["ib"] * 1e9 / 8, DEFAULT_LATENCY_S["ib"])
    return _build([(f"node{i}", {rid: n}) for i, (rid, n) in enumerate(groups.items())], {}, inter)


# ---------------------------------------------------------------------------------------------------------
# Cluster files

class _Doc:
    """Schema checks of one cluster file; failures name the file and the path inside the document."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, problem: str) -> ClusterSpecError:
        return ClusterSpecError(f"{self.path}: {where}: {problem}")

    def mapping(self, value: Any, where: str, allowed: set[str], required: set[str] = frozenset()) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, f"expected a mapping with keys {', '.join(sorted(allowed))}, got {value!r}")
        for key in value:
            if key not in allowed:
                raise self.fail(f"{where}.{key}", f"unknown key (allowed: {', '.join(sorted(allowed))})")
        for key in sorted(required - set(value)):
            raise self.fail(f"{where}.{key}", "missing")
        return value

    def positive(self, value: Any, where: str, zero_ok: bool = False) -> float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and (value >= 0 if zero_ok else value > 0)
        if not ok:
            raise self.fail(where, f"expected a {'non-negative' if zero_ok else 'positive'} number, got {value!r}")
        return float(value)

    def link(self, value: Any, where: str, specs: list[DeviceSpec] | None) -> Link:
        """A link: a kind name, or {kind, bandwidth_gbps (Gb/s) or bandwidth_gb_s (GB/s), latency_us}."""
        if isinstance(value, str):
            value = {"kind": value}
        value = self.mapping(value, where, {"kind", "bandwidth_gbps", "bandwidth_gb_s", "latency_us"}, {"kind"})
        kind = value["kind"]
        if kind not in LINK_KINDS:
            raise self.fail(f"{where}.kind", f"unknown link kind {kind!r}; kinds: {', '.join(LINK_KINDS)}")
        if "bandwidth_gbps" in value and "bandwidth_gb_s" in value:
            raise self.fail(where, "give bandwidth_gbps (Gb/s) or bandwidth_gb_s (GB/s), not both")
        if "bandwidth_gbps" in value:
            bandwidth = self.positive(value["bandwidth_gbps"], f"{where}.bandwidth_gbps") * 1e9 / 8
        elif "bandwidth_gb_s" in value:
            bandwidth = self.positive(value["bandwidth_gb_s"], f"{where}.bandwidth_gb_s") * 1e9
        else:
            bandwidth = self._default_bandwidth(kind, where, specs)
        latency = (self.positive(value["latency_us"], f"{where}.latency_us", zero_ok=True) * 1e-6
                   if "latency_us" in value else DEFAULT_LATENCY_S[kind])
        return Link(kind, bandwidth, latency)

    def _default_bandwidth(self, kind: str, where: str, specs: list[DeviceSpec] | None) -> float:
        if kind in DEFAULT_NETWORK_GBPS:
            return DEFAULT_NETWORK_GBPS[kind] * 1e9 / 8
        if specs is None:
            raise self.fail(f"{where}.kind", f"a network between nodes is ib or ethernet, or gives "
                                             f"bandwidth_gbps; {kind!r} has no default bandwidth there")
        if kind == "loopback" and any(s.id != HOST_ID for s in specs):
            raise self.fail(f"{where}.kind", "loopback links only cpu workers; GPUs use nvlink or pcie")
        if kind == "nvlink":
            lacking = sorted({s.id for s in specs if s.nvlink_bandwidth is None})
            if lacking:
                raise self.fail(f"{where}.kind", f"{', '.join(lacking)} has no NVLink; use pcie")
            return min(s.nvlink_bandwidth for s in specs)
        return min(s.pcie_bandwidth for s in specs)

    def devices(self, value: Any, where: str) -> dict[str, int]:
        if not isinstance(value, dict) or not value:
            raise self.fail(where, f"expected a mapping of device type to count, e.g. {{A100: 2}}, got {value!r}")
        counts: dict[str, int] = {}
        for name, count in value.items():
            try:
                rid = canonical_id(str(name))
            except UnknownDeviceError as e:
                raise self.fail(f"{where}.{name}", str(e)) from None
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise self.fail(f"{where}.{name}", f"expected a whole number >= 1, got {count!r}")
            if rid in counts:
                raise self.fail(f"{where}.{name}", f"{rid} is listed twice in this node")
            counts[rid] = count
            _check_counts(counts, f"{self.path}: {where}.{name}")
        if HOST_ID in counts and len(counts) > 1:
            raise self.fail(where, "cpu workers take a node of their own")
        return counts


def load_cluster_yaml(path: str | Path) -> Cluster:
    """A cluster from a YAML file.

    Format::

        nodes:
          - name: a            # optional, default node<i>
            devices: {A100: 2}
            link: nvlink       # optional: nvlink | pcie | loopback | {kind, bandwidth_gbps, latency_us}
          - devices: {L40S: 1}
        network: {kind: ib, bandwidth_gbps: 200, latency_us: 5}   # optional, default 200 Gb/s IB

    `bandwidth_gbps` is gigabits per second (network convention); `bandwidth_gb_s` (gigabytes per second)
    may be given instead. A link named without a bandwidth takes the devices' figures (NVLink, PCIe) or
    the network default (ib 200, ethernet 100 Gb/s). All cpu workers share one node (this host).

    Raises:
        ClusterSpecError: the file is missing, not YAML, or breaks the schema (the message names the file
            and the path in the document, e.g. nodes[1].devices).
    """
    p = Path(path)
    raw = read_yaml(p, "cluster file", ClusterSpecError)
    doc = _Doc(p)
    top = doc.mapping(raw, "document", {"nodes", "network"}, {"nodes"})
    if not isinstance(top["nodes"], list) or not top["nodes"]:
        raise doc.fail("nodes", f"expected a non-empty list of nodes, got {top['nodes']!r}")
    nodes, names = [], set()
    for i, node in enumerate(top["nodes"]):
        where = f"nodes[{i}]"
        node = doc.mapping(node, where, {"name", "devices", "link"}, {"devices"})
        name = node.get("name", f"node{i}")
        if not isinstance(name, str) or not name.strip() or name in names:
            problem = "is used by an earlier node" if name in names else "expected a non-empty string"
            raise doc.fail(f"{where}.name", f"{problem}, got {name!r}")
        names.add(name)
        counts = doc.devices(node["devices"], f"{where}.devices")
        if HOST_ID in counts and any(HOST_ID in c for _, c, _ in nodes):
            raise doc.fail(f"{where}.devices", "cpu workers all run on this host: put them in one node")
        nodes.append((name, counts, node))
        totals: dict[str, int] = {}
        for _, c, _ in nodes:
            for rid, n in c.items():
                totals[rid] = totals.get(rid, 0) + n
        _check_counts(totals, f"{p}: nodes[0..{i}]")
    cpu = _cpu_spec(sum(c.get(HOST_ID, 0) for _, c, _ in nodes))
    links = {}
    for i, (name, counts, node) in enumerate(nodes):
        specs = [cpu if rid == HOST_ID else resolve_device(rid) for rid in counts]
        links[name] = doc.link(node["link"], f"nodes[{i}].link", specs) if "link" in node else None
    inter = doc.link(top.get("network", "ib"), "network", None)
    return _build([(name, counts) for name, counts, _ in nodes], links, inter)
