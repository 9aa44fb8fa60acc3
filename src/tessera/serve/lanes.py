"""The serving engine's lanes: steps on disjoint workers in flight at once, as the simulator runs its lanes.

A lane is a set of phases (prefill, decode) whose runtime phases use a common worker, directly or through
another phase: the rule of `tessera.plan.deployment.lanes`, read off the placements the engine runs under its
current objective. Under prefill-decode the prefill worker and the decode worker are two lanes; under
layer-pipeline or attention-ffn both phases span both workers and form one lane; a single-process backend
is one lane. An engine serving several routes (a route mix) has lanes per route, as the simulator has lanes
per engine: its phases are named ``r{i}/prefill`` and are never one lane with another route's, however they
share workers.

Every lane with nothing in flight starts its next step (the scheduler's choice among the lane's phases), so
the prefill worker prefills while the decode worker decodes. A lane whose workers a step in flight holds
(after a switch of objective to placements that overlap, or engines sharing a worker) waits until that step
is back: steps take turns whole. The priority order is the simulator's (`tessera.sim.requests.run_requests`):
lanes that run only prompt steps first (in a route mix
they feed another worker's batched steps), then the lane that started a step least recently; within a lane the
scheduler's order (single-request stages first: a prefill before a decode).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tessera.sched.scheduler import ScheduledStep
from tessera.serve.backend import ObjectivePlacements

POLL_S = 0.01  # while a lane that admits is idle, look for new requests this often between replies


@dataclass(frozen=True)
class Lane:
    """Phases whose steps take turns (they share workers) and the workers they use."""

    phases: frozenset[str]
    workers: frozenset[int]


def base_phase(phase: str) -> str:
    """A lane phase without its route: ``r1/prefill`` -> ``prefill``."""
    return phase.rpartition("/")[2]


def _route(phase: str) -> str:
    return phase.rpartition("/")[0]


def lanes_of(placements: ObjectivePlacements, objective: str) -> list[Lane]:
    """The lanes of the engine's phases under ``objective``: phases of one route whose runtime phases share a
    worker, directly or through another phase, are one lane; by route, then in the order of each lane's first
    phase (prefill, decode)."""
    used: dict[str, set[int]] = {}
    for bucket, runtime in placements.phases[objective].items():
        used.setdefault(bucket.split("@")[0], set()).update(placements.placements[runtime])

    def key(p: str) -> tuple[str, bool, str]:
        return _route(p), base_phase(p) != "prefill", p

    groups: list[tuple[set[str], set[int]]] = []
    for phase in sorted(used, key=key):
        merged = [g for g in groups if g[1] & used[phase] and _route(next(iter(g[0]))) == _route(phase)]
        phases, workers = {phase}, set(used[phase])
        for g in merged:
            groups.remove(g)
            phases |= g[0]
            workers |= g[1]
        groups.append((phases, workers))
    order = {p: i for i, p in enumerate(sorted(used, key=key))}
    groups.sort(key=lambda g: min(order[p] for p in g[0]))
    return [Lane(frozenset(p), frozenset(w)) for p, w in groups]


@dataclass(eq=False)
class InFlight:
    """A step an engine started on a lane: the backend's handle and what the engine needs to finish it."""

    lane: Lane
    step: ScheduledStep
    handle: Any
    context: Any


class LaneRunner:
    """Starts the steps of an engine's lanes and hands each back to the engine when its backend says it is done.

    ``next_step(now, phases)``: the scheduler's next step among ``phases`` (None: nothing to run);
    ``start(step) -> (handle, context)``: submit it to the backend (handle None: it failed at once and is
    finished at once); ``finish(step, handle, context)``: take its result; ``wait(handles, timeout_s)``: the
    backend's handles that are done; ``lanes()``: the lanes under the current objective; ``batched``: the
    phases of batched stages (a lane without one runs only prompt steps)."""

    def __init__(self, lanes: Callable[[], list[Lane]], next_step: Callable[[float, set[str]], ScheduledStep | None],
                 start: Callable[[ScheduledStep], tuple[Any, Any]], finish: Callable[[ScheduledStep, Any, Any], None],
                 wait: Callable[[list, float | None], list], batched: frozenset[str], admits: str = "prefill"):
        self.lanes, self.next_step, self.start, self.finish, self.wait = lanes, next_step, start, finish, wait
        self.batched = batched
        self.admits = admits  # the phase of a request's first stage (a lane running it takes new requests)
        self.inflight: list[InFlight] = []
        self.last_start: dict[frozenset[str], float] = {}
        self.started = 0  # steps started so far

    def busy(self) -> bool:
        """Whether a step is in flight."""
        return bool(self.inflight)

    def turn(self, now: float, max_wait: float | None = None) -> bool:
        """Start a step on every lane that is free and has one to run, then wait for a step in flight to be
        done and finish it (waiting at most POLL_S while a lane that admits requests is idle, so a new request
        starts at once, and at most ``max_wait`` seconds in any case, so the engine's monitor closes its windows
        while a long step runs). Whether anything was started or in flight (False: the engine may sleep)."""
        started = self._dispatch(now)
        if not self.inflight:
            return started
        held = {w for f in self.inflight for w in f.lane.workers}
        idle = any(self.admits in {base_phase(p) for p in lane.phases} and not lane.workers & held
                   for lane in self.lanes())
        timeout = POLL_S if idle else None
        if max_wait is not None:
            timeout = max_wait if timeout is None else min(timeout, max_wait)
        done = self.wait([f.handle for f in self.inflight], timeout)
        for f in [f for f in self.inflight if any(f.handle is h for h in done)]:
            self.inflight.remove(f)
            self.finish(f.step, f.handle, f.context)
        return True

    def _dispatch(self, now: float) -> bool:
        started = False
        held = {w for f in self.inflight for w in f.lane.workers}
        order = sorted(self.lanes(), key=lambda ln: (bool(ln.phases & self.batched),
                                                     self.last_start.get(ln.phases, float("-inf"))))
        for lane in order:
            if lane.workers & held:
                continue
            step = self.next_step(now, set(lane.phases))
            if step is None:
                continue
            handle, context = self.start(step)
            self.started += 1
            started = True
            if handle is None:  # it failed before it started
                self.finish(step, handle, context)
                continue
            self.inflight.append(InFlight(lane, step, handle, context))
            self.last_start[lane.phases] = now
            held |= lane.workers
        return started
