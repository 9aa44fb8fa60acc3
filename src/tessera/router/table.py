"""The router's view of a deployment: its engines (endpoints with a state and requests in flight) and the
plan's routes with their shares, and which route the next request takes.

Requests follow the routes in the plan's shares by smooth weighted round robin (after any n requests each
route has taken within one of its share of n). A route is open while every engine it visits is up; a
prefill-decode route whose prefill engine is down stays open as a whole request on its decode engine (that
engine computes the prompt itself: a fallback, counted); a route whose last engine is down is closed and
its share goes to the open ones. Where several routes are open with equal standing the one whose engines
have the fewest requests in flight goes first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tessera.plan.deployment import DECODE, PREFILL, PlannedEngine, PlannedRoute


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
    """The plan's routes over the deployment's endpoints."""

    endpoints: dict[str, Endpoint]
    routes: list[PlannedRoute]
    _credit: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        for r in self.routes:
            missing = [h for h in r.hops if h not in self.endpoints]
            if missing:
                raise ValueError(f"route {r.name} visits {', '.join(missing)}, which the deployment has no endpoint for")
            if len(r.hops) not in (1, 2):
                raise ValueError(f"route {r.name} has {len(r.hops)} hops; a route is one engine, or prefill then decode")
        self._credit = {r.name + "|" + "/".join(r.hops): 0.0 for r in self.routes}

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
        """The hops of the next request (smooth weighted round robin over the open routes' shares).

        Raises:
            NoRoute: every route is closed.
        """
        with self._lock:
            open_ = [(r, h) for r in self.routes if (h := self.hops(r)) is not None]
            if not open_:
                raise NoRoute(self.closed_reason())
            total = sum(r.share for r, _ in open_) or 1.0
            for r, _ in open_:
                self._credit[self._key(r)] += r.share / total
            r, h = max(open_, key=lambda x: (self._credit[self._key(x[0])],
                                             -sum(self.endpoints[n].in_flight for n in x[1].names)))
            self._credit[self._key(r)] -= 1.0
            for name in h.names:
                self.endpoints[name].in_flight += 1
            return h

    def release(self, hops: Hops, prefill_only: bool = False) -> None:
        """A request on ``hops`` is over (``prefill_only``: its prefill hop is)."""
        with self._lock:
            for e in (hops.prefill,) if prefill_only else (hops.decode,) if hops.released_prefill else \
                    (hops.prefill, hops.decode):
                if e is not None:
                    e.in_flight = max(0, e.in_flight - 1)
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

    @staticmethod
    def _key(route: PlannedRoute) -> str:
        return route.name + "|" + "/".join(route.hops)


__all__ = ["Endpoint", "Hops", "NoRoute", "RouteTable"]
