"""Batched prompts (issue #32, point 3): prompts of different lengths that arrive together share one prefill
step (rows of a prompt bucket, the shorter ones padded) and give the same greedy tokens as each served alone,
in one process and on workers."""

from __future__ import annotations

import threading

import pytest
import torch

from tessera.serve.config import ServeConfig
from tessera.serve.engine import GenerationParams
from tessera.serve.launch import start_engine
from tests.serve.recording import RecordingBackend

MODEL = "smollm2-135m"
# 5, 14, 25 and 30 tokens: prompt buckets 16, 16, 32 and 32 alone; the last three share a step at 4 x 32
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there",
           "List of prime numbers: 2, 3, 5, 7, 11, 13,",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci("]
TOKENS = 8


class _Gated(RecordingBackend):
    """Records every prefill step's rows (phase, slots); while ``gate`` is closed the next step waits for it,
    so that requests submitted meanwhile queue together."""

    def __init__(self, backend):
        super().__init__(backend)
        self.prefills: list[tuple[str, list[int]]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def run(self, phase, inputs, owners=()):
        if self.gate is not None:
            self.entered.set()
            self.gate.wait(120)
        return super().run(phase, inputs, owners)

    def record(self, phase, inputs, outputs):
        if phase.startswith("prefill"):
            self.prefills.append((phase, inputs["slots"].tolist()))


def _start(**kw):
    cfg = ServeConfig(MODEL, slots=4, max_context=128, threads=1, window_s=3600.0, latency_rows=4, **kw)
    engine, _ = start_engine(cfg)
    engine.backend = _Gated(engine.backend)
    return engine


def _submit(engine, text: str, done: dict, i: int, all_done: threading.Event, n: int):
    def sink(kind, payload):
        if kind in ("done", "error"):
            done[i] = (kind, payload)
            if len(done) == n:
                all_done.set()

    return engine.submit(engine.tokenizer(text).input_ids, GenerationParams(max_tokens=TOKENS), sink)


def _alone(engine) -> list[list[int]]:
    out = []
    for text in PROMPTS:
        done: dict = {}
        finished = threading.Event()
        gen = _submit(engine, text, done, 0, finished, 1)
        assert finished.wait(120) and done[0] == ("done", "length"), done
        out.append(list(gen.tokens))
    return out


def _together(engine) -> list[list[int]]:
    """Every prompt at once: the first is prefilled alone while the others queue behind its step."""
    backend = engine.backend
    done: dict = {}
    finished = threading.Event()
    backend.gate, backend.entered = threading.Event(), threading.Event()
    first = _submit(engine, PROMPTS[0], done, 0, finished, len(PROMPTS))
    assert backend.entered.wait(60)
    rest = [_submit(engine, text, done, i, finished, len(PROMPTS)) for i, text in enumerate(PROMPTS) if i]
    backend.gate.set()
    backend.gate = None
    assert finished.wait(180) and set(done.values()) == {("done", "length")}, done
    return [list(g.tokens) for g in (first, *rest)]


@pytest.fixture(scope="module")
def local():
    threads = torch.get_num_threads()
    engine = _start(local=True)  # --threads 1 applies to this process, the one worker
    assert torch.get_num_threads() == 1
    yield engine
    engine.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def alone(local) -> list[list[int]]:
    """Each prompt served alone in one process: its greedy tokens."""
    return _alone(local)


def test_prompts_of_different_lengths_share_a_prefill_step_and_give_each_ones_tokens_alone(local, alone):
    lengths = [len(local.tokenizer(t).input_ids) for t in PROMPTS]
    assert lengths == [5, 14, 25, 30]
    assert all(len(t) == TOKENS for t in alone)
    before = (local.stats.prefill_steps, local.stats.prefilled)
    local.backend.prefills.clear()
    assert _together(local) == alone
    # two prefill steps: the first prompt alone, then the three others in one step of 4 rows (the last
    # request repeated in the padding row) at the longest one's bucket
    slots = [g for _, g in local.backend.prefills]
    assert [p for p, _ in local.backend.prefills] == ["prefill@16", "prefill@4x32"]
    assert len(set(slots[1][:3])) == 3 and slots[1][3] == slots[1][2] and slots[0][0] not in slots[1]
    assert (local.stats.prefill_steps - before[0], local.stats.prefilled - before[1]) == (2, 4)
    from fastapi.testclient import TestClient

    from tessera.serve.api import create_app

    metrics = TestClient(create_app(local, MODEL)).get("/metrics").text
    assert f"tessera_prefilled_requests_total {local.stats.prefilled}" in metrics
    assert f"tessera_prefill_steps_total {local.stats.prefill_steps}" in metrics


def test_batched_prompts_on_workers_give_the_same_tokens(alone):
    """The same on two worker processes (every other kernel on the other worker): the batched prefill
    graphs run distributed, and the tokens equal those of each prompt alone in one process."""
    engine = _start(cluster="cpu:2", placement="alternate")
    try:
        assert _together(engine) == alone
        assert [p for p, _ in engine.backend.prefills] == ["prefill@16", "prefill@4x32"]
    finally:
        engine.stop()
