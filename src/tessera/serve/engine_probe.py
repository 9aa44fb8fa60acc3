"""Measuring the serving engine's own work per step on real steps: what a step costs between its inputs
being built and its tokens being taken, beyond its workers' time and the driver's round trip (building
inputs, submitting, taking the outputs, the scheduler, detokenising, events). The simulator charges it per
step of Tessera's engine on CPU workers (`tessera.cost.host_overhead.HostOverhead.engine_step_s`)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from tessera.errors import TesseraError


class EngineProbeError(TesseraError):
    """The engine's step work cannot be measured: no step ran while the probe watched, or it watches twice."""


@dataclass
class StepWork:
    """Watches an engine's steps (its lane runner's start and finish): per step, the engine's wall seconds from
    building its inputs to taking its tokens, and the slowest worker's wall seconds in it. Attach, let the
    engine serve (a warm-up), detach, then :meth:`per_step_s`."""

    walls: list[float] = field(default_factory=list)
    workers: list[float] = field(default_factory=list)
    _saved: list[tuple] = field(default_factory=list)  # (lane runner, its own start, its own finish)
    _began: dict[int, float] = field(default_factory=dict)

    def attach(self, engine) -> None:
        """Start watching ``engine``'s steps (a :class:`tessera.serve.engine.Engine`, or a replicated engine:
        every replica's)."""
        if self._saved:
            raise EngineProbeError("this probe already watches an engine; detach it first")
        for one in getattr(engine, "engines", None) or [engine]:
            self._watch(one.lanes)

    def _watch(self, lanes) -> None:
        start, finish = lanes.start, lanes.finish
        self._saved.append((lanes, start, finish))

        def timed_start(step):
            self._began[id(step)] = time.perf_counter()
            return start(step)

        def timed_finish(step, handle, context):
            finish(step, handle, context)
            began = self._began.pop(id(step), None)
            timings = list(getattr(handle, "timings", None) or [])
            if began is None or not timings:  # a step that failed at once, or a backend without worker timings
                return
            self.walls.append(time.perf_counter() - began)
            self.workers.append(max(max(t.worker_seconds, default=0.0) for t in timings))

        lanes.start, lanes.finish = timed_start, timed_finish

    def detach(self) -> None:
        """Stop watching (each lane runner gets its own start and finish back)."""
        for lanes, start, finish in self._saved:
            lanes.start, lanes.finish = start, finish
        self._saved = []

    def per_step_s(self, round_trip_s: float) -> float:
        """Median seconds per watched step of the engine's own work: its wall time less the slowest worker's
        and the driver's round trip ``round_trip_s`` (the simulator charges that apart); never below 0."""
        if not self.walls:
            raise EngineProbeError("no step with worker timings ran while the probe watched: serve some requests "
                                   "(a warm-up) between attach and detach")
        return max(0.0, statistics.median(w - k for w, k in zip(self.walls, self.workers, strict=True)) - round_trip_s)
