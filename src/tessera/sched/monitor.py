"""The online monitor: which objective's step plans an engine runs now (`tessera serve`'s engine, and the
simulator's engines when asked to switch as it does).

On a timer (a window, 300 ms by default) it looks at every request the engine knows: queued, in
flight, and finished during the window. For each it takes the latency so far (now, or its finish,
minus its arrival) and its execution time (the summed durations of the steps it took part in, and the time
so far of the step it is in: a long first step, a batch of prompts arriving together, is evidence while it
runs, not only once it ends). When
the mean latency over the mean execution time reaches ``beta`` (1.5 by default), requests wait more
than they run: the engine switches to the throughput-objective plans; below ``beta x hysteresis``
(1.5 x 0.8 = 1.2 by default) it switches back to the latency-objective plans. The band between the two
thresholds and a cool-down (``cooldown_s`` since the previous switch) keep the choice from flapping. The engine applies a switch between steps, so no step is cut in half.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tessera.errors import TesseraError
from tessera.sched.scheduler import Request

SWITCH_LOG = 1000  # switches the monitor remembers (Monitor.switch_count counts them all)


def objective_for(load: float, threshold: float, hysteresis: float, current: str) -> str:
    """The objective a load asks for: ``throughput`` at ``threshold`` or above, ``latency`` below ``threshold x
    hysteresis``, and in the band between, ``current`` (the online monitor's rule and the share switch's)."""
    if load >= threshold:
        return "throughput"
    if load < threshold * hysteresis:
        return "latency"
    return current


class MonitorError(TesseraError, ValueError):
    """Monitor settings out of range."""


@dataclass
class Switch:
    """One plan switch: when, from which objective to which, and the ratio that caused it."""

    at_s: float
    before: str
    after: str
    ratio: float


@dataclass
class Monitor:
    """Latency / execution-time windows and the objective they choose (see the module docstring)."""

    beta: float = 1.5
    window_s: float = 0.3
    cooldown_s: float = 1.0
    hysteresis: float = 0.8  # back to the latency plans only below beta x hysteresis
    objective: str = "latency"
    enabled: bool = True
    # the most recent switches (a long-running server keeps a bounded log) and how many there were in all
    switches: deque[Switch] = field(default_factory=lambda: deque(maxlen=SWITCH_LOG))
    switch_count: int = 0
    last_ratio: float | None = None
    _window_start: float | None = None
    _last_switch: float = float("-inf")

    def __post_init__(self) -> None:
        if self.beta <= 0 or self.window_s <= 0 or self.cooldown_s < 0 or not 0 < self.hysteresis <= 1:
            raise MonitorError(f"monitor settings must be positive: beta {self.beta}, window {self.window_s} s, "
                               f"cool-down {self.cooldown_s} s, hysteresis {self.hysteresis} (in (0, 1])")

    def fresh(self, objective: str | None = None) -> Monitor:
        """A monitor with these settings and none of this one's windows or switches, on ``objective`` (default:
        this one's)."""
        return Monitor(self.beta, self.window_s, self.cooldown_s, self.hysteresis, objective or self.objective,
                       self.enabled)

    def window_end_s(self) -> float | None:
        """When the current window ends (None before the first is opened by :meth:`due`)."""
        return None if self._window_start is None else self._window_start + self.window_s

    def due(self, now: float) -> bool:
        """Whether the current window is over."""
        if self._window_start is None:
            self._window_start = now
        return now - self._window_start >= self.window_s

    def close_window(self, now: float, queued: list[Request], running: list[Request],
                     finished: list[Request]) -> Switch | None:
        """End the window at ``now`` over these requests (finished: those that ended inside the window);
        returns the switch it decides, if any."""
        self._window_start = now
        seen = [*queued, *running, *finished]
        if not seen:
            return None
        latency = sum((r.finish_s if r.finish_s is not None else now) - r.arrival_s for r in seen) / len(seen)
        execution = sum(r.busy_s + (now - r.step_since if r.in_step else 0.0) for r in seen) / len(seen)
        if execution <= 0:  # nothing has run yet: no evidence either way
            return None
        ratio = latency / execution
        self.last_ratio = ratio
        want = objective_for(ratio, self.beta, self.hysteresis, self.objective)  # in the band: keep the plans
        if not self.enabled or want == self.objective or now - self._last_switch < self.cooldown_s:
            return None
        switch = Switch(now, self.objective, want, ratio)
        self.switches.append(switch)
        self.switch_count += 1
        self.objective = want
        self._last_switch = now
        return switch
