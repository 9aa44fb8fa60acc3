"""The router's view of a deployment: its engines (endpoints with a state and requests in flight) and the
plan's routes with their shares, and which route the next request takes.

Requests follow the routes in the plan's shares by smooth weighted round robin (after any n requests each
route has taken within one of its share of n). A route is open while every engine it visits is up; a
prefill-decode route whose prefill engine is down stays open as a whole request on its decode engine (that
engine computes the prompt itself: a fallback, counted); a route whose last engine is down is closed and
its share goes to the open ones. Where several routes are open with equal standing the one whose engines
have the fewest requests in flight goes first. Which shares apply, the plan's or all on its fastest route, is
the share switch's choice (`tessera.plan.shares`), looked at on every pick.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tessera.plan.deployment import DECODE, PREFILL, PlannedEngine, PlannedRoute
from tessera.plan.shares import ShareSwitch, SmoothRoundRobin, key


@dataclass
class Endpoint:
    """One engine as the router sees it: where it listens, its state, its requests in flight."""

    engine: PlannedEngine
    url: str
    connector: str | None = None  # the KV connector of a prefill or decode engine ("example", "nixl")
    state: str = "starting"  # starting | up | down | restarting | stopped
    detail: str = ""
    in_flight: int = 0
    failures: int = 0  # requests that failed on it (connection lost, error status from a dead engine)

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def up(self) -> bool:
        return self.state == "up"


@dataclass
class Hops:
    """The engines one request visits: a prefill engine (or None: served whole) and the engine that decodes
    (or serves it whole); ``fallback`` when a planned prefill hop was skipped because its engine is down."""

    route: str
    decode: Endpoint
    prefill: Endpoint | None = None
    fallback: bool = False
    released_prefill: bool = False  # its prefill hop is over (the router no longer counts it on that engine)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in (self.prefill, self.decode) if e is not None)


class NoRoute(Exception):
    """No route of the plan is open (every route has an engine down)."""


@dataclass
class RouteTable:
    """The plan's routes over the deployment's endpoints; ``switch`` chooses the shares (None: the plan's)."""

    endpoints: dict[str, Endpoint]
    routes: list[PlannedRoute]
    switch: ShareSwitch | None = None
    clock: Callable[[], float] = time.monotonic
    in_flight: int = 0  # requests picked and not yet released
    _robin: SmoothRoundRobin = field(default_factory=SmoothRoundRobin)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        for r in self.routes:
            missing = [h for h in r.hops if h not in self.endpoints]
            if missing:
                raise ValueError(f"route {r.name} visits {', '.join(missing)}, which the deployment has no endpoint for")
            if len(r.hops) not in (1, 2):
                raise ValueError(f"route {r.name} has {len(r.hops)} hops; a route is one engine, or prefill then decode")

    def hops(self, route: PlannedRoute) -> Hops | None:
        """How ``route`` runs now: its planned hops, a fallback to its decode engine alone, or None (closed)."""
        last = self.endpoints[route.hops[-1]]
        if not last.up:
            return None
        if len(route.hops) == 1:
            return Hops(route.name, last)
        first = self.endpoints[route.hops[0]]
        if first.up and PREFILL in first.engine.roles and DECODE in last.engine.roles:
            return Hops(route.name, last, first)
        return Hops(route.name, last, None, fallback=True)

    def pick(self) -> Hops:
        """The hops of the next request (smooth weighted round robin over the open routes' shares now).

        Raises:
            NoRoute: every route is closed.
        """
        with self._lock:
            open_ = [(r, h) for r in self.routes if (h := self.hops(r)) is not None]
            if not open_:
                raise NoRoute(self.closed_reason())
            shares = self._shares()
            chosen = {key(r): (r, h) for r, h in open_ if shares[key(r)] > 0}
            if not chosen:  # the latency shares' one route is closed: the plan's shares over the open routes
                shares = {key(r): r.share for r in self.routes}
                chosen = {key(r): (r, h) for r, h in open_}
            k = self._robin.pick({k: shares[k] for k in chosen},
                                 tie=lambda k: sum(self.endpoints[n].in_flight for n in chosen[k][1].names))
            r, h = chosen[k]
            for name in h.names:
                self.endpoints[name].in_flight += 1
            self.in_flight += 1
            return h

    def _shares(self) -> dict[str, float]:
        """The shares of this pick: the switch's (after it looks at the requests in flight), or the plan's."""
        if self.switch is None:
            return {key(r): r.share for r in self.routes}
        if self.switch.observe(self.clock(), self.in_flight) is not None:
            self._robin.reset()  # the new shares' round robin starts afresh
        return self.switch.shares()

    def release(self, hops: Hops, prefill_only: bool = False) -> None:
        """A request on ``hops`` is over (``prefill_only``: its prefill hop is)."""
        with self._lock:
            for e in (hops.prefill,) if prefill_only else (hops.decode,) if hops.released_prefill else \
                    (hops.prefill, hops.decode):
                if e is not None:
                    e.in_flight = max(0, e.in_flight - 1)
            if not prefill_only:
                self.in_flight = max(0, self.in_flight - 1)
            if prefill_only:
                hops.released_prefill = True

    def closed_reason(self) -> str:
        down = [f"{e.name} ({e.state}{': ' + e.detail if e.detail else ''})" for e in self.endpoints.values()
                if not e.up]
        return "no route of the plan is open: engines not up: " + ", ".join(down)

    def health(self) -> tuple[str, str]:
        """(``ok`` | ``degraded`` | ``down``, what is wrong): ok when every engine is up, degraded while at
        least one route is open, down when none is."""
        down = [e for e in self.endpoints.values() if not e.up]
        if not down:
            return "ok", ""
        names = ", ".join(f"{e.name} is {e.state}" + (f" ({e.detail})" if e.detail else "") for e in down)
        open_routes = [r.name for r in self.routes if self.hops(r) is not None]
        if not open_routes:
            return "down", names
        fallback = [r.name for r in self.routes if (h := self.hops(r)) is not None and h.fallback]
        extra = f"; {', '.join(fallback)} prefill on their decode engine" if fallback else ""
        return "degraded", f"{names}; serving through {', '.join(open_routes)}{extra}"


__all__ = ["Endpoint", "Hops", "NoRoute", "RouteTable"]
