"""Steps that slow each other on one host's CPU workers: where the host profile carries measured contention
factors (:class:`~tessera.cost.contention.HostContention`), a step on the host's CPU workers runs at
``1 / factor`` of its own speed for exactly the time another step runs beside it on the host's CPU (another
lane, or another engine's), and at full speed the rest of its time. A step's own time (its alone seconds,
from the step timer) is its work; while it overlaps, its work drains at the slower rate, so its end moves
later by the overlap's share of the factor. Steps on GPUs, steps that never overlap, and simulations whose
profile carries no contention figures keep their times.

With more than two steps at once, a step takes the largest factor over its neighbours (the probe measured
one neighbour).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.cost.contention import HostContention


@dataclass
class _Running:
    step: Any  # the ScheduledStep it tracks
    work_s: float  # alone seconds still to run
    rate: float  # alone seconds run per second now
    since: float  # when work_s was last brought up to date
    kind: str  # "decode" (a batched stage's step) or "prefill"
    hosted: bool  # its kernels run on the host's CPU workers


class HostSharing:
    """Tracks the steps running on an engine set's lanes and sets each one's end by its overlaps (see the
    module docstring). Call :meth:`update` once per simulator event, after that event's steps started."""

    def __init__(self, contention: HostContention, host_id: str):
        self.contention = contention
        self.host_id = host_id
        self._running: dict[int, _Running] = {}

    @classmethod
    def for_engines(cls, engines: list) -> HostSharing | None:
        """The tracker for ``engines`` where their timers' profile carries contention figures, else None."""
        for e in engines:
            timers = [e.timer, *(ln.timer for ln in e.lanes if ln.timer is not None)]
            for t in timers:
                profile = t.ctx.profile
                figures = getattr(profile, "contention", None) if profile is not None else None
                if figures is not None:
                    return cls(figures, profile.device)
        return None

    def _describe(self, engine, lane, step, now: float) -> _Running:
        timer = lane.timer or engine.timer
        plan = timer.steps[step.phase]
        hosted = any(timer.targets[t].spec.id == self.host_id for t in plan.used_targets)
        batched = any(st.batched and st.phase == step.phase for st in engine.scheduler.stages)
        return _Running(step, lane.busy_until - now, 1.0, now, "decode" if batched else "prefill", hosted)

    def update(self, engines: list, now: float) -> None:
        """Bring every running step's work up to ``now`` at its rate so far, take in the steps started at
        ``now``, and set each one's rate and end (``lane.busy_until``, and its ``busy_s`` by the same change)
        by the steps running beside it from now on."""
        busy = [(e, ln) for e in engines for ln in e.all_lanes() if ln.step is not None]
        running: dict[int, _Running] = {}
        for e, ln in busy:
            known = self._running.get(id(ln))
            if known is not None and known.step is ln.step:
                known.work_s = max(0.0, known.work_s - (now - known.since) * known.rate)
                known.since = now
                running[id(ln)] = known
            else:
                running[id(ln)] = self._describe(e, ln, ln.step, now)
        self._running = running
        hosted = [(ln, running[id(ln)]) for _, ln in busy if running[id(ln)].hosted]
        for ln, r in hosted:
            others = [o.kind for other, o in hosted if other is not ln]
            factor = max((self.contention.factor(r.kind, k) for k in others), default=1.0)
            rate = 1.0 / factor
            if rate == r.rate:  # its end stands
                continue
            r.rate = rate
            end = now + r.work_s / rate
            ln.busy_s += end - ln.busy_until
            ln.busy_until = end
