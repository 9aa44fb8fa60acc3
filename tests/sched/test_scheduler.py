"""The batching Scheduler shared by the simulator and the serving engine: slots, stages, buckets, rejections."""

from __future__ import annotations

import pytest

from tessera.sched.scheduler import Buckets, Request, Scheduler, SchedulerError, powers_of_two, stages_for


def _drive(sched: Scheduler, step_s: float = 1.0, limit: int = 10_000) -> list[tuple]:
    """Run steps one at a time until nothing is left; returns (phase, request ids, rows, seq, ctx) per step."""
    now, log = 0.0, []
    while sched.pending() and len(log) < limit:
        step = sched.next_step(now)
        assert step is not None, "requests are pending but no step is ready"
        assert len({r.stage for r in step.requests}) == 1  # one stage per step
        assert len(sched.running) <= sched.slots
        log.append((step.phase, [r.id for r in step.requests], step.rows, step.seq, step.ctx))
        sched.complete(step, now, now + step_s)
        now += step_s
    return log


def test_buckets_round_up_and_reject_what_does_not_fit():
    b = Buckets.default(max_batch=12, max_context=1000)
    assert b.batch == (1, 2, 4, 8, 12) and b.seq == (128, 256, 512, 1000) and b.ctx == (256, 512, 1000)
    assert (b.rows(5), b.prompt(129), b.context(1000)) == (8, 256, 1000)
    with pytest.raises(SchedulerError, match="rows 13 is above the largest bucket"):
        b.rows(13)
    with pytest.raises(SchedulerError, match="strictly increasing"):
        Buckets((4, 2))
    assert powers_of_two(1, 1) == (1,)


def test_llm_requests_prefill_one_by_one_then_decode_together_within_the_slots():
    sched = Scheduler(stages_for("llm"), slots=2, buckets=Buckets.default(4, 256))
    for i, (n_in, n_out) in enumerate([(100, 3), (20, 1), (150, 2)]):
        assert sched.submit(Request(i, 0.0, n_in, n_out))
    log = _drive(sched)
    assert log == [
        ("prefill", [0], 1, 128, 256),   # the prompt but its last token; slot 1 of 2
        ("prefill", [1], 1, 128, 256),   # slot 2 of 2
        ("decode", [0, 1], 2, None, 256),  # last prompt tokens in, first tokens out; 1 is done: its slot is free
        ("prefill", [2], 1, 256, 256),   # 149 tokens -> bucket 256
        ("decode", [0, 2], 2, None, 256),
        ("decode", [0, 2], 2, None, 256),
    ]
    assert [r.generated for r in sorted(sched.done, key=lambda r: r.id)] == [3, 1, 2]
    r0 = next(r for r in sched.done if r.id == 0)
    assert (r0.first_output_s, r0.finish_s, r0.busy_s) == (3.0, 6.0, 4.0)


def test_a_request_in_a_step_in_flight_is_in_no_other_step():
    """After an objective switch a second lane runs the batched phase while the first lane's step is in flight:
    its requests must wait for that step (a request decoded twice at once would get two tokens for one position)."""
    sched = Scheduler(stages_for("llm"), slots=4, buckets=Buckets.default(4, 256))
    for i in range(2):
        sched.submit(Request(i, 0.0, 10, 5))
    now = 0.0
    while any(r.stage != 1 for r in [*sched.running, *sched.waiting]):
        step = sched.next_step(now)
        sched.complete(step, now, now + 1.0)
        now += 1.0
    old_lane = sched.next_step(now, {"decode"})
    assert old_lane is not None and sorted(r.id for r in old_lane.requests) == [0, 1]
    assert sched.next_step(now, {"decode"}) is None  # the new lane: every decoding request is in the old step
    sched.submit(Request(2, now, 10, 5))
    prefill = sched.next_step(now, {"prefill"})
    sched.complete(prefill, now, now + 0.5)
    new_lane = sched.next_step(now + 0.5, {"decode"})
    assert [r.id for r in new_lane.requests] == [2]  # only the request not in flight
    assert all(r.in_step and r.step_since == now for r in old_lane.requests)  # since it was handed out
    assert new_lane.requests[0].step_since == now + 0.5
    sched.complete(old_lane, now, now + 1.0)
    assert not any(r.in_step for r in old_lane.requests)
    assert sorted(r.id for r in sched.next_step(now + 1.0, {"decode"}).requests) == [0, 1]


def test_a_one_token_prompt_needs_no_prefill():
    sched = Scheduler(stages_for("llm"), slots=1, buckets=Buckets.default(1, 64))
    sched.submit(Request("a", 0.0, 1, 2))
    assert [p for p, *_ in _drive(sched)] == ["decode", "decode"]


def test_a_request_waits_for_a_slot_and_state_moves_delay_the_next_stage():
    sched = Scheduler(stages_for("llm"), slots=1, buckets=Buckets.default(1, 64))
    sched.submit(Request("a", 0.0, 10, 3))
    sched.submit(Request("b", 0.0, 10, 2))
    step = sched.next_step(0.0)
    assert step.phase == "prefill" and [r.id for r in step.requests] == ["a"]
    sched.complete(step, 0.0, 1.0, delays={"decode": 0.5})  # KV moved to the decode device
    assert sched.next_step(1.0) is None  # a is moving, b has no slot
    step = sched.next_step(1.5)
    assert step.phase == "decode" and [r.id for r in step.requests] == ["a"]


def test_diffusion_requests_encode_step_and_decode():
    sched = Scheduler(stages_for("diffusion", denoising_steps=3), slots=2, buckets=Buckets.default(2), max_context=None)
    for i in range(3):
        sched.submit(Request(i, 0.0))
    log = _drive(sched)
    phases = [p for p, *_ in log]
    assert phases.count("encode") == 3 and phases.count("decode") == 3
    per_image = {i: sum(1 for p, ids, *_ in log if p == "step" and i in ids) for i in range(3)}
    assert per_image == {0: 3, 1: 3, 2: 3}
    assert all(r.generated == 1 for r in sched.done)


def test_rejections_say_why_and_every_request_ends_somewhere():
    sched = Scheduler(stages_for("llm"), slots=4, buckets=Buckets.default(4, 512), max_context=512, max_queue=2)
    assert not sched.submit(Request("long", 0.0, 500, 20))
    assert sched.submit(Request("x", 0.0, 10, 2)) and sched.submit(Request("y", 0.0, 10, 2))
    assert not sched.submit(Request("z", 0.0, 10, 2))
    assert not sched.submit(Request("none", 0.0, 10, 0))
    reasons = {r.id: r.rejected for r in sched.rejected}
    assert "context of 520 tokens" in reasons["long"] and "queue is full" in reasons["z"]
    assert "at least 1" in reasons["none"]
    _drive(sched)
    assert sorted(r.id for r in sched.done) == ["x", "y"]


def test_bad_scheduler_setups_are_refused():
    with pytest.raises(SchedulerError, match="at least one slot"):
        Scheduler(stages_for("llm"), slots=0, buckets=Buckets.default(1))
    stages = stages_for("llm")
    with pytest.raises(SchedulerError, match="at most one of them batched"):
        Scheduler((stages[1], stages[1]), slots=1, buckets=Buckets.default(1))


def test_two_lanes_prefilling_for_one_engine_never_take_the_same_prompt_and_one_may_decline_to_admit():
    # one engine, two lanes that both prefill (one of them also decodes): a prompt handed to one lane is
    # not offered to the other while its step runs, and a lane told not to admit runs only what it has
    sched = Scheduler(stages_for("llm"), slots=4, buckets=Buckets.default(4, 256))
    for i in range(3):
        sched.submit(Request(i, 0.0, 50, 2))
    first = sched.next_step(0.0, {"prefill"})
    assert (first.phase, [r.id for r in first.requests]) == ("prefill", [0])
    assert sched.next_step(0.0, {"prefill", "decode"}, admit=False) is None  # request 0 is in a step
    second = sched.next_step(0.0, {"prefill", "decode"})
    assert [r.id for r in second.requests] == [1]
    sched.complete(first, 0.0, 1.0)
    step = sched.next_step(1.0, {"prefill", "decode"}, admit=False)  # decodes request 0, admits nobody
    assert (step.phase, [r.id for r in step.requests]) == ("decode", [0])
    assert [r.id for r in sched.waiting] == [2]


def test_an_encoded_image_is_prefilled_before_another_request_is_admitted_and_by_the_lane_that_admitted_it():
    sched = Scheduler(stages_for("vlm"), slots=3, buckets=Buckets.default(4, 512))
    for i in range(3):
        sched.submit(Request(i, 0.0, 300, 1))
    a, b = object(), object()  # two lanes of one engine that both run the prompt stages
    first = sched.next_step(0.0, {"encode", "prefill"}, owner=a)
    assert (first.phase, [r.id for r in first.requests]) == ("encode", [0])
    sched.complete(first, 0.0, 1.0)
    # lane b may not prefill the image lane a encoded; it admits and encodes the next request instead
    other = sched.next_step(1.0, {"encode", "prefill", "decode"}, owner=b)
    assert (other.phase, [r.id for r in other.requests]) == ("encode", [1])
    # lane a prefills its encoded image before it admits request 2
    again = sched.next_step(1.0, {"encode", "prefill"}, owner=a)
    assert (again.phase, [r.id for r in again.requests]) == ("prefill", [0])
    assert [r.id for r in sched.waiting] == [2]


def test_batched_prompts_share_a_prefill_step_within_the_rows_and_tokens_and_join_as_slots_free():
    # 4 slots, prefill steps of up to 4 rows and 512 tokens (rows bucket x prompt bucket)
    sched = Scheduler(stages_for("llm"), slots=4, buckets=Buckets.default(4, 512, 64), prompt_rows=4,
                      prompt_tokens=512)
    for i, (n_in, n_out) in enumerate([(40, 2), (100, 2), (60, 1), (30, 3), (200, 1), (10, 1)]):
        assert sched.submit(Request(i, 0.0, n_in, n_out))
    log = _drive(sched)
    assert log == [
        ("prefill", [0, 1, 2, 3], 4, 128, 128),  # the longest writes 99 tokens: 4 rows x 128 = 512 fit

        ("decode", [0, 1, 2, 3], 4, None, 128),  # 2 is done: one free slot
        ("prefill", [4], 1, 256, 256),           # 199 tokens: bucket 256; 5 would fit, but no slot is free
        ("decode", [0, 1, 3, 4], 4, None, 256),  # 0, 1 and 4 are done: two free slots, only 5 waits
        ("prefill", [5], 1, 64, 128),
        ("decode", [3, 5], 2, None, 128),
    ]
    assert sorted(r.generated for r in sched.done) == [1, 1, 1, 2, 2, 3]


def test_a_prefill_step_stops_at_the_first_prompt_that_does_not_fit_and_lists_its_shapes():
    sched = Scheduler(stages_for("llm"), slots=8, buckets=Buckets.default(8, 512, 64), prompt_rows=8,
                      prompt_tokens=512)
    for i, n_in in enumerate([60, 60, 300, 60]):
        sched.submit(Request(i, 0.0, n_in, 1))
    step = sched.next_step(0.0)
    assert ([r.id for r in step.requests], step.rows, step.seq) == ([0, 1], 2, 64)  # 2 x 512 > 512: 2 waits
    assert [r.id for r in sched.waiting] == [2, 3]  # first come, first served: 3 does not skip ahead
    step = sched.next_step(0.0)
    assert ([r.id for r in step.requests], step.rows, step.seq) == ([2], 1, 512)
    assert sched.prompt_shapes() == [(1, 64), (1, 128), (1, 256), (1, 512), (2, 64), (2, 128), (2, 256),
                                     (4, 64), (4, 128), (8, 64)]
    assert sched.next_step(0.0, max_rows=3) is None  # 3 requests in flight: a cap of 3 admits no more
    assert [r.id for r in sched.next_step(0.0, max_rows=4).requests] == [3]
    with pytest.raises(SchedulerError, match="at least one row and one token"):
        Scheduler(stages_for("llm"), slots=1, buckets=Buckets.default(1), prompt_rows=0)
