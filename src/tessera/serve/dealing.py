"""Which route of an engine of several routes (`serve --plan` of a route mix or request-dist's replicas) a new
request takes: the router's rule (`tessera.plan.shares`), so that Tessera's own engine and the router in front
of vLLM engines send requests alike.

``auto`` (the default) puts every request on the route of the lowest planned latency while the requests in
flight are fewer than that route's slots, and deals by the plan's shares once they reach them (back below 0.8
of them, on the fastest route again; switches at least ``cooldown_s`` apart); ``throughput`` always deals by
the plan's shares; ``latency`` always takes the fastest route. Shares are kept by smooth weighted round robin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tessera.plan.deployment import WHOLE, PlannedEngine, PlannedRoute
from tessera.plan.shares import ShareSwitch, SmoothRoundRobin, key


@dataclass(frozen=True)
class DealtRoute:
    """What dealing needs of a route: its share of the requests, its planned request latency (None: not
    known) and its slots."""

    share: float
    latency_s: float | None
    slots: int


class RouteDealer:
    """Deals requests to an engine's routes (see the module docstring)."""

    def __init__(self, routes: list[DealtRoute], mode: str = "auto", cooldown_s: float = 1.0,
                 clock: Callable[[], float] | None = None):
        import time

        planned = [PlannedRoute(f"r{i}", r.share, (f"r{i}",), r.latency_s) for i, r in enumerate(routes)]
        engines = {f"r{i}": PlannedEngine(f"r{i}", (WHOLE,), (), (), (), r.slots, None, 16, 1.0)
                   for i, r in enumerate(routes)}
        self.switch = ShareSwitch(planned, engines, mode, cooldown_s=cooldown_s)  # ShareSwitchError: bad mode
        self._keys = [key(r) for r in planned]
        self._robin = SmoothRoundRobin()
        self.clock = clock or time.perf_counter

    @property
    def mode(self) -> str:
        """The shares in use now: ``latency`` or ``throughput``."""
        return self.switch.mode

    def pick(self, in_flight: int) -> int:
        """The route (its index) of a new request, with ``in_flight`` requests already queued or running."""
        if len(self._keys) == 1:
            return 0
        if self.switch.observe(self.clock(), in_flight) is not None:
            self._robin.reset()  # the new shares' round robin starts afresh
        shares = self.switch.shares()
        return self._robin.pick({i: shares[k] for i, k in enumerate(self._keys) if shares[k] > 0}, tie=lambda i: i)


__all__ = ["DealtRoute", "RouteDealer"]
