"""Synthetic placements for stress tests: alternating devices, and random valid placements.

Both respect what every placement must: kernels that touch the same state buffer share a device, and
kernels the PTX analysis flags indirect stay with their neighbours (the same co-location units the
planner uses, :func:`tessera.graph.dataflow.colocation_units`). Units are numbered by their first kernel, so
consecutive units land on different devices under ``alternate``.
"""

from __future__ import annotations

import random

from tessera.graph.dataflow import colocation_units
from tessera.graph.ir import KernelGraph
from tessera.program.program import PlacementError

PLACEMENTS = ("alternate", "random")


def synthetic_placement(graph: KernelGraph, devices: int, kind: str, seed: int = 0) -> list[int]:
    """``alternate``: consecutive units on alternating devices (the most cut edges); ``random``: each unit
    on a device drawn with ``seed``. State used by several phases may land on different devices in each;
    the runtime then moves it explicitly."""
    if kind not in PLACEMENTS:
        raise PlacementError(f"unknown placement {kind!r}; use one of {', '.join(PLACEMENTS)}")
    if devices < 1:
        raise PlacementError(f"a placement needs at least one device, got {devices}")
    units = colocation_units(graph)
    rng = random.Random(seed)
    n_units = max(units) + 1 if units else 0
    unit_device = [u % devices if kind == "alternate" else rng.randrange(devices) for u in range(n_units)]
    return [unit_device[u] for u in units]
