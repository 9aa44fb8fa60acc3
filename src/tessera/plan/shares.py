"""Which shares requests take a plan's routes by: the plan's (throughput) or all on its fastest route
(latency), and the smooth weighted round robin that keeps them. The router (`tessera.router.table`) and the
vLLM simulator (`tessera.sim.vllm_engines`) send requests by these same rules.

The share switch is the router's counterpart of `tessera serve`'s online monitor (`tessera.sched.monitor`),
which switches between the throughput and the latency objective's step plans: here the switch is between two
sets of route shares.

- **throughput**: the plan's shares (``PlannedRoute.share``), which keep every route's engines busy at the
  planned rate: what a loaded deployment needs.
- **latency**: every request on the route with the lowest planned request latency (``PlannedRoute.latency_s``):
  at a light load no request needs to take a slower route, so none does.

With ``auto`` (the default) the router starts on the latency shares and looks at the requests it has in flight
whenever it picks a route. Once they fill the latency route's engine (as many as its ``max_num_seqs``: the
next request would wait inside that engine rather than run), it switches to the throughput shares; it switches
back when they fall below ``hysteresis`` of that (0.8 by default). At least ``cooldown_s`` separates two
switches. A plan of one route, or whose routes say no latency, has nothing to switch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import cached_property

from tessera.errors import TesseraError
from tessera.plan.deployment import PlannedEngine, PlannedRoute
from tessera.sched.monitor import objective_for

SHARE_MODES = ("auto", "throughput", "latency")
SWITCH_LOG = 1000  # switches remembered (ShareSwitch.switch_count counts them all)


class ShareSwitchError(TesseraError, ValueError):
    """Share-switch settings out of range."""


@dataclass(frozen=True)
class ShareChange:
    """One switch: when (router clock), to which shares, and the requests in flight that caused it."""

    at_s: float
    before: str
    after: str
    in_flight: int


@dataclass
class ShareSwitch:
    """The shares the router uses now and the rule that changes them (see the module docstring)."""

    routes: list[PlannedRoute]
    engines: dict[str, PlannedEngine]
    policy: str = "auto"  # auto | throughput | latency
    hysteresis: float = 0.8
    cooldown_s: float = 1.0
    changes: deque[ShareChange] = field(default_factory=lambda: deque(maxlen=SWITCH_LOG))
    switch_count: int = 0
    _last_switch: float = float("-inf")
    mode: str = ""

    def __post_init__(self) -> None:
        if self.policy not in SHARE_MODES:
            raise ShareSwitchError(f"--shares {self.policy!r}: choose one of {', '.join(SHARE_MODES)}")
        if not 0 < self.hysteresis <= 1 or self.cooldown_s < 0:
            raise ShareSwitchError(f"hysteresis {self.hysteresis} must be in (0, 1] and cool-down {self.cooldown_s} s "
                                   "at least 0")
        fastest = self.fastest
        if self.policy == "latency" and fastest is None:
            raise ShareSwitchError("--shares latency: the plan's routes do not say their latency (a plan of one route, "
                                   "or written before routes carried it); use --shares throughput or plan again")
        self.mode = self.policy if self.policy != "auto" else ("latency" if fastest is not None else "throughput")

    @cached_property
    def fastest(self) -> PlannedRoute | None:
        """The route of the lowest planned latency (None: one route, or a route without a latency)."""
        if len(self.routes) < 2 or any(r.latency_s is None for r in self.routes):
            return None
        return min(self.routes, key=lambda r: (r.latency_s, -r.share))

    @cached_property
    def capacity(self) -> int:
        """Requests the latency route's last engine runs at once (its ``max_num_seqs``)."""
        fastest = self.fastest
        return self.engines[fastest.hops[-1]].max_num_seqs if fastest is not None else 0

    def shares(self) -> dict[str, float]:
        """Each route's share now (by route name and hops, as `RouteTable` keys them)."""
        fastest = self.fastest if self.mode == "latency" else None
        return {key(r): (1.0 if r is fastest else 0.0) if fastest is not None else r.share for r in self.routes}

    def observe(self, now: float, in_flight: int) -> ShareChange | None:
        """Look at the requests in flight at ``now`` (router clock, seconds); the switch it makes, if any."""
        if self.policy != "auto" or self.fastest is None or now - self._last_switch < self.cooldown_s:
            return None
        want = objective_for(in_flight, self.capacity, self.hysteresis, self.mode)
        if want == self.mode:
            return None
        change = ShareChange(now, self.mode, want, in_flight)
        self.changes.append(change)
        self.switch_count += 1
        self.mode = want
        self._last_switch = now
        return change


def key(route: PlannedRoute) -> str:
    """A route's key in the shares' tables: its name and hops (two routes may share a name)."""
    return route.name + "|" + "/".join(route.hops)


@dataclass
class SmoothRoundRobin:
    """Smooth weighted round robin: after any n picks among candidates of fixed shares, each has been picked
    within one of its share of n."""

    credit: dict[Hashable, float] = field(default_factory=dict)

    def pick(self, shares: dict[Hashable, float], tie: Callable[[Hashable], float] | None = None) -> Hashable:
        """The candidate to take next among ``shares`` (candidate -> share, all positive); ``tie`` orders
        candidates of equal credit (lowest first)."""
        total = sum(shares.values()) or 1.0
        for k, share in shares.items():
            self.credit[k] = self.credit.get(k, 0.0) + share / total
        chosen = max(shares, key=lambda k: (self.credit[k], -(tie(k) if tie else 0.0)))
        self.credit[chosen] -= 1.0
        return chosen

    def reset(self) -> None:
        """Start afresh (new shares)."""
        self.credit.clear()


__all__ = ["SHARE_MODES", "ShareChange", "ShareSwitch", "ShareSwitchError", "SmoothRoundRobin", "key"]
