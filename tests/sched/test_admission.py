"""Engine-like admission in the shared Scheduler: paged KV blocks, FCFS admission within the blocks and the
sequence cap, block growth during decode, preemption by recompute, and the simulator admitting from a plan."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from tessera.capture.tiny import tiny_config
from tessera.hardware.cluster import parse_cluster
from tessera.plan.context import PlanContext
from tessera.plan.deployment import EngineAdmission
from tessera.plan.planner import plan_policy
from tessera.sched.scheduler import (
    Buckets,
    KVBudget,
    Request,
    ScheduledStep,
    Scheduler,
    SchedulerError,
    stages_for,
)
from tessera.sim.requests import engines_for, simulate
from tessera.workload import parse_workload


def _sched(blocks: int, slots: int = 64, block: int = 16, max_context: int = 4096, min_seq: int = 128) -> Scheduler:
    return Scheduler(stages_for("llm"), slots, Buckets.default(slots, max_context, min_seq), max_context,
                     kv=KVBudget(blocks, block))


def _until_decode(sched: Scheduler) -> tuple[int, ScheduledStep]:
    """Run steps one second each until the first decode step is handed out; returns the prefills run and that
    step (in flight)."""
    now, prefills = 0.0, 0
    while (step := sched.next_step(now)).phase == "prefill":
        prefills += 1
        sched.complete(step, now, now + 1.0)
        now += 1.0
    return prefills, step


def _drive(sched: Scheduler, limit: int = 10_000) -> list[tuple]:
    """Every step to the end: (phase, request ids, seq bucket, ctx bucket, free blocks after handing it out)."""
    now, log = 0.0, []
    while sched.pending() and len(log) < limit:
        step = sched.next_step(now)
        assert step is not None, "requests are pending but no step is ready"
        assert len(sched.running) <= sched.slots
        assert sum(r.blocks for r in sched.running) + sched.free_blocks == sched.kv.blocks  # no block lost
        log.append((step.phase, [r.id for r in step.requests], step.seq, step.ctx, sched.free_blocks))
        sched.complete(step, now, now + 1.0)
        now += 1.0
    return log


def test_admission_stops_when_the_free_blocks_no_longer_cover_a_prompt():
    # 100 blocks of 16 tokens; a 100-token prompt holds ceil(100 / 16) = 7 blocks: 14 fit (98 blocks), not 15
    sched = _sched(100)
    for i in range(20):
        assert sched.submit(Request(i, 0.0, 100, 50))
    assert _until_decode(sched)[0] == 14
    assert len(sched.running) == 14 and sched.free_blocks == 2 and all(r.blocks == 7 for r in sched.running)
    assert [r.id for r in sched.waiting] == list(range(14, 20))  # first come, first served


def test_the_sequence_cap_binds_when_it_is_below_the_kv_capacity():
    sched = _sched(100, slots=10)
    for i in range(20):
        sched.submit(Request(i, 0.0, 100, 50))
    assert _until_decode(sched)[0] == 10
    assert len(sched.running) == 10 and sched.free_blocks == 100 - 70


def test_blocks_grow_when_the_context_crosses_a_block_boundary():
    # decode step j (0-based) writes cache position 100 + j - 1, so it needs ceil((100 + j) / 16) blocks:
    # 7 through j = 12 (112 tokens), 8 from j = 13, 9 from j = 29 (129 tokens)
    sched = _sched(100)
    sched.submit(Request("a", 0.0, 100, 40))
    req = sched.waiting[0]
    prefills, step = _until_decode(sched)
    assert prefills == 1 and req.blocks == 7
    now, held = 1.0, []
    assert sched.next_step(now) is None  # the decode step handed out is in flight: its request is in no other
    for _ in range(31):
        step = step or sched.next_step(now)
        assert step.phase == "decode" and step.requests == [req]
        held.append(req.blocks)
        sched.complete(step, now, now + 1.0)
        now += 1.0
        step = None
    assert held[:13] == [7] * 13 and held[13:29] == [8] * 16 and held[29:] == [9, 9]
    assert sched.free_blocks == 100 - 9 and req.generated == 31


def test_running_out_of_blocks_preempts_the_latest_admitted_which_is_recomputed_first():
    # 10 blocks of 16 tokens; 32-token prompts (2 blocks each), 64 outputs (a whole context of 96: 6 blocks).
    # Decode step j needs ceil((32 + j) / 16) blocks per request: 3 at j = 1, 4 at j = 17, 5 at 33, 6 at 49.
    sched = _sched(10, slots=4, max_context=256, min_seq=16)
    for name in "abc":
        assert sched.submit(Request(name, 0.0, 32, 64))
    log = _drive(sched)
    decodes = [(ids, free) for phase, ids, _, _, free in log if phase == "decode"]
    prefills = [(ids[0], seq, ctx) for phase, ids, seq, ctx, _ in log if phase == "prefill"]
    # j = 17: a and b take their 4th block, c (the latest admitted) is preempted with 17 tokens generated
    assert decodes[16] == (["a", "b", "c"], 1) and decodes[17] == (["a", "b"], 2)
    # j = 49: a takes its 6th block by preempting b (49 generated); b then needs 6 blocks, only 4 are free, and c
    # (which would fit in 4) may not skip ahead of it: nobody is admitted until a finishes
    assert decodes[48] == (["a", "b"], 0) and decodes[49] == (["a"], 4)
    # recompute: prefill over prompt + generated but the last token, at that length's buckets (seq 80 -> 128)
    assert prefills == [("a", 32, 32), ("b", 32, 32), ("c", 32, 32), ("b", 128, 128), ("c", 64, 64)]
    done = {r.id: r for r in sched.done}
    assert {r: (q.generated, q.preemptions) for r, q in done.items()} == {"a": (64, 0), "b": (64, 1), "c": (64, 1)}
    per_request = {r: sum(r in ids for ids, _ in decodes) for r in "abc"}
    assert per_request == {"a": 64, "b": 64, "c": 64}  # every output decoded once
    assert sched.preemptions == 2 and sched.free_blocks == 10 and not sched.running


def test_a_request_whose_whole_context_never_fits_is_rejected_at_submit():
    sched = _sched(10)  # 160 tokens
    assert sched.submit(Request("fits", 0.0, 100, 60))
    assert not sched.submit(Request("long", 0.0, 100, 61))
    assert "needs 11 KV blocks of 16 tokens" in sched.rejected[0].rejected
    assert "above the engine's 10 blocks (160 tokens)" in sched.rejected[0].rejected
    with pytest.raises(SchedulerError, match="positive whole number of blocks"):
        KVBudget(0, 16)
    with pytest.raises(SchedulerError, match="positive whole number of block size"):
        KVBudget(4, 0)


def test_without_a_kv_budget_the_slots_alone_admit():
    # the requests of the preemption case above, without a budget: all three in flight to the end, none preempted
    sched = Scheduler(stages_for("llm"), 4, Buckets.default(4, 256, 16), 256)
    for name in "abc":
        sched.submit(Request(name, 0.0, 32, 64))
    now, log = 0.0, []
    while sched.pending():
        step = sched.next_step(now)
        log.append((step.phase, [r.id for r in step.requests]))
        sched.complete(step, now, now + 1.0)
        now += 1.0
    assert log == [("prefill", ["a"]), ("prefill", ["b"]), ("prefill", ["c"])] + [("decode", ["a", "b", "c"])] * 64
    assert sched.preemptions == 0 and sched.free_blocks is None and all(r.blocks == 0 for r in sched.done)


WORKLOAD = "fixed:in=64,out=8,requests=8"


@pytest.fixture(scope="module")
def small():
    ctx = PlanContext("smollm2-135m", parse_cluster("A100:1"), parse_workload(WORKLOAD), WORKLOAD, 4)
    return ctx, plan_policy(ctx, "homogeneous")


def test_the_simulator_admits_from_the_plans_kv_budget(small):
    ctx, plan = small
    plan.admission = None
    base = simulate(ctx, plan, min_prompt=16)
    # 9 blocks of 16: two 64-token prompts (4 blocks each) are admitted, their 65th tokens need a 5th block each
    plan.admission = EngineAdmission(max_seqs=4, kv_tokens=9 * 16, block_size=16, limited_by="memory on A100")
    engine = engines_for(ctx, plan, min_prompt=16)[0]
    assert (engine.scheduler.slots, engine.scheduler.kv) == (4, KVBudget(9, 16))
    tight = simulate(ctx, plan, min_prompt=16)
    assert tight.completed == 8 and tight.rejected == 0 and tight.preemptions > 0
    assert tight.summary()["preemptions"] == tight.preemptions
    assert tight.makespan_s > base.makespan_s
    # the victims had generated 1 token: the recompute writes 64 tokens (prompt 63 + 1) in a 65-token context,
    # timed at that bucket (seq 64, ctx 128) besides the first prefills' (seq 64 for 63 tokens, ctx 64)
    prefills = {(key[2], key[3]) for key in engine.timer._cache if key[0] == "prefill"}
    assert prefills == {(64, 64), (64, 128)}
    plan.admission = EngineAdmission(max_seqs=4, kv_tokens=1 << 20, block_size=16, limited_by="--max-num-seqs")
    roomy = simulate(ctx, plan, min_prompt=16)
    assert roomy.preemptions == 0 and roomy.summary() == base.summary()  # room for all: the slots alone bind
    plan.admission = EngineAdmission(max_seqs=2, kv_tokens=1 << 20, block_size=16, limited_by="--max-num-seqs")
    assert simulate(ctx, plan, min_prompt=16).makespan_s > base.makespan_s  # fewer in flight


def test_an_ssm_plan_admits_by_sequences_alone(tmp_path):
    folder = tmp_path / "tiny-ssm"
    tiny_config("ssm").save_pretrained(folder)
    wl = "fixed:in=16,out=4,requests=4"
    ctx = PlanContext(str(folder), parse_cluster("A100:1"), parse_workload(wl), wl, 4)
    plan = plan_policy(ctx, "homogeneous")
    plan.admission = EngineAdmission(max_seqs=2, kv_tokens=16, block_size=16, limited_by="memory on A100")
    sched = engines_for(ctx, plan)[0].scheduler
    assert (sched.slots, sched.kv) == (2, None)  # an SSM's state does not grow with the context


def test_request_dist_engines_admit_from_their_device_types_admission():
    ctx = PlanContext("smollm2-135m", parse_cluster("A100:1,L40S:1"), parse_workload(WORKLOAD), WORKLOAD, 4)
    plan = plan_policy(ctx, "request-dist")
    parts = plan.extra["replicas"]
    assert sorted(p["device"] for p in parts) == ["A100", "L40S"]
    for i, part in enumerate(parts):  # the homogeneous plans' summaries: set as the planner fills them
        part["admission"] = asdict(EngineAdmission(3 + i, (20 + i) * 16, 16, f"memory on {part['device']}"))
    got = {e.name: (e.scheduler.slots, e.scheduler.kv) for e in engines_for(ctx, plan)}
    assert got == {parts[0]["device"]: (3, KVBudget(20, 16)), parts[1]["device"]: (4, KVBudget(21, 16))}
    parts[1]["admission"] = None  # an old plan's summary: the step plan's batch, no KV budget
    batch = max((s for s in plan.steps if s.solver.get("replica_of") == parts[1]["device"]),
                key=lambda s: s.repeats).batch
    assert {e.name: (e.scheduler.slots, e.scheduler.kv) for e in engines_for(ctx, plan)}[parts[1]["device"]] == \
        (batch, None)


def test_simulate_cli_reports_the_preemptions_of_a_plan_file(small, tmp_path):
    from typer.testing import CliRunner

    from tessera.cli.main import app

    ctx, plan = small
    plan.admission = EngineAdmission(max_seqs=4, kv_tokens=9 * 16, block_size=16, limited_by="memory on A100")
    expected = simulate(ctx, plan).preemptions
    path = plan.save(tmp_path / "plan.json")
    res = CliRunner().invoke(app, ["simulate", "smollm2-135m", "--cluster", "A100:1", "-w", WORKLOAD, "--plan",
                                   str(path)])
    assert res.exit_code == 0, res.output
    row = next(line for line in res.stdout.splitlines() if "preemptions" in line)
    assert expected > 0 and row.split("│")[2].strip() == f"{expected:,}"


def test_a_row_waits_while_the_latest_admitted_is_inside_a_prefill_on_another_lane():
    # prefill and decode on separate lanes (disaggregated): 5 blocks of 16, 32-token prompts (2 blocks each)
    sched = _sched(5, slots=4, max_context=256, min_seq=16)
    sched.submit(Request("a", 0.0, 32, 40))
    sched.submit(Request("b", 0.0, 32, 40))
    first = sched.next_step(0.0, {"prefill"})
    sched.complete(first, 0.0, 1.0)
    now = 1.0
    for _ in range(17):  # a's decode steps j = 0 .. 16 (its 3rd block at j = 1): 2 blocks stay free
        step = sched.next_step(now, {"decode"})
        sched.complete(step, now, now + 1.0)
        now += 1.0
    b = sched.next_step(now, {"prefill"})  # b admitted (2 blocks) and prefilling, not completed yet
    assert [r.id for r in b.requests] == ["b"] and sched.free_blocks == 0
    # j = 17 needs a's 4th block: the latest admitted (b) is inside its prefill, so a waits instead of going
    assert sched.next_step(now, {"decode"}) is None and sched.preemptions == 0
    sched.complete(b, now, now + 1.0)
    step = sched.next_step(now + 1.0, {"decode"})  # b's prefill ended: b is preempted, a takes the block
    assert [r.id for r in step.requests] == ["a"] and sched.preemptions == 1 and sched.waiting[0].id == "b"
    assert sched.waiting[0].generated == 0 and sched.free_blocks == 1
