"""The prompt steps a served engine runs: listed as its scheduler makes them, and bad sizes refused by name."""

from __future__ import annotations

import pytest

from tessera.cost.profile import Profile
from tessera.hardware.catalog import HOST_ID
from tessera.runtime.prompt_profile import (
    PromptProfileError,
    decode_step_rows,
    prompt_step_shapes,
    with_prompt_kernels,
)
from tessera.sched.scheduler import Buckets, Request
from tessera.serve.engine import serving_scheduler


def _step(lengths: list[int], slots: int = 8, ctx: int = 128, min_prompt: int = 16):
    """The first prefill step the serving engine's scheduler runs for prompts of ``lengths`` arriving together."""
    sched = serving_scheduler(slots, Buckets.default(slots, ctx, min_prompt), ctx)
    for i, n in enumerate(lengths):
        assert sched.submit(Request(i, 0.0, n, 1))
    step = sched.next_step(0.0)
    assert step.phase == "prefill"
    return step.rows, step.seq, step.ctx


def test_every_prefill_step_the_serving_scheduler_makes_is_listed():
    shapes = set(prompt_step_shapes(8, 128, 16))
    made = {_step([n]) for n in range(2, 128)}  # lone prompts of every length that leaves room for a token
    made |= {_step([n] * k) for n in (2, 9, 17, 30, 33, 60, 64) for k in (2, 3, 4, 5, 8)}  # batched prompts
    assert made <= shapes
    assert {(1, 16, 32), (1, 32, 32), (1, 32, 64), (1, 64, 64), (1, 64, 128), (1, 128, 128)} <= shapes
    assert all(rows * seq <= 128 for rows, seq, _ in shapes)  # at most the context's tokens a batched step
    assert (1, 16, 32) in made and (1, 64, 128) in made  # 64 tokens written: the cache of 65 is the 128 bucket


def test_every_decode_bucket_below_the_slots_the_serving_scheduler_makes_is_listed():
    sched = serving_scheduler(8, Buckets.default(8, 128, 16), 128)
    for i in range(8):  # requests generating 1 .. 8 tokens: 8, 7, ..., 1 rows decoding
        assert sched.submit(Request(i, 0.0, 4, i + 1))
    made, now = set(), 0.0
    while (step := sched.next_step(now)) is not None:
        if step.phase == "decode":
            made.add(step.rows)
        sched.complete(step, now, now + 1.0)
        now += 1.0
    assert made - {8} == set(decode_step_rows(8)) == {1, 2, 4}  # the step of every slot: host_profile's own
    assert decode_step_rows(1) == [] and decode_step_rows(12) == [1, 2, 4, 8]
    with pytest.raises(PromptProfileError, match="slots must be a whole number >= 1, got 0"):
        decode_step_rows(0)


@pytest.mark.parametrize("args,match", [
    ((0, 128, 16), "slots must be a whole number >= 1, got 0"),
    ((8, 1, 16), "max_context must be a whole number >= 2, got 1"),
    ((8, 128, 0), "min_prompt must be a whole number >= 1, got 0"),
    ((8, 128, 2.5), "min_prompt must be a whole number >= 1, got 2.5"),
    ((8, 64, 128), "min_prompt 128 is above max_context 64"),
])
def test_bad_sizes_are_refused(args, match):
    with pytest.raises(PromptProfileError, match=match):
        prompt_step_shapes(*args)


def test_a_profile_of_another_device_cannot_join():
    host = Profile(HOST_ID, "test cpu", 1, "smollm2-135m", "decode", "", {}, 0, 1, "now", [])
    gpu = Profile("A100", "A100", None, "smollm2-135m", "prefill", "", {}, 0, 1, "now", [])
    with pytest.raises(PromptProfileError, match=r"prompt step profiles of \['A100'\] cannot join a profile of"):
        with_prompt_kernels(host, [gpu])
