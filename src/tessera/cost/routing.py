"""How an MoE router spreads tokens over experts: a stated distribution with a skew knob.

Expert popularity follows a Zipf law, p(rank r) ~ 1 / r**skew over the experts (skew 0: uniform, the
load a balanced router aims at; around 1: the few hot experts measured in real traffic). From it:
how many distinct experts a batch touches (each one's weights are read once), and how unequal the
expert loads of a device group are once experts are spread over its devices.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from tessera.errors import TesseraError


class RoutingError(TesseraError, ValueError):
    """An impossible routing distribution (no experts, top-k above the experts, negative skew)."""


@dataclass(frozen=True)
class RoutingDistribution:
    """Top-k routing of tokens over ``experts`` with Zipf popularity of exponent ``skew``."""

    experts: int
    top_k: int = 1
    skew: float = 0.0

    def __post_init__(self) -> None:
        if self.experts < 1:
            raise RoutingError(f"an MoE layer needs at least one expert (got {self.experts})")
        if not 1 <= self.top_k <= self.experts:
            raise RoutingError(f"top-k must be between 1 and the {self.experts} experts (got {self.top_k})")
        if self.skew < 0:
            raise RoutingError(f"routing skew is a Zipf exponent, 0 (uniform) or more (got {self.skew})")

    def probabilities(self) -> list[float]:
        """Share of token-expert assignments each expert receives, hottest first (sums to 1)."""
        weights = [1.0 / (rank ** self.skew) for rank in range(1, self.experts + 1)]
        total = sum(weights)
        return [w / total for w in weights]

    def expected_active(self, assignments: int) -> float:
        """Expected distinct experts among ``assignments`` token-expert pairs (tokens x top-k)."""
        if assignments <= 0:
            return 0.0
        return sum(1.0 - (1.0 - p) ** assignments for p in self.probabilities())

    def imbalance(self, devices: int) -> float:
        """Max / mean expert load over ``devices`` when experts are spread greedily (hottest first onto the
        least-loaded device), as an expert-parallel placement would; 1.0 is perfectly even."""
        if devices < 1:
            raise RoutingError(f"experts must be spread over at least one device (got {devices})")
        if devices == 1:
            return 1.0
        loads = [(0.0, d) for d in range(devices)]
        counts = [0] * devices
        per_device = -(-self.experts // devices)  # devices hold equal expert counts (memory)
        for p in self.probabilities():
            held = []
            load, d = heapq.heappop(loads)
            while counts[d] >= per_device:
                held.append((load, d))
                load, d = heapq.heappop(loads)
            counts[d] += 1
            heapq.heappush(loads, (load + p, d))
            for item in held:
                heapq.heappush(loads, item)
        return max(load for load, _ in loads) * devices
