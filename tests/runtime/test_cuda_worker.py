"""A worker on a CUDA device: every phase binds one copy of each weight, segments are captured into CUDA graphs
at load and replayed with the results of eager execution, and transfers between two CUDA workers (pinned
buffers, side stream) carry exactly the bytes eager execution in one process gives. Only where CUDA is; on a
machine without it every test here is skipped and the host path is covered by the rest of tests/runtime."""

from __future__ import annotations

import pytest
import torch

from tessera.capture.phases import StepShape
from tessera.graph.codec import dtype_from_name
from tessera.program.program import build_programs, single_device_program
from tessera.runtime import commands as c
from tessera.runtime.worker import Worker, WorkerConfig
from tests.runtime.tiny_llm import tiny_llm_graphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda:0"
PROMPT, CTX, STEPS = 8, 16, 4


@pytest.fixture(scope="module")
def tiny():
    """Tiny llm graphs (prefill, decode, decode at batch 2: three phases) and random weights on the host."""
    return tiny_llm_graphs({"prefill": StepShape(batch=1, seq=PROMPT, ctx=CTX),
                            "decode": StepShape(batch=1, seq=1, ctx=CTX), "decode@2": StepShape(batch=2, seq=1, ctx=CTX)})


def _worker(graphs, weights, cuda_graphs: bool, phases=("prefill", "decode")) -> Worker:
    worker = Worker(WorkerConfig(0, "127.0.0.1", 0, 1, device=DEVICE, cuda_graphs=cuda_graphs), store=None)
    load = {p: c.PhaseLoad(graphs[p], single_device_program(graphs[p], DEVICE), []) for p in phases}
    worker.load(c.Load(load, None, weights, 1))
    return worker


def _generate(worker: Worker) -> list[torch.Tensor]:
    ids = torch.randint(0, 64, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    out = worker.step(c.Step("prefill", [{"input_ids": ids, "slots": torch.tensor([0])}], [0])).outputs[0]
    logits = [out["logits"]]
    for i in range(STEPS):
        token = logits[-1][..., -1, :].argmax(-1).reshape(1, 1)
        inputs = {"input_ids": token, "positions": torch.tensor([PROMPT + i]), "slots": torch.tensor([0])}
        logits.append(worker.step(c.Step("decode", [inputs], [0])).outputs[0]["logits"])
    return logits


def test_graphs_are_captured_at_load_and_replay_what_eager_computes(tiny):
    graphs, weights = tiny
    eager = _generate(_worker(graphs, weights, cuda_graphs=False))
    worker = _worker(graphs, weights, cuda_graphs=True)
    sampler = {p: [k.index for k in graphs[p].kernels if k.op == "tessera.sample.default"] for p in graphs}
    for phase in ("prefill", "decode"):
        stats = worker.graphs[phase].stats()
        assert stats.captured == stats.segments == 1 and stats.failed == {}, stats  # at load, before any step
        assert set(stats.eager_kernels) == set(sampler[phase])
        assert worker.graphs[phase].load_error is None
    replayed = _generate(worker)
    assert worker.graphs["prefill"].stats().replays >= 2  # once at load, once in the step
    assert worker.graphs["decode"].stats().replays >= STEPS + 1
    for a, b in zip(replayed, eager, strict=True):
        torch.testing.assert_close(a, b)
    assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(replayed, eager, strict=True))


def test_a_worker_holds_one_copy_of_each_weight_on_the_gpu_across_phases(tiny):
    graphs, weights = tiny
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    worker = _worker(graphs, weights, cuda_graphs=False, phases=tuple(graphs))
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before

    def rounded(nbytes: int) -> int:  # the caching allocator's block size
        return -(-nbytes // 512) * 512

    weight_bytes = sum(rounded(t.nbytes) for t in worker.weights.values())
    state_bytes = sum(rounded(t.nbytes) for inst in worker.state for t in inst.values())
    constants = sum(rounded(st.nbytes()) for _, _, _, ex, _, _ in worker.phases.values()
                    for n, st in ex._static.items() if n not in worker.weights)
    assert weight_bytes <= grown <= weight_bytes + state_bytes + constants
    for name, t in worker.weights.items():
        bound = {ex._static[name].data_ptr() for _, _, _, ex, _, _ in worker.phases.values() if name in ex._static}
        assert bound == {t.data_ptr()}, name


def test_two_cuda_workers_with_graphs_equal_one_eager_process(tiny):
    from tessera.runtime.distributed import DistributedRunner
    from tessera.runtime.executor import Executor
    from tessera.runtime.pool import WorkerPool

    graphs, weights = tiny
    graphs = {p: graphs[p] for p in ("prefill", "decode")}
    split = {p: [1 if k.layer == 1 else 0 for k in g.kernels] for p, g in graphs.items()}
    assert all(build_programs(g, split[p], [DEVICE, DEVICE]).transfers for p, g in graphs.items())
    ids = torch.randint(0, 64, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    ex = {p: Executor(g, single_device_program(g, DEVICE), weights, DEVICE) for p, g in graphs.items()}
    g = graphs["decode"]
    state = {s: torch.zeros(g.buffers[s].shape, dtype=dtype_from_name(g.buffers[s].dtype), device=DEVICE)
             for s in g.state}
    ref = [ex["prefill"].run({"input_ids": ids, "slots": torch.tensor([0])}, state)["logits"].cpu()]
    with WorkerPool.local(2, threads=1, devices=[DEVICE, DEVICE], cuda_graphs=True) as pool:
        runner = DistributedRunner(pool, graphs, split, {"prefill": 1, "decode": 1}, weights=weights)
        got = [runner.step("prefill", {"input_ids": ids, "slots": torch.tensor([0])})["logits"]]
        for i in range(STEPS):
            token = ref[-1][..., -1, :].argmax(-1).reshape(1, 1)
            inputs = {"input_ids": token, "positions": torch.tensor([PROMPT + i]), "slots": torch.tensor([0])}
            ref.append(ex["decode"].run(inputs, state)["logits"].cpu())
            got.append(runner.step("decode", inputs)["logits"])
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b)
