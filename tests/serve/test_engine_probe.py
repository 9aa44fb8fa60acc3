"""The engine-step probe: it times every step a lane runner starts and finishes, less the slowest worker and the
driver's round trip, and gives the runner back its own start and finish."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tessera.runtime.distributed import StepTiming
from tessera.sched.scheduler import ScheduledStep
from tessera.serve.engine_probe import EngineProbeError, StepWork
from tessera.serve.lanes import LaneRunner

WORK_S = 0.02  # the "engine's" own work around each step below, in seconds


def _runner(worker_s: float) -> LaneRunner:
    def start(step):
        time.sleep(WORK_S / 2)
        return SimpleNamespace(timings=[StepTiming("decode", worker_s, [worker_s / 2, worker_s], [0.0, 0.0])]), None

    def finish(step, handle, context):
        time.sleep(WORK_S / 2 + worker_s)

    return LaneRunner(lambda: [], lambda now, phases: None, start, finish, lambda handles, t: handles,
                      frozenset({"decode"}))


def test_the_probe_times_each_step_less_its_slowest_worker_and_the_round_trip():
    runner = _runner(worker_s=0.01)
    own = (runner.start, runner.finish)
    work = StepWork()
    work.attach(SimpleNamespace(lanes=runner))
    for _ in range(3):
        step = ScheduledStep("decode", [], 1)
        handle, context = runner.start(step)
        runner.finish(step, handle, context)
    work.detach()
    assert (runner.start, runner.finish) == own
    assert len(work.walls) == 3 and work.workers == [0.01] * 3
    assert WORK_S - 0.005 <= work.per_step_s(0.005) <= WORK_S + 0.05
    assert work.per_step_s(10.0) == 0.0  # never below nothing


def test_every_replica_is_watched_and_misuse_is_refused():
    runners = [_runner(0.0), _runner(0.0)]
    work = StepWork()
    with pytest.raises(EngineProbeError, match="no step with worker timings ran"):
        work.per_step_s(0.0)
    work.attach(SimpleNamespace(engines=[SimpleNamespace(lanes=r) for r in runners]))
    with pytest.raises(EngineProbeError, match="already watches an engine"):
        work.attach(SimpleNamespace(lanes=runners[0]))
    for r in runners:
        step = ScheduledStep("decode", [], 1)
        r.finish(step, *r.start(step))
    work.detach()
    assert len(work.walls) == 2
