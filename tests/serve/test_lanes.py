"""The serving engine's lanes: under prefill-decode the prefill worker and the decode worker work at the same
time, and the tokens are those of one process."""

from __future__ import annotations

import threading

from tessera.serve.backend import ObjectivePlacements
from tessera.serve.config import ServeConfig
from tessera.serve.engine import GenerationParams
from tessera.serve.lanes import Lane, lanes_of
from tessera.serve.launch import start_engine


def _placements(prefill: list[int], decode: list[int], latency_decode: list[int] | None = None) -> ObjectivePlacements:
    placements = {"prefill@16": prefill, "prefill@32": prefill, "decode@1": decode, "decode@2": decode}
    phases = {o: {n: n for n in placements} for o in ("latency", "throughput")}
    if latency_decode is not None:
        for b in ("decode@1", "decode@2"):
            placements[f"{b}:latency"], placements[f"{b}:throughput"] = latency_decode, placements.pop(b)
            phases["latency"][b], phases["throughput"][b] = f"{b}:latency", f"{b}:throughput"
    return ObjectivePlacements(placements, phases, latency_decode is not None)


def test_lanes_are_the_phases_sharing_workers():
    split = _placements([0, 0, 0], [1, 1, 1])  # prefill-decode: one worker each
    assert lanes_of(split, "throughput") == [Lane(frozenset({"prefill"}), frozenset({0})),
                                             Lane(frozenset({"decode"}), frozenset({1}))]
    pipeline = _placements([0, 1, 1], [0, 0, 1])  # both phases span both workers: they take turns
    assert lanes_of(pipeline, "throughput") == [Lane(frozenset({"prefill", "decode"}), frozenset({0, 1}))]
    switched = _placements([0, 0, 0], [1, 1, 1], latency_decode=[0, 0, 0])  # the latency plan decodes on 0
    assert lanes_of(switched, "latency") == [Lane(frozenset({"prefill", "decode"}), frozenset({0}))]
    assert len(lanes_of(switched, "throughput")) == 2


def _generate(engine, prompts: list[str], max_tokens: int, later: list[str]) -> dict[str, list[int]]:
    """Greedy tokens per prompt: ``prompts`` first, ``later`` once the first request has its first token (so
    their prefills run while the first ones decode)."""
    first_token = threading.Event()
    finished: dict[str, str] = {}
    all_done = threading.Event()
    gens = {}
    total = len(prompts) + len(later)

    def sink_for(p):
        def sink(kind, payload):
            if kind == "token":
                first_token.set()
            if kind in ("done", "error"):
                finished[p] = f"{kind}:{payload}"
                if len(finished) == total:
                    all_done.set()
        return sink

    def submit(p):
        gens[p] = engine.submit(engine.tokenizer(p).input_ids, GenerationParams(max_tokens=max_tokens), sink_for(p))

    for p in prompts:
        submit(p)
    assert first_token.wait(300)
    for p in later:
        submit(p)
    assert all_done.wait(600)
    assert all(v == "done:length" for v in finished.values()), finished
    return {p: list(g.tokens) for p, g in gens.items()}


def test_prefill_and_decode_lanes_overlap_and_tokens_equal_one_process():
    """Two requests decode while two more arrive: the new prompts are prefilled on the prefill worker while
    the decode worker decodes (busy intervals of a prefill step and a decode step overlap on the host clock).
    GEMMs row by row (batch invariant) so that a request's greedy tokens cannot depend on which requests
    shared its decode steps; they equal one process's."""
    prompts, later = ["The capital of France is", "Once upon a time"], ["def fibonacci(n):", "Water boils at"]
    # both objectives on the prefill-decode plan (its latency-objective step plans put everything on one worker)
    cfg = ServeConfig("smollm2-135m", "cpu:2", slots=4, max_context=128, policy="prefill-decode",
                      latency_policy="prefill-decode", threads=1, batch_invariant=True)
    engine, how = start_engine(cfg)
    try:
        lanes = lanes_of(engine.placements, engine.objective)
        assert [set(lane.phases) for lane in lanes] == [{"prefill"}, {"decode"}], how
        tokens = _generate(engine, prompts, 24, later)
        log = list(engine.backend.step_log)
    finally:
        engine.stop()
    busy = {"prefill": [], "decode": []}
    for timing in log:
        for device, start, seconds in zip(timing.workers, timing.started_s, timing.worker_seconds, strict=True):
            busy[timing.phase.split("@")[0]].append((device, start, start + seconds))
    devices = {phase: {d for d, _, _ in spans} for phase, spans in busy.items()}
    assert len(devices["prefill"]) == len(devices["decode"]) == 1 and devices["prefill"] != devices["decode"]
    overlaps = [(p, d) for p in busy["prefill"] for d in busy["decode"] if p[1] < d[2] and d[1] < p[2]]
    assert overlaps, "no prefill step ran while a decode step ran"

    local = ServeConfig("smollm2-135m", "cpu:1", slots=4, max_context=128, local=True, threads=1,
                        batch_invariant=True)
    reference, _ = start_engine(local)
    try:
        expected = _generate(reference, prompts, 24, later)
    finally:
        reference.stop()
    assert tokens == expected


def test_a_step_in_flight_is_waited_for_at_most_max_wait():
    """The engine passes its monitor's window as ``max_wait``: a long step no longer blocks the loop (and so the
    monitor's windows) until it ends; while an admitting lane is idle the wait stays at POLL_S."""
    from types import SimpleNamespace

    from tessera.serve.lanes import POLL_S, LaneRunner

    decode, prefill = Lane(frozenset({"decode"}), frozenset({1})), Lane(frozenset({"prefill"}), frozenset({0}))
    waits: list = []
    pending = [SimpleNamespace(phase="decode")]

    def next_step(now, phases):
        return pending.pop() if pending and "decode" in phases else None

    def wait(handles, timeout_s):
        waits.append(timeout_s)
        return []  # the step runs on

    for lanes, max_wait, expected in (([decode], 0.3, 0.3), ([decode], None, None), ([decode, prefill], 0.3, POLL_S),
                                      ([decode, prefill], 0.001, 0.001)):
        pending[:] = [SimpleNamespace(phase="decode")]
        runner = LaneRunner(lambda lanes=lanes: lanes, next_step, lambda step: ("handle", None),
                            lambda *a: None, wait, frozenset({"decode"}))
        assert runner.turn(0.0, max_wait) and runner.busy()
        assert waits[-1] == expected
