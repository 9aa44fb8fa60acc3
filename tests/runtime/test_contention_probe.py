"""The contention probe: two pinned processes, each step timed alone and beside the other's; bad requests refused."""

from __future__ import annotations

import os

import pytest

from tessera.cost.contention import KINDS
from tessera.runtime.contention_probe import (
    ContentionProbeError,
    ProbeShapes,
    contention_key,
    measure_contention,
    probe_cores,
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the probe needs two cores")
def test_every_kind_beside_every_kind_is_sampled_per_round_and_process():
    figures, samples = measure_contention("tiny:llm", 1, ProbeShapes(decode_rows=2, prompt=16, ctx=32, slots=2),
                                          rounds=1, passes=3)
    pairs = {f"{a} beside {b}" for a in KINDS for b in KINDS}
    assert set(samples) == {"cpu", "wall"} and set(samples["cpu"]) == set(samples["wall"]) == pairs
    for clock in samples.values():
        assert all(len(v) == 2 and all(x > 0 for x in v) for v in clock.values())  # one per process timed
    for a in KINDS:
        for b in KINDS:
            cpu = samples["cpu"][f"{a} beside {b}"]
            assert figures.factor(a, b) == max(1.0, (cpu[0] + cpu[1]) / 2)  # the median of two


def test_the_key_names_the_model_shapes_and_threads():
    a = contention_key("smollm2-135m", 1, ProbeShapes())
    b = contention_key("smollm2-135m", 2, ProbeShapes(decode_rows=8))
    assert a["code"] == b["code"] and a["model"] == "smollm2-135m"
    assert (a["threads"], b["threads"]) == (1, 2) and a["shapes"] != b["shapes"]


def test_more_threads_than_the_cores_hold_is_refused():
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ContentionProbeError, match=f"need {2 * cores} cores"):
        probe_cores(cores)


@pytest.mark.parametrize("call,match", [
    (lambda: measure_contention("tiny:llm", threads=0), "threads must be a whole number >= 1"),
    (lambda: measure_contention("tiny:llm", rounds=0), "rounds must be a whole number >= 1"),
    (lambda: measure_contention("tiny:llm", passes=2), "passes must be a whole number >= 3"),
    (lambda: ProbeShapes(decode_rows=0), "decode_rows must be a whole number >= 1"),
    (lambda: ProbeShapes(decode_rows=9, slots=8), "decode_rows 9 exceeds its slots 8"),
    (lambda: ProbeShapes(prompt=200, ctx=128), "prompt 200 exceeds its cache of 128"),
])
def test_bad_probe_requests_are_refused(call, match):
    with pytest.raises(ContentionProbeError, match=match):
        call()


def test_a_model_the_process_cannot_build_is_reported_with_its_error():
    with pytest.raises(ContentionProbeError, match="a contention probe process failed: .*no-such-model"):
        measure_contention("no-such-model", 1, rounds=1, passes=3)
