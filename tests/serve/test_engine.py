"""The serving engine and its monitor: plan switches under a load step, exact outputs across switches."""

from __future__ import annotations

import threading

import pytest
import torch

from tessera.sched.monitor import SWITCH_LOG, Monitor
from tessera.sched.scheduler import Request
from tessera.serve.backend import LocalBackend
from tessera.serve.config import ServeConfig
from tessera.serve.engine import GenerationParams, Histogram
from tessera.serve.launch import start_engine
from tests.serve.recording import RecordingBackend


def _request(arrival: float, busy: float, finish: float | None = None) -> Request:
    r = Request("r", arrival, 4, 4)
    r.busy_s, r.finish_s = busy, finish
    return r


def test_statistics_stay_bounded_however_long_the_server_runs():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0, 7.0):
        h.observe(v)
    assert h.counts == [2, 2, 2] and h.count == 6 and h.sum == pytest.approx(11.65)
    m = Monitor(window_s=0.1, cooldown_s=0.0, hysteresis=1.0)
    busy, idle = [_request(0.0, 0.1, 1.0)], [_request(0.0, 0.1, 0.1)]  # latency / execution: 10, then 1
    now = 0.0
    for i in range(2 * SWITCH_LOG + 10):
        now += 0.1
        assert m.close_window(now, [], [], busy if i % 2 == 0 else idle) is not None
    assert m.switch_count == 2 * SWITCH_LOG + 10 and len(m.switches) == SWITCH_LOG
    assert m.switches[-1].at_s == pytest.approx(now)


def test_monitor_switches_on_the_latency_ratio_with_a_cool_down():
    m = Monitor(beta=1.5, window_s=0.3, cooldown_s=1.0)
    assert m.objective == "latency" and not m.due(0.0) and m.due(0.3)
    assert m.close_window(0.3, [], [], []) is None  # nothing seen: no evidence
    assert m.close_window(0.6, [_request(0.0, 0.0)], [], []) is None  # nothing ran yet
    # one request waited 0.9 s and ran 0.3 s, one queued since 0.5 s: mean latency 0.6, execution 0.15
    switch = m.close_window(1.2, [_request(1.0, 0.0)], [_request(0.3, 0.3)], [])
    assert switch is not None and (switch.before, switch.after) == ("latency", "throughput")
    assert switch.ratio == pytest.approx((0.9 + 0.2) / 2 / 0.15)
    calm = [_request(1.5, 0.45, finish=2.0)]  # latency 0.5, execution 0.45
    assert m.close_window(1.8, [], [], calm) is None and m.objective == "throughput"  # cooling down
    banded = [_request(1.5, 0.5, finish=2.15)]  # latency 0.65, execution 0.5: 1.3, between 1.2 and 1.5
    assert m.close_window(2.3, [], [], banded) is None and m.objective == "throughput"  # hysteresis
    back = m.close_window(2.6, [], [], calm)
    assert back is not None and back.after == "latency" and len(m.switches) == 2
    with pytest.raises(ValueError, match="must be positive"):
        Monitor(beta=0)


def test_a_step_under_way_counts_as_execution():
    """A batch of prompts arriving together on the latency objective: 8 in one long first step since 0.0, 8
    queued. Before that step ends its time so far is evidence (mean latency 0.3, execution 0.15)."""
    m = Monitor(beta=1.5, window_s=0.3, cooldown_s=1.0)
    running = [_request(0.0, 0.0) for _ in range(8)]
    for r in running:
        r.in_step, r.step_since = True, 0.0
    switch = m.close_window(0.3, [_request(0.0, 0.0) for _ in range(8)], running, [])
    assert switch is not None and switch.after == "throughput" and switch.ratio == pytest.approx(2.0)
    for r in running:  # the step ended at 0.25: its time is in busy_s, and not counted twice
        r.in_step, r.busy_s = False, 0.25
    again = Monitor(beta=1.5, window_s=0.3, cooldown_s=1.0)
    assert again.close_window(0.3, [], running, []) is None and again.last_ratio == pytest.approx(0.3 / 0.25)


class _Recorder(RecordingBackend):
    """A backend that records every step's phase, inputs and outputs (tokens and logits)."""

    def __init__(self, backend):
        super().__init__(backend)
        self.steps: list[tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []

    def record(self, phase, inputs, outputs):
        self.steps.append((phase, {k: v.clone() for k, v in inputs.items()}, {k: v.clone() for k, v in outputs.items()}))


def _serve(engine, prompts: list[str], concurrent: bool, max_tokens: int = 6):
    done = threading.Event()
    finished: dict[int, str] = {}
    gens = []

    def sink_for(i):
        def sink(kind, payload):
            if kind in ("done", "error"):
                finished[i] = f"{kind}:{payload}"
                if len(finished) == len(prompts):
                    done.set()
                one.set()
        return sink

    one = threading.Event()
    for i, p in enumerate(prompts):
        one.clear()
        gens.append(engine.submit(engine.tokenizer(p).input_ids, GenerationParams(max_tokens=max_tokens), sink_for(i)))
        if not concurrent:
            assert one.wait(120)
    assert done.wait(300)
    assert all(v in ("done:length", "done:stop") for v in finished.values()), finished
    return gens


def test_plan_switches_under_a_load_step_and_outputs_stay_exact():
    """Low rate, high rate, low rate on cpu:2: the latency plan (every kernel on one worker, at most 2 requests
    in flight) and the throughput plan (layers split over both workers, 8 slots) differ; the monitor
    switches to throughput under load and back; throughput per step-second rises, steps hold more rows under load; and
    every step's logits equal a single-process replay of the same step."""
    cfg = ServeConfig("smollm2-135m", "cpu:2", slots=8, max_context=128, policy="layer-pipeline",
                      latency_policy="homogeneous", latency_rows=2, threads=1, window_s=0.1, cooldown_s=0.5)
    logs: list[str] = []
    engine, how = start_engine(cfg, log=logs.append)
    try:
        assert engine.placements.differ and "homogeneous" in how
        engine.backend = recorder = _Recorder(engine.backend)
        _serve(engine, [f"Count: {i}," for i in range(2)], concurrent=False)
        assert not engine.monitor.switches and engine.objective == "latency"
        _serve(engine, [f"Item {i} is" for i in range(12)], concurrent=True)
        _serve(engine, [f"Step {i}:" for i in range(4)], concurrent=False)
        switches = [(s.before, s.after) for s in engine.monitor.switches]
        assert switches[:2] == [("latency", "throughput"), ("throughput", "latency")]
        assert any("plan switch: latency -> throughput" in line for line in logs)
        assert engine.objective == "latency"
        stats = engine.stats
        rate = {o: stats.tokens_by[o] / stats.step_s[o] for o in ("latency", "throughput")}
        assert rate["throughput"] > rate["latency"]
        # under load the throughput plan's steps hold more rows than the latency cap: decode steps, and prefill
        # steps of batched prompts (the 12 requests arrive together)
        widths = {phase.split(":")[0]: len(inputs["slots"]) for phase, inputs, _ in recorder.steps}
        assert max(w for p, w in widths.items() if p.startswith("decode")) > cfg.latency_rows
        assert max(w for p, w in widths.items() if p.startswith("prefill")) > cfg.latency_rows
        from fastapi.testclient import TestClient

        from tessera.serve.api import create_app

        metrics = TestClient(create_app(engine, "smollm2-135m")).get("/metrics").text
        assert f"tessera_plan_switches_total {engine.monitor.switch_count}" in metrics
        assert 'tessera_active_plan{objective="latency"} 1' in metrics
        graphs = {name.split(":")[0]: g for name, g in recorder.backend.runner.graphs.items()}
        phases_run = {phase for phase, _, _ in recorder.steps}
        assert any(p.endswith(":latency") for p in phases_run) and any(p.endswith(":throughput") for p in phases_run)
    finally:
        engine.stop()
    from tessera.runtime.session import weight_files

    reference = LocalBackend(graphs, weight_files("smollm2-135m"))
    torch.set_num_threads(1)
    for phase, inputs, outputs in recorder.steps:  # the same steps in the same order, in one process
        expected = reference.run(phase, inputs)
        assert torch.equal(expected["logits"], outputs["logits"]), phase
        assert torch.equal(expected["tokens"], outputs["tokens"]), phase
