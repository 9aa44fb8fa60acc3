"""Clusters: shorthand, links and transfer times, cpu workers, and cluster files with their errors."""

from __future__ import annotations

import pytest
import yaml

from tessera.hardware.cluster import ClusterSpecError, Link, load_cluster_yaml, parse_cluster
from tessera.hardware.host import host_cores


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """Host measurements go to one temporary cache for this module."""
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path_factory.getbasetemp() / "tessera-cache"))


def test_shorthand_counts_nodes_and_ids():
    c = parse_cluster("A100:2,L40S:1")
    assert [d.id for d in c.devices] == ["A100:0", "A100:1", "L40S:0"]
    assert [d.index for d in c.devices] == [0, 1, 0]
    assert len(c.nodes) == 2 and c.devices[0].node == c.devices[1].node != c.devices[2].node
    assert {k: [d.id for d in v] for k, v in c.types().items()} == {"A100": ["A100:0", "A100:1"], "L40S": ["L40S:0"]}
    assert c.describe() == "A100:2 + L40S:1 (2 nodes, 200 Gb/s IB)"
    assert parse_cluster("a100-sxm:2").describe() == "A100:2 (1 node, NVLink)"
    one_each = parse_cluster("A100, L40S")
    assert [d.id for d in one_each.devices] == ["A100:0", "L40S:0"]


def test_links_between_devices():
    c = parse_cluster("A100:2,L40S:2")
    nv = c.link("A100:0", "A100:1")
    assert nv.kind == "nvlink" and nv.bandwidth == pytest.approx(300e9)
    pcie = c.link("L40S:0", "L40S:1")
    assert pcie.kind == "pcie" and pcie.bandwidth == pytest.approx(32e9)
    ib = c.link("A100:1", "L40S:0")
    assert ib.kind == "ib" and ib.bandwidth == pytest.approx(25e9) and ib == c.link("L40S:0", "A100:1")
    assert c.link("A100:0", "A100:0").transfer_time(10**9) == 0.0
    with pytest.raises(ClusterSpecError, match="A100:7.*A100:0, A100:1, L40S:0, L40S:1"):
        c.link("A100:7", "A100:0")


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    link = Link("ib", 25e9, 5e-6)
    assert link.transfer_time(25 * 10**9) == pytest.approx(1.0 + 5e-6)
    assert link.transfer_time(1000) == pytest.approx(5e-6 + 1000 / 25e9)
    assert link.transfer_time(0) == 0.0
    with pytest.raises(ValueError):
        link.transfer_time(-1)
    with pytest.raises(ClusterSpecError, match="carrier pigeon"):
        Link("carrier pigeon", 1.0, 1.0)
    with pytest.raises(ClusterSpecError, match="positive bandwidth"):
        Link("ib", 0.0, 1e-6)


def test_cpu_workers_share_the_host():
    c = parse_cluster("cpu:2")
    assert [d.id for d in c.devices] == ["cpu:0", "cpu:1"] and len(c.nodes) == 1
    assert all(d.spec.threads == max(1, host_cores() // 2) and d.spec.measured for d in c.devices)
    link = c.link("cpu:0", "cpu:1")
    assert link.kind == "loopback" and link.bandwidth == pytest.approx(c.devices[0].spec.memory_bandwidth / 2)
    assert c.describe().startswith("cpu:2 (1 node, loopback")


@pytest.mark.parametrize("spec,expected", [
    ("A100:x", ["item 1", "'A100:x'", "count 'x' is not a whole number", "TYPE:COUNT"]),
    ("A100:0", ["item 1", "at least 1", "TYPE:COUNT"]),
    (":2", ["item 1", "no device type", "TYPE:COUNT"]),
    ("A100:2,,L40S", ["item 2", "empty item", "TYPE:COUNT"]),
    ("A100:2,A10O", ["item 2", "'A10O'", "did you mean", "A100", "A10"]),
    ("", ["empty cluster spec", "TYPE:COUNT"]),
    ("A100,A100-SXM:2", ["item 2", "listed twice", "'A100:3'"]),
])
def test_malformed_shorthand(spec, expected):
    with pytest.raises(ClusterSpecError) as e:
        parse_cluster(spec)
    for part in expected:
        assert part in str(e.value)


def test_cluster_file_round_trip(tmp_path):
    c = parse_cluster("A100:2,L40S:1,cpu:2")
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(c.to_dict()))
    back = parse_cluster(str(path))
    assert back.describe() == c.describe()
    assert back.nodes == c.nodes and [d.id for d in back.devices] == [d.id for d in c.devices]
    assert [d.spec for d in back.devices] == [d.spec for d in c.devices]
    for a in c.devices:
        for b in c.devices:
            la, lb = c.link(a.id, b.id), back.link(a.id, b.id)
            assert la.kind == lb.kind
            assert la.bandwidth == pytest.approx(lb.bandwidth) and la.latency_s == pytest.approx(lb.latency_s)


def test_cluster_file_links_and_network(tmp_path):
    path = tmp_path / "fleet.yml"
    path.write_text("""
nodes:
  - name: big
    devices: {A100: 2, H100: 1}
  - name: forced
    devices: {A100-SXM: 2}
    link: pcie
  - devices: {L40S: 2}
    link: {kind: pcie, bandwidth_gb_s: 64, latency_us: 3}
network: {kind: ethernet, bandwidth_gbps: 400}
""")
    c = load_cluster_yaml(path)
    assert c.nodes == ["big", "forced", "node2"]
    assert [d.id for d in c.devices] == ["A100:0", "A100:1", "H100:0", "A100:2", "A100:3", "L40S:0", "L40S:1"]
    assert c.link("A100:0", "H100:0").kind == "pcie"  # mixed types in a node: PCIe
    assert c.link("A100:2", "A100:3").kind == "pcie"
    explicit = c.link("L40S:0", "L40S:1")
    assert explicit.bandwidth == pytest.approx(64e9) and explicit.latency_s == pytest.approx(3e-6)
    net = c.link("A100:0", "L40S:0")
    assert net.kind == "ethernet" and net.bandwidth == pytest.approx(50e9) and net.latency_s == pytest.approx(20e-6)
    assert c.describe() == "A100:4 + H100:1 + L40S:2 (3 nodes, 400 Gb/s Ethernet)"


@pytest.mark.parametrize("text,expected", [
    ("- just a list", ["document", "expected a mapping"]),
    ("network: ib", ["document.nodes", "missing"]),
    ("nodes: []", ["nodes", "non-empty list"]),
    ("nodes: [{devices: {A100: 2}}, {devices: {A10O: 1}}]", ["nodes[1].devices.A10O", "did you mean"]),
    ("nodes: [{devices: {A100: 0}}]", ["nodes[0].devices.A100", "whole number >= 1"]),
    ("nodes: [{devices: {}}]", ["nodes[0].devices", "mapping of device type to count"]),
    ("nodes: [{devices: {A100: 1}, gpus: 2}]", ["nodes[0].gpus", "unknown key"]),
    ("nodes: [{name: a, devices: {A100: 1}}, {name: a, devices: {L4: 1}}]", ["nodes[1].name", "earlier node"]),
    ("nodes: [{devices: {L40S: 2}, link: nvlink}]", ["nodes[0].link.kind", "L40S has no NVLink"]),
    ("nodes: [{devices: {A100: 2}, link: warp}]", ["nodes[0].link.kind", "unknown link kind 'warp'"]),
    ("nodes: [{devices: {A100: 2}, link: loopback}]", ["nodes[0].link.kind", "loopback links only cpu"]),
    ("nodes: [{devices: {A100: 2}, link: {kind: pcie, bandwidth_gbps: -4}}]",
     ["nodes[0].link.bandwidth_gbps", "positive number"]),
    ("nodes: [{devices: {A100: 1}}]\nnetwork: {kind: ib, bandwidth_gbps: 0}", ["network.bandwidth_gbps", "positive"]),
    ("nodes: [{devices: {A100: 1}}]\nnetwork: nvlink", ["network.kind", "ib or ethernet"]),
    ("nodes: [{devices: {cpu: 1, A100: 1}}]", ["nodes[0].devices", "node of their own"]),
    ("nodes: [{devices: {cpu: 1}}, {devices: {host: 1}}]", ["nodes[1].devices", "one node"]),
    ("nodes: [{devices: {A100: 1}", ["not valid YAML"]),
])
def test_cluster_file_errors_name_the_path_in_the_document(tmp_path, text, expected):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(ClusterSpecError) as e:
        parse_cluster(path)
    msg = str(e.value)
    assert str(path) in msg
    for part in expected:
        assert part in msg


def test_missing_cluster_file(tmp_path):
    with pytest.raises(ClusterSpecError, match="cannot read the cluster file"):
        parse_cluster(tmp_path / "nope.yaml")
