"""Batch invariance (issue #20): with ``batch_invariant`` a request's tokens and logits do not depend on the
requests batched with it; padding rows work however many requests are in flight; the row-by-row GEMMs
equal torch's closely and are exactly row-independent."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F

from tessera.kernels import invariant
from tessera.serve.config import ServeConfig
from tessera.serve.engine import GenerationParams
from tessera.serve.launch import start_engine
from tests.serve.recording import RecordingBackend

MODEL = "smollm2-135m"
PROMPTS = [f"{n}, {n}, {n}, {n}," for n in (100, 113, 126, 139)]
TOKENS = 6


def test_invariant_gemms_match_torch_and_are_row_independent():
    torch.manual_seed(0)
    x = torch.randn(8, 576, dtype=torch.bfloat16)
    w = [torch.randn(n, 576, dtype=torch.bfloat16) for n in (576, 192, 192)]
    b = [torch.randn(n, dtype=torch.bfloat16) for n in (576, 192, 192)]
    perm = torch.randperm(8)
    cases = [  # (invariant function, its torch reference)
        (lambda t: invariant.mm(t, w[0].T), lambda t: torch.mm(t, w[0].T)),
        (lambda t: invariant.addmm(b[0], t, w[0].T), lambda t: torch.addmm(b[0], t, w[0].T)),
        (lambda t: invariant.linear(t, w[1], b[1]), lambda t: F.linear(t, w[1], b[1])),
        (lambda t: invariant.merged_linear(t[:, None], w, b)[:, 0],
         lambda t: torch.cat([F.linear(t, wi, bi) for wi, bi in zip(w, b, strict=True)], -1)),
        (lambda t: invariant.merged_linear(t, w, []), lambda t: torch.cat([F.linear(t, wi) for wi in w], -1)),
    ]
    for fn, ref in cases:
        full = fn(x)
        torch.testing.assert_close(full.float(), ref(x).float(), rtol=2e-2, atol=0.25)
        assert full.dtype == torch.bfloat16 and full.is_contiguous()
        alone = torch.cat([fn(x[i:i + 1]) for i in range(8)])
        assert torch.equal(full, alone)  # every row is its one-row result, bit for bit
        assert torch.equal(fn(x[perm]), full[perm])  # wherever it sits in the batch
        assert torch.equal(fn(x[:5]), full[:5])  # whatever the batch size
    per_row_bias = torch.randn(8, 576, dtype=torch.bfloat16)
    got = invariant.addmm(per_row_bias, x, w[0].T, beta=0.5, alpha=2.0)
    torch.testing.assert_close(got.float(), torch.addmm(per_row_bias, x, w[0].T, beta=0.5, alpha=2.0).float(),
                               rtol=2e-2, atol=0.5)
    assert invariant.invariant_op("aten.mm.default") is invariant.mm
    assert invariant.invariant_op("tessera.rms_norm.default") is None


def test_invariant_decode_attention_gives_each_row_its_result_alone():
    import tessera.kernels  # noqa: F401  (registers the ops)

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, ctx, d = 9, 3, 512, 64  # smollm2-135m's attention
    q = torch.randn(4, heads, 1, d, generator=g).bfloat16()
    kc, vc = (torch.randn(6, kv_heads, ctx, d, generator=g).bfloat16() for _ in range(2))
    slots, positions = torch.tensor([4, 0, 5, 2]), torch.tensor([3, 300, 70, 511])
    args = (kc, vc, slots, positions, d ** -0.5, 0, None)
    alone = torch.cat([torch.ops.tessera.decode_attention(q[i:i + 1], kc, vc, slots[i:i + 1], positions[i:i + 1],
                                                          d ** -0.5, 0, None) for i in range(4)])
    batched = torch.ops.tessera.decode_attention(q, *args)
    assert not torch.equal(batched, alone)  # the op reads every row's keys up to the furthest row's position
    torch.testing.assert_close(batched.float(), alone.float(), rtol=2e-2, atol=1e-2)
    assert torch.equal(invariant.decode_attention(q, *args), alone)
    assert invariant.invariant_op("tessera.decode_attention.default") is invariant.decode_attention


class _Recorder(RecordingBackend):
    """Keeps every decode step's rows: (slot, position) -> logits."""

    def __init__(self, backend):
        super().__init__(backend)
        self.rows, self.widths = {}, []

    def record(self, phase, inputs, outputs):
        if phase.startswith("decode"):
            self.widths.append(len(inputs["slots"]))
            for r, (s, p) in enumerate(zip(inputs["slots"].tolist(), inputs["positions"].tolist(), strict=True)):
                self.rows.setdefault((s, p), []).append(outputs["logits"][r].clone())


@pytest.fixture(scope="module")
def engine():
    """One process, 4 slots, GEMMs row by row; the monitor never closes a window (the tests set the
    objective); the latency objective's cap (3) is not a row bucket (1, 2, 4), so its steps are padded."""
    cfg = ServeConfig(MODEL, "cpu:1", slots=4, max_context=32, local=True, batch_invariant=True, latency_rows=3,
                      threads=1, window_s=3600.0)
    threads = torch.get_num_threads()
    engine, how = start_engine(cfg)
    assert "batch-invariant" in how
    engine.backend = _Recorder(engine.backend)
    yield engine
    engine.stop()
    torch.set_num_threads(threads)


def _submit(engine, text: str, events: list):
    done = threading.Event()

    def sink(kind, payload):
        if kind in ("done", "error"):
            events.append((kind, payload))
            done.set()

    return engine.submit(engine.tokenizer(text).input_ids, GenerationParams(max_tokens=TOKENS), sink), done


def _logits(engine, gen) -> list[torch.Tensor]:
    """The logits of each of ``gen``'s decode steps (the latest step at each of its slot's positions)."""
    rows = engine.backend.rows
    return [rows[(gen.sched.slot, gen.sched.input - 1 + k)][-1] for k in range(len(gen.tokens))]


@pytest.fixture(scope="module")
def alone(engine) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Each prompt served alone: its tokens and the logits of each of its decode steps."""
    engine.monitor.objective = "throughput"
    out = []
    for text in PROMPTS:
        events: list = []
        gen, done = _submit(engine, text, events)
        assert done.wait(120) and events == [("done", "length")], events
        out.append((list(gen.tokens), _logits(engine, gen)))
    return out


def test_batched_outputs_equal_each_alone_with_batch_invariant(engine, alone):
    engine.monitor.objective = "throughput"  # every slot
    engine.backend.widths.clear()
    events: list = []
    together = [_submit(engine, text, events) for text in PROMPTS]
    assert all(done.wait(120) for _, done in together) and events == [("done", "length")] * 4, events
    assert max(engine.backend.widths) == 4  # the requests really shared steps
    for (gen, _), (tokens, logits) in zip(together, alone, strict=True):
        assert gen.tokens == tokens
        for got, want in zip(_logits(engine, gen), logits, strict=True):
            assert torch.equal(got, want)


def test_padding_rows_work_with_more_requests_in_flight_than_spare_slots(engine, alone):
    """4 requests decoding in 4 slots, then the latency objective (3 rows a step, bucket 4): every step has a
    padding row and no spare slot; they used to raise IndexError (padding rows took a spare slot each)."""
    engine.monitor.objective = "throughput"
    events: list = []
    together = [_submit(engine, text, events) for text in PROMPTS]
    deadline = time.monotonic() + 60
    while not all(g.tokens for g, _ in together):  # all 4 are decoding
        assert time.monotonic() < deadline and not events, events
        time.sleep(0.005)
    engine.backend.widths.clear()
    engine.monitor.objective = "latency"
    assert all(done.wait(120) for _, done in together)
    assert events == [("done", "length")] * 4, events
    assert engine.error is None
    assert 4 in engine.backend.widths  # padded steps ran (3 requests + 1 padding row)
    assert [g.tokens for g, _ in together] == [tokens for tokens, _ in alone]  # and wrote nothing a request reads


def test_workers_load_batch_invariant_executors(engine):
    """`Load(batch_invariant=True)` (what `DistributedRunner` sends) gives the worker executors that run the
    GEMMs row by row: a decode step there equals the engine's own batch-invariant replay bit for bit."""
    from tessera.program.program import single_device_program
    from tessera.runtime.commands import Load, PhaseLoad
    from tessera.runtime.session import weight_files
    from tessera.runtime.worker import Worker, WorkerConfig

    runner = engine.backend.backend.runner
    graph = runner.executors["decode@4"].graph
    worker = Worker(WorkerConfig(0, "127.0.0.1", 0, 1), store=None)
    worker.load(Load({"decode@4": PhaseLoad(graph, single_device_program(graph), [])}, weight_files(MODEL), None, 1,
                     batch_invariant=True))
    ex = worker.phases["decode@4"][3]
    assert ex.batch_invariant
    inputs = {"input_ids": torch.tensor([[11], [12], [13], [14]]), "positions": torch.tensor([3, 5, 7, 9]),
              "slots": torch.arange(4)}
    state = {k: v.clone() for k, v in runner.state.items()}
    got = ex.run(inputs, {k: v.clone() for k, v in state.items()})["logits"]
    want = runner.executors["decode@4"].run(inputs, state)["logits"]
    assert torch.equal(got, want)
    assert ex._calls[next(i for i, k in enumerate(graph.kernels) if k.op == "aten.mm.default")].func is invariant.mm
