"""Several steps in flight: `DistributedRunner.submit` / `result` on real workers and real kernels.

A tiny LLM under its prefill-decode plan on two workers of the shared pool: prefills run on one worker,
decodes on the other. The same sequence of steps is run one at a time (``step_chunks``) and all submitted
at once (prefills pushing their KV on to the decode worker) with results collected in reverse order; every
output and the final state are `torch.equal`. A step that fails in flight raises for that step only.
"""

from __future__ import annotations

import pytest
import torch

from tessera.capture.phases import make_step
from tessera.capture.tiny import tiny_config
from tessera.plan.planner import plan_policy
from tessera.runtime.distributed import DistributedRunner, RuntimeInputError
from tessera.runtime.pool import WorkerFailed
from tessera.weights import unique_state

PROMPT, CTX, M, VOCAB = 6, 16, 2, 200


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Graphs, placements, micro-batches and weights of a tiny LLM's prefill-decode plan on cpu:2 (two slots
    per state instance), and its eager steps (for their input shapes)."""
    from tessera.runtime.session import runtime_context

    folder = tmp_path_factory.mktemp("tiny-llm") / "tiny-llm"
    tiny_config("llm").save_pretrained(folder)
    ctx = runtime_context(str(folder), 2, PROMPT, 3, CTX, 2 * M, M)
    plan = plan_policy(ctx, "prefill-decode")
    assert plan.feasible, plan.reason
    by_phase = {ph.phase: ph for ph in ctx.phases}
    graphs = {s.phase: ctx.graph(by_phase[s.phase], s.micro_batches) for s in plan.steps}
    placements = {s.phase: s.assignment for s in plan.steps}
    assert set(placements["prefill"]).isdisjoint(placements["decode"])  # two lanes: one worker each
    steps = {}
    for phase, g in graphs.items():
        meta = g.meta
        steps[phase] = make_step(str(folder), phase, batch=meta.get("batch"),
                                 seq=meta.get("seq") if phase == "prefill" else None, ctx=meta.get("ctx"),
                                 device="cpu", slots=meta.get("slots"))
    weights, _ = unique_state({k: v for st in steps.values() for k, v in st.modules.items()})
    return graphs, placements, {s.phase: s.micro_batches for s in plan.steps}, weights, steps


def _runner(pool, setup) -> DistributedRunner:
    graphs, placements, micro, weights, _ = setup
    return DistributedRunner(pool, graphs, placements, micro, weights=weights, state_instances=M)


def _prefill(steps, seed: int, slot: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inputs = {n: v.clone() for n, v in steps["prefill"].inputs.items()}
    inputs["input_ids"] = torch.randint(1, VOCAB, inputs["input_ids"].shape, generator=g)
    inputs["slots"] = torch.full_like(inputs["slots"], slot)
    return inputs


def _decode(steps, seed: int, position: int) -> list[dict[str, torch.Tensor]]:
    """One decode step's chunks: micro-batch i on state instance i, its rows on slots 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    chunks = []
    for _ in range(M):
        inputs = {n: v.clone() for n, v in steps["decode"].inputs.items()}
        inputs["input_ids"] = torch.randint(1, VOCAB, inputs["input_ids"].shape, generator=g)
        inputs["slots"] = torch.arange(inputs["slots"].numel()).reshape(inputs["slots"].shape)
        inputs["positions"] = torch.full_like(inputs["positions"], position)
        chunks.append(inputs)
    return chunks


def _scenario(steps) -> list[tuple[str, list[dict[str, torch.Tensor]], list[int]]]:
    """Prefills (one worker) and decodes (the other) interleaved; the second decode reads rows a prefill
    submitted after the first decode wrote."""
    return [("prefill", [_prefill(steps, 1, 0)], [0]),
            ("prefill", [_prefill(steps, 2, 1)], [0]),
            ("decode", _decode(steps, 3, PROMPT), [0, 1]),
            ("prefill", [_prefill(steps, 4, 0)], [1]),
            ("decode", _decode(steps, 5, PROMPT + 1), [0, 1]),
            ("prefill", [_prefill(steps, 6, 1)], [1]),
            ("decode", _decode(steps, 7, PROMPT + 2), [0, 1])]


def _assert_equal(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]], what: str) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for name in g:
            assert torch.equal(g[name], w[name]), f"{what}: output {name} differs"


def test_two_steps_in_flight_with_interleaved_replies_equal_one_at_a_time(pool, setup):
    steps = setup[4]
    scenario = _scenario(steps)
    one_at_a_time = _runner(pool, setup)
    expected = [one_at_a_time.step_chunks(phase, chunks, inst) for phase, chunks, inst in scenario]
    state = one_at_a_time.get_state()

    runner = _runner(pool, setup)
    handles = [runner.submit_chunks(phase, chunks, inst, push_to=("decode",) if phase == "prefill" else ())
               for phase, chunks, inst in scenario]
    devices = {h.phase: h.workers for h in handles}
    assert devices["prefill"].isdisjoint(devices["decode"])
    got = {}
    for i in reversed(range(len(handles))):  # the last submitted first: replies of earlier steps are filed by id
        got[i] = runner.result(handles[i])
    for i, (phase, _, _) in enumerate(scenario):
        _assert_equal(got[i], expected[i], f"step {i} ({phase})")
    assert runner.moved_bytes == one_at_a_time.moved_bytes  # the same rows moved, pushed instead of fetched
    final = runner.get_state()
    for inst in range(M):
        assert final[inst].keys() == state[inst].keys()
        for name, t in state[inst].items():
            assert torch.equal(final[inst][name], t), f"state {name} of instance {inst} differs"
    with pytest.raises(RuntimeInputError, match="not in flight"):
        runner.result(handles[0])


def test_wait_returns_the_steps_whose_replies_are_in(pool, setup):
    steps = setup[4]
    reference = _runner(pool, setup)
    expected = {"decode": reference.step_chunks("decode", _decode(steps, 3, PROMPT), [1, 1]),
                "prefill": reference.step_chunks("prefill", [_prefill(steps, 1, 0)], [0])}
    runner = _runner(pool, setup)
    prefill = runner.submit_chunks("prefill", [_prefill(steps, 1, 0)], [0], push_to=("decode",))
    decode = runner.submit_chunks("decode", _decode(steps, 3, PROMPT), [1, 1])  # rows no prefill wrote
    pending = [prefill, decode]
    seen = []
    while pending:
        ready = runner.wait(pending)
        assert ready and all(runner.done(h) for h in ready)
        seen += ready
        pending = [h for h in pending if h not in ready]
    assert {h.id for h in seen} == {prefill.id, decode.id}
    _assert_equal(runner.result(decode), expected["decode"], "decode")
    _assert_equal(runner.result(prefill), expected["prefill"], "prefill")
    runner.settle()  # the pushed rows received: the shared pool owes this runner nothing


def test_a_failed_step_in_flight_fails_alone_with_its_error(pool, setup):
    steps = setup[4]
    reference = _runner(pool, setup)
    expected = {"decode": reference.step_chunks("decode", _decode(steps, 3, PROMPT), [0, 1]),
                "prefill": reference.step_chunks("prefill", [_prefill(steps, 2, 1)], [1])}
    runner = _runner(pool, setup)
    bad = _prefill(steps, 1, 0)
    bad["input_ids"] = bad["input_ids"].float()  # the worker's executor refuses it (the driver checks only shapes)
    failing = runner.submit_chunks("prefill", [bad], [0], push_to=("decode",))
    decode = runner.submit_chunks("decode", _decode(steps, 3, PROMPT), [0, 1])
    _assert_equal(runner.result(decode), expected["decode"], "the decode in flight beside the failed prefill")
    with pytest.raises(WorkerFailed, match=rf"cpu:\d: prefill step {failing.id} failed: ExecutionError: input 'input_ids'"):
        runner.result(failing)
    assert all(entry.part != failing.id for entry in runner.history)  # a failed step is not replayed
    _assert_equal(runner.step_chunks("prefill", [_prefill(steps, 2, 1)], [1]), expected["prefill"],
                  "a prefill after the failure")
    runner.settle()


def test_submit_checks_its_inputs(pool, setup):
    steps = setup[4]
    runner = _runner(pool, setup)
    with pytest.raises(RuntimeInputError, match="no graph for phase 'verify'"):
        runner.submit_chunks("prefill", [_prefill(steps, 1, 0)], [0], push_to=("verify",))
    with pytest.raises(RuntimeInputError, match="runs 2 micro-batches per step"):
        runner.submit_chunks("decode", _decode(steps, 3, PROMPT)[:1], [0])
