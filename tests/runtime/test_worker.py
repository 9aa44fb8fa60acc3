"""The worker's dispatch: every command type has a handler, and a command the worker does not know (or bytes
that are no command) gets a clear error back to the driver, after which the worker goes on answering."""

from __future__ import annotations

import multiprocessing
import threading
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tessera.runtime import commands as c
from tessera.runtime.pool import WorkerFailed
from tessera.runtime.wire import decode, encode
from tessera.runtime.worker import HANDLERS, Worker, WorkerConfig, worker_main


@dataclass(frozen=True)
class Teleport(c.Command):
    """A command no worker has a handler for."""

    where: str = "moon"


def test_every_command_has_a_handler():
    assert set(HANDLERS) == set(c.COMMANDS)


@pytest.mark.parametrize("cmd", [Teleport(), c.Pong(1, 1, "cpu"), {"op": "ping"}], ids=["new", "reply", "dict"])
def test_a_command_the_worker_does_not_know_is_refused_clearly(cmd):
    worker = Worker(WorkerConfig(7, "127.0.0.1", 0, 1), store=None)
    name = type(cmd).__name__
    with pytest.raises(c.UnknownCommand, match=rf"worker 7 does not know the command {name} \(commands: Ping, "):
        worker.handle(cmd)
    assert isinstance(worker.handle(c.Ping()), c.Pong)


def test_the_worker_loop_answers_unknown_commands_with_a_failure_and_goes_on():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    driver, theirs = multiprocessing.Pipe(duplex=True)
    cfg = WorkerConfig(0, "127.0.0.1", store.port, torch.get_num_threads())
    loop = threading.Thread(target=worker_main, args=(cfg, store, theirs), daemon=True)
    loop.start()

    def ask(data: bytes):
        driver.send_bytes(data)
        assert driver.poll(10.0)
        return decode(driver.recv_bytes())

    garbled = ask(b"\x80\x05garbage")
    assert isinstance(garbled, c.Failure) and garbled.error.startswith("ProtocolError: unreadable message")
    unknown = ask(encode(c.Pong(1, 1, "cpu")))
    assert isinstance(unknown, c.Failure)
    assert unknown.error.startswith("UnknownCommand: worker 0 does not know the command Pong")
    assert "Traceback" in unknown.traceback
    assert isinstance(ask(encode(c.Ping())), c.Pong)
    assert isinstance(ask(encode(c.Stop())), c.Done)
    loop.join(10.0)
    assert not loop.is_alive()


def test_a_pool_worker_sent_an_unknown_command_fails_it_and_keeps_serving(pool):
    with pytest.raises(WorkerFailed, match="does not know the command Connected"):
        pool.call({0: c.Connected(0)}, 30.0)
    replies = pool.call({w: c.Ping() for w in pool.alive}, 30.0)
    assert all(isinstance(r, c.Pong) for r in replies.values())


def test_a_worker_holding_several_phases_keeps_one_copy_of_each_weight():
    """Every phase's executor binds the worker's own copy of a weight, made once on its device. On `meta`
    every move to the device makes a new storage, so a copy per phase would show as distinct storages."""
    from tessera.capture.build import instantiate
    from tessera.capture.models import resolve_model
    from tessera.capture.phases import StepShape, build_model, step_for
    from tessera.capture.tiny import tiny_config
    from tessera.capture.trace import trace
    from tessera.program.program import single_device_program

    meta, values = instantiate(lambda: build_model("llm", tiny_config("llm")), "meta")
    spec = resolve_model("smollm2-135m")
    graphs = {p: trace(step_for(spec, meta, values, p, StepShape(batch=1, seq=8 if p == "prefill" else 1, ctx=16),
                                device="meta")) for p in ("prefill", "decode")}
    phases = {p: c.PhaseLoad(g, single_device_program(g, "meta"), []) for p, g in graphs.items()}
    shared = sorted(set(phases["prefill"].program.weights) & set(phases["decode"].program.weights))
    assert shared
    weights = {}
    for g in graphs.values():
        for n in g.weight_names():
            b = g.buffers[n]
            weights.setdefault(n, torch.zeros(b.shape, dtype=getattr(torch, b.dtype)))  # on the CPU, as loaded
    worker = Worker(WorkerConfig(0, "127.0.0.1", 0, 1, device="meta"), store=None)
    loaded = worker.load(c.Load(phases, None, weights, 1))
    assert loaded.weights == len(worker.weights) and all(t.device.type == "meta" for t in worker.weights.values())
    for name in shared:
        mine = worker.weights[name].untyped_storage()._cdata
        bound = {p: worker.phases[p][3]._static[name]._cdata for p in phases}
        assert set(bound.values()) == {mine}, f"{name}: phases bind {bound}, the worker holds {mine}"


def test_a_cpu_worker_packs_each_gemm_weight_once_for_every_phase():
    """bf16 GEMMs run on packed weights (`kernels.prepacked`): one packed copy per weight set in the worker,
    however many phases read it; a load of other weights starts afresh."""
    from tessera.capture.phases import StepShape
    from tessera.capture.tiny import tiny_config
    from tessera.kernels.prepacked import packable
    from tessera.program.program import single_device_program
    from tests.runtime.tiny_llm import tiny_llm_graphs

    if not packable(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU's oneDNN has no bf16 GEMM")
    graphs, weights = tiny_llm_graphs({"prefill": StepShape(batch=1, seq=8, ctx=16, slots=2),
                                       "decode": StepShape(batch=1, seq=1, ctx=16, slots=2),
                                       "decode@2": StepShape(batch=2, seq=1, ctx=16)})
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    gen = torch.Generator().manual_seed(1)
    worker = Worker(WorkerConfig(0, "127.0.0.1", 0, 1), store=None)
    worker.load(c.Load({p: c.PhaseLoad(g, single_device_program(g), []) for p, g in graphs.items()}, None, weights, 1))
    ids = torch.randint(0, 64, (1, 8), generator=gen)
    worker.step(c.Step("prefill", [{"input_ids": ids, "slots": torch.tensor([0])}], [0]))
    for phase, rows in (("decode", 1), ("decode@2", 2)):
        inputs = {"input_ids": torch.full((rows, 1), 5), "positions": torch.full((rows,), 8),
                  "slots": torch.arange(rows)}
        worker.step(c.Step(phase, [inputs], [0]))
    layers = tiny_config("llm").num_hidden_layers
    assert len(worker.packed) == 4 * layers + 1  # QKV, O, gate/up, down a layer, and the LM head: not per phase
    assert all(worker.phases[p][3].packed is worker.packed for p in graphs)
    first = worker.packed
    worker.load(c.Load({"decode": c.PhaseLoad(graphs["decode"], single_device_program(graphs["decode"]), [])},
                       None, {n: w.clone() * 2 for n, w in weights.items()}, 1))
    # other weights: packed afresh (by the load's warm pass), nothing kept from the old
    assert worker.packed is not first and len(worker.packed) == 4 * layers + 1
    assert not {id(t) for t in worker.packed._packed.values()} & {id(t) for t in first._packed.values()}


def test_a_cpu_worker_runs_every_phase_once_at_load_and_leaves_its_state_zero(monkeypatch):
    """The load's warm pass (`Worker._warm`): every kernel of every phase bound before the first step, the
    state still zero after it; a phase whose pass fails is named and runs cold, and the load succeeds."""
    from tessera.capture.phases import StepShape
    from tessera.program.program import single_device_program
    from tessera.runtime.executor import Executor
    from tests.runtime.tiny_llm import tiny_llm_graphs

    graphs, weights = tiny_llm_graphs({"prefill": StepShape(batch=1, seq=8, ctx=16, slots=2),
                                       "decode": StepShape(batch=2, seq=1, ctx=16)})
    load = c.Load({p: c.PhaseLoad(g, single_device_program(g), []) for p, g in graphs.items()}, None, weights, 1)
    worker = Worker(WorkerConfig(0, "127.0.0.1", 0, 1), store=None)
    worker.load(load)
    assert worker.warm_errors == {}
    for _, program, _, ex, _, _ in worker.phases.values():
        assert set(ex._calls) == {i.kernel for i in program.instructions if i.kind == "run"} != set()
    assert worker.state and all(not t.any() for instance in worker.state for t in instance.values())

    def broken(self, index):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(Executor, "run_kernel", broken)
    cold = Worker(WorkerConfig(0, "127.0.0.1", 0, 1), store=None)
    cold.load(load)
    assert cold.warm_errors == {p: "RuntimeError: no kernel today" for p in graphs}
    monkeypatch.undo()
    inputs = {"input_ids": torch.full((2, 1), 5), "positions": torch.full((2,), 3), "slots": torch.arange(2)}
    ran = [w.step(c.Step("decode", [inputs], [0])).outputs for w in (worker, cold)]
    assert all(torch.equal(a, b) for a, b in zip(ran[0][0].values(), ran[1][0].values(), strict=True))


def test_the_local_engine_runs_every_phase_once_when_warmed_and_leaves_its_state_zero(monkeypatch):
    """`ReplayRunner.warm` (serve --local's start): every kernel of every phase bound, the state zero after it,
    the same outputs as a runner never warmed; a phase whose pass fails is named and runs cold."""
    from tessera.capture.phases import StepShape
    from tessera.runtime.executor import Executor
    from tessera.runtime.generate import ReplayRunner
    from tessera.runtime.probe import zero_state
    from tests.runtime.tiny_llm import tiny_llm_graphs

    graphs, weights = tiny_llm_graphs({"prefill": StepShape(batch=1, seq=8, ctx=16, slots=2),
                                       "decode": StepShape(batch=2, seq=1, ctx=16)})

    def runner() -> ReplayRunner:
        state = {}
        for g in graphs.values():
            state.update(zero_state(g, [n for n in g.state if n not in state]))
        return ReplayRunner(graphs, weights, state)

    warm, cold = runner(), runner()
    assert warm.warm() == {}
    for ex in warm.executors.values():
        assert set(ex._calls) == {i.kernel for i in ex.program.instructions if i.kind == "run"} != set()
    assert all(not t.any() for t in warm.state.values())
    inputs = {"input_ids": torch.full((2, 1), 5), "positions": torch.full((2,), 3), "slots": torch.arange(2)}
    ran = [r("decode", inputs) for r in (warm, cold)]
    assert all(torch.equal(ran[0][n], ran[1][n]) for n in ran[0])

    def broken(self, index):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(Executor, "run_kernel", broken)
    assert runner().warm() == {p: "RuntimeError: no kernel today" for p in graphs}
