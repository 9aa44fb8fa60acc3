"""The simulator's model of a pool of local workers, from the runtime's probes of that pool.

:mod:`tessera.runtime.probe` measures what the simulator needs to know about a pool on this host (kernel
times inside steps, alone and with other workers computing, and after waits for messages; the gloo link;
the CPU cost of each message); :class:`PoolModel` feeds them to :func:`~tessera.sim.programs.simulate_programs`
(one step) and :func:`~tessera.sim.programs.simulate_stream` (streamed steps). What a kernel costs then
depends on the schedule (how much of it overlaps other workers' kernels, how long its device waited before
it), so each simulation is repeated with the previous run's overlaps and waits.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from tessera.hardware.cluster import Link
from tessera.program.program import StepPrograms
from tessera.runtime.probe import ProgramTimes
from tessera.sim.programs import (
    MessageCosts,
    ProgramTimeline,
    StreamTimeline,
    simulate_programs,
    simulate_stream,
)


@dataclass
class PoolModel:
    """What the simulator is told about a pool of local workers running one step's programs: each device's
    kernel times inside steps alone and with the others computing
    (:func:`~tessera.runtime.probe.measure_program_times`), the link and the per-message costs between two
    workers. A kernel's time is its alone time plus the share of it during which another worker computes
    times the measured slowdown (``together - alone``), plus, for the first kernel after a receive, the
    device's wake cost for that receive's wait (:meth:`~tessera.runtime.probe.ProgramTimes.wake_cost`); as
    shares and waits depend on the schedule, the simulation is repeated with those of the previous run
    (``iterations``)."""

    times: ProgramTimes
    link: Link
    messages: MessageCosts | None = None
    iterations: int = 4

    def _time(self, d: int, k: int, m: int, share: float) -> float:
        a = self.times.alone[d][(k, m)]
        return a + share * (self.times.together[d][(k, m)] - a)

    def step(self, sp: StepPrograms, overhead_s: float = 0.0) -> tuple[float, ProgramTimeline]:
        """One step of ``sp`` (``simulate_programs``): (seconds including ``overhead_s``, the timeline). Each
        kernel instance's share is the fraction of its simulated time the other devices spent in kernels."""
        share: dict[tuple[int, int, int], float] = {}
        wake: dict[tuple[int, int, int], float] = {}
        timeline = None
        recv_s = self.messages.recv_s if self.messages is not None else 0.0
        for _ in range(max(1, self.iterations)):
            timeline = simulate_programs(
                sp, lambda d, k, m, s=share, w=wake: self._time(d, k, m, s.get((d, k, m), 0.0)) + w.get((d, k, m), 0.0),
                lambda a, b: self.link, record=True, messages=self.messages)
            share = _overlap_shares(timeline.events, len(sp.programs))
            wake = self._wakes(timeline.events, recv_s)
        return timeline.makespan_s + overhead_s, timeline

    def _wakes(self, events, recv_s: float) -> dict[tuple[int, int, int], float]:
        """(device, kernel, micro-batch) -> the wake cost of the receive just before that kernel."""
        out: dict[tuple[int, int, int], float] = {}
        pending: dict[int, float] = {}
        for d, kind, what, m, start, end in events:
            if kind == "recv":
                pending[d] = pending.get(d, 0.0) + self.times.wake_cost(d, end - start - recv_s)
            elif kind == "run" and d in pending:
                out[(d, what, m)] = pending.pop(d)
        return out

    def stream(self, sp: StepPrograms, steps: int, feedback_s: float) -> tuple[float, StreamTimeline]:
        """``steps`` streamed steps of ``sp`` (``simulate_stream``): (seconds per step in steady state, the
        timeline). A device's share is the other devices' kernel time over the run's length (capped at 1);
        its wake costs (those of all its receives' waits) are spread over the kernels that follow a receive."""
        share = [0.0] * len(sp.programs)
        after = [_after_receives(p.instructions) for p in sp.programs]
        extra = [0.0] * len(sp.programs)
        timeline = None
        for _ in range(max(1, self.iterations)):
            timeline = simulate_stream(
                sp, lambda d, k, m, s=share, x=extra: self._time(d, k, m, s[d]) + (x[d] if (k, m) in after[d] else 0.0),
                lambda a, b: self.link, steps, feedback_s, messages=self.messages)
            span = timeline.makespan_s or 1.0
            total = sum(timeline.busy_s)
            share = [min(1.0, (total - b) / span) for b in timeline.busy_s]
            extra = [sum(self.times.wake_cost(d, w) for w in waits) / (steps * len(after[d])) if after[d] else 0.0
                     for d, waits in enumerate(timeline.waits_s)]
        return timeline.period_s, timeline


def _after_receives(instructions) -> set[tuple[int, int]]:
    """The (kernel, micro-batch) run first after each receive of a device program."""
    out, waiting = set(), set()
    for ins in instructions:
        if ins.kind == "recv":
            waiting.add(ins.microbatch)
        elif ins.kind == "run" and ins.microbatch in waiting:
            waiting.discard(ins.microbatch)
            out.add((ins.kernel, ins.microbatch))
    return out


def _overlap_shares(events, devices: int) -> dict[tuple[int, int, int], float]:
    """(device, kernel, micro-batch) -> the fraction of that run the other devices spent in kernels."""
    runs: list[list[tuple[float, float]]] = [[] for _ in range(devices)]
    for d, kind, _what, _m, start, end in events:
        if kind == "run" and end > start:
            runs[d].append((start, end))
    starts = [[s for s, _ in r] for r in runs]
    done = []  # per device: kernel seconds finished before each run starts (prefix sums)
    for r in runs:
        acc, sums = 0.0, [0.0]
        for s, e in r:
            acc += e - s
            sums.append(acc)
        done.append(sums)

    def busy_until(d: int, t: float) -> float:
        i = bisect.bisect_right(starts[d], t)  # runs starting at or before t
        if i == 0:
            return 0.0
        s, e = runs[d][i - 1]
        return done[d][i - 1] + min(t, e) - s

    out = {}
    for d, kind, what, m, start, end in events:
        if kind != "run" or end <= start:
            continue
        other = sum(busy_until(o, end) - busy_until(o, start) for o in range(devices) if o != d)
        out[(d, what, m)] = min(1.0, other / (end - start))
    return out
