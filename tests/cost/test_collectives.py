"""Device-group collectives and MoE routing, against hand-computed costs."""

from __future__ import annotations

import pytest

from tessera.cost.collectives import (
    CollectiveError,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    reduce_scatter_time,
)
from tessera.cost.routing import RoutingDistribution, RoutingError
from tessera.hardware.cluster import Link, parse_cluster

NVLINK = Link("nvlink", 100e9, 5e-6)


def test_ring_all_reduce():
    # 4 devices, 8 MB: 6 steps of (5 us + 2 MB / 100 GB/s = 20 us)
    assert all_reduce_time(8e6, 4, NVLINK) == pytest.approx(6 * 25e-6)
    assert all_reduce_time(8e6, 1, NVLINK) == 0.0 and all_reduce_time(0, 8, NVLINK) == 0.0


def test_all_gather_and_reduce_scatter():
    assert all_gather_time(8e6, 4, NVLINK) == pytest.approx(3 * 25e-6)
    assert reduce_scatter_time(8e6, 4, NVLINK) == all_gather_time(8e6, 4, NVLINK)


def test_all_to_all_with_imbalance():
    link = Link("nvlink", 50e9, 2e-6)
    # 8 devices, 16 MB each: 7 exchanges of (2 us + 1.5 x 2 MB / 50 GB/s = 60 us)
    assert all_to_all_time(16e6, 8, link, imbalance=1.5) == pytest.approx(7 * 62e-6)
    assert all_to_all_time(16e6, 8, link) < all_to_all_time(16e6, 8, link, imbalance=1.5)


def test_collectives_over_a_parsed_cluster_link():
    c = parse_cluster("H100:8")
    link = c.link("H100:0", "H100:7")
    assert link.kind == "nvlink"
    assert all_reduce_time(1e9, 8, link) == pytest.approx(14 * (link.latency_s + 1e9 / 8 / link.bandwidth))


def test_bad_collectives():
    with pytest.raises(CollectiveError, match="at least one device"):
        all_reduce_time(1e6, 0, NVLINK)
    with pytest.raises(CollectiveError, match="negative"):
        all_gather_time(-1, 2, NVLINK)
    with pytest.raises(CollectiveError, match="at least 1"):
        all_to_all_time(1e6, 2, NVLINK, imbalance=0.5)


def test_uniform_routing():
    r = RoutingDistribution(32, top_k=4)
    assert r.probabilities() == pytest.approx([1 / 32] * 32)
    assert r.expected_active(8) == pytest.approx(32 * (1 - (31 / 32) ** 8))
    assert r.imbalance(4) == pytest.approx(1.0)
    assert r.imbalance(3) == pytest.approx(11 / 32 * 3)  # 32 experts over 3 devices: 11, 11, 10


def test_skewed_routing():
    r = RoutingDistribution(4, top_k=2, skew=1.0)
    assert r.probabilities() == pytest.approx([0.48, 0.24, 0.16, 0.12])  # 1, 1/2, 1/3, 1/4 over 25/12
    # greedy, 2 experts per device: e1 -> d0 (.48), e2 -> d1 (.24), e3 -> d1 (.40), e4 -> d0 (.60)
    assert r.imbalance(2) == pytest.approx(0.60 * 2)
    two = RoutingDistribution(2, skew=1.0)  # p = 2/3, 1/3
    assert two.expected_active(2) == pytest.approx((1 - (1 / 3) ** 2) + (1 - (2 / 3) ** 2))
    assert RoutingDistribution(64, skew=1.2).expected_active(16) < RoutingDistribution(64).expected_active(16)


def test_bad_routing():
    with pytest.raises(RoutingError, match="top-k"):
        RoutingDistribution(8, top_k=9)
    with pytest.raises(RoutingError, match="Zipf"):
        RoutingDistribution(8, skew=-1)
    with pytest.raises(RoutingError, match="at least one expert"):
        RoutingDistribution(0)
