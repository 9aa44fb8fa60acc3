"""An engine that switches between its throughput and latency step plans in the simulator, as `tessera serve`'s
engine does under its online monitor (`tessera.sched.monitor.Monitor`, the same class and settings).

Each objective is an :class:`EngineMode`: the step timer and lanes of that objective's step plans, the state
moves a request waits for between its phases, and the rows a step may hold (the latency plans' low-load bucket,
``--latency-rows``, as the engine caps them). At every window's end the monitor looks at the requests queued,
running and finished in the window; when it switches, the engine's next steps are the new objective's, and a
step in flight on the old objective's lanes finishes first where it holds a target a new lane needs (steps take
turns whole, as `tessera.serve.lanes` runs them). Requests admitted by an old lane for their prompt steps go to
any lane. Where the two objectives keep a request's state on different targets (the repeated phase's), every
running request waits for the rows of all of them to move (the runtime moves a step's rows before it runs), at
``move_s`` each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tessera.sched.monitor import Monitor

if TYPE_CHECKING:
    from tessera.sim.step_timer import StepTimer


@dataclass
class EngineMode:
    """One objective's way of running an engine."""

    timer: StepTimer
    lanes: list[Any]  # tessera.sim.requests.Lane
    delays: dict[str, float]
    max_rows: int | None  # requests in flight (and rows of a batched step); None: every slot
    state_targets: frozenset[int]  # where the repeated phase's steps keep a running request's state


@dataclass
class Switching:
    """An engine's monitor, its modes by objective, and the lanes of the previous mode still running a step."""

    monitor: Monitor
    modes: dict[str, EngineMode]
    move_s: float = 0.0  # one request's state moved between two modes' state targets
    retired: list[Any] = field(default_factory=list)
    seen: int = 0  # finished requests the monitor has already been shown
    switches: int = 0
    holds: dict[int, float] = field(default_factory=dict)  # id(request) -> its move's wait, after its step in flight

    @property
    def mode(self) -> EngineMode:
        return self.modes[self.monitor.objective]

    def watching(self, scheduler: Any) -> bool:
        """Whether a window's end may change anything: requests wait or run, or some finished unseen."""
        return bool(scheduler.waiting or scheduler.running or len(scheduler.done) > self.seen)


def use_mode(engine: Any, mode: EngineMode) -> None:
    """Run ``engine``'s next steps as ``mode`` says."""
    engine.timer, engine.lanes, engine.delays, engine.max_rows = mode.timer, mode.lanes, mode.delays, mode.max_rows


def close_window(engine: Any, now: float) -> bool:
    """At the end of ``engine``'s monitor window: show it the window's requests and apply the switch it decides
    (whether it switched)."""
    sw: Switching = engine.switching
    if not sw.monitor.due(now):
        return False
    sched = engine.scheduler
    switch = sw.monitor.close_window(now, list(sched.waiting), list(sched.running), sched.done[sw.seen:])
    sw.seen = len(sched.done)
    if switch is None:
        return False
    old, new = sw.modes[switch.before], sw.modes[switch.after]
    sw.switches += 1
    sw.retired += [ln for ln in old.lanes if ln.step is not None]
    use_mode(engine, new)
    for req in [*sched.waiting, *sched.running]:
        if any(req.owner is ln for ln in old.lanes):
            req.owner = None
    if old.state_targets != new.state_targets and sw.move_s > 0:
        repeated = {st.phase for st in sched.stages if st.batched}
        moving = [r for r in sched.running if 0 <= r.stage < len(sched.stages)
                  and sched.stages[r.stage].phase in repeated and r.generated > 0]
        for req in moving:
            if req.in_step:  # its step in flight finishes first (and sets when it may go on)
                sw.holds[id(req)] = len(moving) * sw.move_s
            else:
                req.ready_s = max(req.ready_s, now) + len(moving) * sw.move_s
    return True


def hold_back(engine: Any, requests: list) -> None:
    """After a step of ``requests`` finished: those whose state a switch during the step moves wait for it."""
    holds = engine.switching.holds
    for req in requests:
        wait = holds.pop(id(req), None)
        if wait is not None:
            req.ready_s += wait
