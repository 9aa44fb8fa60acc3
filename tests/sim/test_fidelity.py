"""The simulator against the runtime on this host: a small pipelined decode (smollm2-135m, real weights, 2 of the
pool's workers, layer split, M = 2), its step latency and streamed throughput simulated from probes of the pool
(kernel times inside a step, the gloo link, per-message costs, the driver's round trip) within a loose bound of
what the runtime measures. benchmarks/bench_sim_fidelity.py measures more placements against the 15% goal."""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from tessera.graph.dataflow import colocation_units
from tessera.runtime.distributed import DistributedRunner
from tessera.runtime.probe import (
    measure_link,
    measure_messages,
    measure_program_times,
    measure_round_trip,
    measure_sends,
)
from tessera.runtime.session import runtime_graphs, synthetic, weight_files
from tessera.sim.pool_model import PoolModel
from tessera.sim.programs import MessageCosts

MODEL = "smollm2-135m"
BATCH, M, PROMPT, CTX = 2, 2, 6, 64
WARMUP, STEPS = 2, 6
BOUND = 0.40  # the benchmark's goal is 15%; this host is shared and noisy


def layer_split(graph) -> list[int]:
    """The first half of the layers (and what precedes them) on device 0, the rest on 1; kernels that must share
    a device follow their unit's first kernel."""
    layers = sorted({k.layer for k in graph.kernels if k.layer is not None})
    half = layers[len(layers) // 2]
    out, seen = [], False
    for k in graph.kernels:
        seen = seen or k.layer is not None
        out.append((0 if k.layer < half else 1) if k.layer is not None else int(seen))
    first: dict[int, int] = {}
    units = colocation_units(graph)
    for k, u in enumerate(units):
        first.setdefault(u, out[k])
    return [first[u] for u in units]


def _send_costs(pool, graphs, files):
    """Send calls in real steps of a random placement of the same graphs (messages both ways, many of them)."""
    runner = DistributedRunner(pool, graphs, synthetic(graphs, 2, "random", seed=0).placements,
                               {"prefill": 1, "decode": M}, weights_path=files, state_instances=M)
    sp = runner.programs["decode"]
    runner.step("prefill", {"input_ids": torch.randint(0, 1000, (BATCH, PROMPT), generator=torch.Generator()
                                                       .manual_seed(1)), "slots": torch.zeros(BATCH, dtype=torch.long)})
    runner.step("decode", _decode(PROMPT))
    sends = measure_sends(runner, "decode", [_decode(PROMPT + 1), _decode(PROMPT + 2)])
    assert sends.idle_count + sends.busy_count == 2 * len(sp.transfers)  # every send of both steps, classed once
    assert 0 < sends.idle_s < 0.05 and 0 < sends.busy_s < 0.05
    return sends


def _decode(position: int, rows: slice = slice(None)) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1000, (BATCH, 1), generator=torch.Generator().manual_seed(position))
    slots = torch.zeros(BATCH, dtype=torch.long)
    return {k: v[rows] for k, v in {"input_ids": ids, "positions": torch.full((BATCH,), position),
                                     "slots": slots}.items()}


def test_simulated_step_and_stream_are_close_to_the_runtime(pool):
    load = os.getloadavg()[0]
    if load >= (os.cpu_count() or 1):
        pytest.skip(f"the host is busy (load average {load:.1f} on {os.cpu_count()} cores): other processes' work "
                    "would be measured as the runtime's")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the driver computes nothing (conftest gives the test process 2 threads)
    try:
        _compare(pool)
    finally:
        torch.set_num_threads(before)


def _compare(pool) -> None:
    graphs = runtime_graphs(MODEL, PROMPT, CTX, BATCH, M)
    files = weight_files(MODEL)
    g = graphs["decode"]
    runner = DistributedRunner(pool, graphs, {ph: layer_split(gr) for ph, gr in graphs.items()},
                               {"prefill": 1, "decode": M}, weights_path=files, state_instances=M)
    sp = runner.programs["decode"]
    assert {d for d, p in enumerate(sp.programs) if p.instructions} == {0, 1} and sp.transfers

    # the runtime: mean step latency, then the streamed seconds per step in steady state
    runner.step("prefill", {"input_ids": torch.randint(0, 1000, (BATCH, PROMPT), generator=torch.Generator()
                                                       .manual_seed(0)), "slots": torch.zeros(BATCH, dtype=torch.long)})
    walls = []
    for i in range(WARMUP + STEPS):
        t0 = time.perf_counter()
        runner.step("decode", _decode(PROMPT + i))
        if i >= WARMUP:
            walls.append(time.perf_counter() - t0)
    done: dict[tuple[int, int], float] = {}
    first = PROMPT + WARMUP + STEPS

    def feed(m: int, i: int, out) -> dict[str, torch.Tensor]:
        done[(m, i)] = time.perf_counter()
        return _decode(first + i + 1, slice(m, m + 1))

    total = WARMUP + STEPS
    periods = []
    for _ in range(2):  # the faster of two streamed runs: a burst of other work on the host slows only one
        done.clear()
        runner.stream("decode", [_decode(first, slice(m, m + 1)) for m in range(M)], total + 1, feed)
        periods.append((max(done[(m, total - 1)] for m in range(M)) - max(done[(m, WARMUP)] for m in range(M))) /
                       (total - 1 - WARMUP))
    measured_period = min(periods)
    measured_step = statistics.fmean(walls)

    # the simulator, from probes of the pool
    link = measure_link(pool, 0, 1)
    msgs = measure_messages(pool, 0, 1)
    assert 0 < link.link.latency_s < 0.05 and link.link.bandwidth > 1e7
    assert 0 < msgs.send_s < 0.01 and 0 < msgs.post_s < 0.01 and 0 < msgs.recv_s < 0.01
    times = measure_program_times(pool, sp, g, files, [_decode(PROMPT, slice(m, m + 1)) for m in range(M)],
                                  workers=runner.members, passes=3, wake_pauses_s=(2e-4, 2e-3))
    assert sorted(k for t in times.alone for k in t) == sorted((k, m) for k in range(len(g.kernels)) for m in range(M))
    assert all(t > 0 for d in times.alone for t in d.values())
    assert all(0 <= a <= b for a, b in times.wake)  # per receiving device, never less for the longer pause
    sends = _send_costs(pool, graphs, files)
    holder = next(d for d, p in enumerate(sp.programs) if p.outputs)
    logits = g.buffers[g.outputs["logits"][0]].nbytes  # one micro-batch's
    rt_step = measure_round_trip(pool, [0, 1], logits, M, holder=holder)
    rt_job = measure_round_trip(pool, [holder], logits, 1)
    assert 0 < rt_job < 0.05
    model = PoolModel(times, link.link, MessageCosts(msgs.post_s, sends.idle_s, msgs.recv_s, sends.busy_s))
    sim_step, timeline = model.step(sp, rt_step)
    _, stream = model.stream(sp, total, rt_job)
    sim_period = (max(stream.done_s[(m, total - 1)] for m in range(M)) -
                  max(stream.done_s[(m, WARMUP)] for m in range(M))) / (total - 1 - WARMUP)
    print(f"step {measured_step * 1e3:.1f} ms, simulated {sim_step * 1e3:.1f}; streamed {measured_period * 1e3:.1f} ms "
          f"per step, simulated {sim_period * 1e3:.1f}")
    assert timeline.bottleneck_s <= sim_step
    assert sim_step == pytest.approx(measured_step, rel=BOUND), (sim_step, measured_step)
    assert sim_period == pytest.approx(measured_period, rel=BOUND), (sim_period, measured_period)
