"""The pool model's inputs and corrections, on hand-made timelines (no workers): send calls classed by what the
other workers did, and the wake cost of a wait for a message."""

from __future__ import annotations

import pytest

from tessera.hardware.cluster import Link
from tessera.program.program import build_programs
from tessera.runtime.probe import ProbeError, ProgramTimes, classify_sends, measure_program_times
from tessera.sim.pool_model import PoolModel
from tessera.sim.programs import MessageCosts
from tests.sim.test_programs import _chain


def test_sends_are_classed_by_whether_another_worker_was_working():
    # worker 0 (clock starts at 10.0): sends at 1.0 (worker 1 waits in a receive), at 3.0 (worker 1 runs a
    # kernel) and at 6.0 (worker 1 is done); worker 1 (clock starts at 10.5) sends at 0.0, before worker 0's
    # first send, while worker 0 runs its first kernel
    w0 = [("run", 0, 0, 0.0, 1.0), ("send", 0, 0, 1.0, 1.25), ("send", 1, 0, 3.0, 3.5), ("send", 2, 0, 6.0, 6.125)]
    w1 = [("send", 3, 0, 0.0, 0.0625), ("recv", 0, 0, 0.25, 1.5), ("run", 1, 0, 1.5, 4.5)]
    idle, busy = classify_sends([w0, w1], [10.0, 10.5])
    assert idle == [0.25, 0.125] and busy == [0.5, 0.0625]


def test_wake_costs_are_interpolated_and_bounded():
    times = ProgramTimes([{}], [{}], [[0.1, 0.3]], (1.0, 3.0))
    assert times.wake_cost(0, 0.0) == 0.0
    assert times.wake_cost(0, 0.5) == pytest.approx(0.05)
    assert times.wake_cost(0, 2.0) == pytest.approx(0.2)
    assert times.wake_cost(0, 10.0) == pytest.approx(0.3)
    assert ProgramTimes([{}], [{}]).wake_cost(0, 1.0) == 0.0  # not measured: no cost
    merged = ProgramTimes.mean([times, ProgramTimes([{}], [{}], [[0.3, 0.5]], (1.0, 3.0))])
    assert merged.wake == [[pytest.approx(0.2), pytest.approx(0.4)]]


def test_wake_pauses_must_increase():
    sp = build_programs(_chain(), [0, 1, 1], ["a", "b"])
    for bad in ((2e-3, 2e-4), (0.0, 1e-3), (1e-3, 1e-3)):
        with pytest.raises(ProbeError, match="positive and increasing"):
            measure_program_times(None, sp, _chain(), [], [], wake_pauses_s=bad)  # refused before any work


def test_the_first_kernel_after_a_wait_pays_the_wake_cost():
    sp = build_programs(_chain(), [0, 1, 1], ["a", "b"])
    ones = [{(k, 0): 1.0 for k in ks} for ks in ([0], [1, 2])]
    link = Link("pcie", bandwidth=1024.0, latency_s=0.5)  # k0's 1 KiB output: 1 s on the wire + 0.5 s
    plain = PoolModel(ProgramTimes(ones, ones), link, MessageCosts())
    # device 1 waits 2.5 s for k0's output; its next kernel (k1) pays the wake cost of a 2.5 s wait: 0.25 s
    woken = PoolModel(ProgramTimes(ones, ones, [[0.0, 0.0], [0.1, 0.25]], (1.0, 2.0)), link, MessageCosts())
    step, _ = plain.step(sp)
    assert step == 1.0 + 1.5 + 2.0
    step, timeline = woken.step(sp)
    assert step == pytest.approx(1.0 + 1.5 + 2.0 + 0.25)
    assert [round(e - s, 6) for d, kind, _, _, s, e in timeline.events if d == 1 and kind == "run"] == [1.25, 1.0]
    period, stream = woken.stream(sp, 3, 0.0)
    assert stream.waits_s[1] == [pytest.approx(2.5)] * 3
    assert period == pytest.approx(1.0 + 1.5 + 2.25)  # one step's chain at a time, each k1 woken
