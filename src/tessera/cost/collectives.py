"""Time of the collectives a device group runs (alpha-beta model over the group's link).

A group of n devices of one type, joined by one link (latency alpha per message, bandwidth B bytes/s
per direction per device), runs ring algorithms: every step each device sends one n-th of the data
to its neighbour. Tensor parallelism all-reduces partial GEMM outputs; expert parallelism exchanges
tokens with an all-to-all, slowed by the busiest device when experts' loads are unequal.
"""

from __future__ import annotations

from tessera.errors import TesseraError
from tessera.hardware.cluster import Link


class CollectiveError(TesseraError, ValueError):
    """A collective over an impossible group (no devices, negative bytes, imbalance below 1)."""


def _check(nbytes: float, devices: int) -> None:
    if devices < 1:
        raise CollectiveError(f"a collective needs at least one device (got {devices})")
    if nbytes < 0:
        raise CollectiveError(f"a collective cannot move a negative number of bytes (got {nbytes})")


def all_reduce_time(nbytes: float, devices: int, link: Link) -> float:
    """Ring all-reduce of an ``nbytes`` tensor held by each of ``devices``: 2(n-1) steps of nbytes/n."""
    _check(nbytes, devices)
    if devices == 1 or nbytes == 0:
        return 0.0
    steps = 2 * (devices - 1)
    return steps * (link.latency_s + nbytes / devices / link.bandwidth)


def all_gather_time(nbytes: float, devices: int, link: Link) -> float:
    """Ring all-gather of an ``nbytes`` result of which each device holds one n-th: n-1 steps of nbytes/n.
    A reduce-scatter costs the same."""
    _check(nbytes, devices)
    if devices == 1 or nbytes == 0:
        return 0.0
    return (devices - 1) * (link.latency_s + nbytes / devices / link.bandwidth)


reduce_scatter_time = all_gather_time


def all_to_all_time(nbytes_per_device: float, devices: int, link: Link, imbalance: float = 1.0) -> float:
    """Pairwise all-to-all: each device sends (n-1)/n of its ``nbytes_per_device`` in n-1 exchanges.
    ``imbalance`` (max / mean load, >= 1) stretches the transfer to the busiest device's share."""
    _check(nbytes_per_device, devices)
    if imbalance < 1:
        raise CollectiveError(f"load imbalance is max/mean load, at least 1 (got {imbalance})")
    if devices == 1 or nbytes_per_device == 0:
        return 0.0
    return (devices - 1) * (link.latency_s + imbalance * nbytes_per_device / devices / link.bandwidth)
