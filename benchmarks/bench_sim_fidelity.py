"""Simulator fidelity on this host's CPU cluster: simulated vs measured decode step latency and throughput.

Usage: python benchmarks/bench_sim_fidelity.py [--quick] [--steps N] [--batches 4,8]

smollm2-135m with its real weights on cpu:2 (two worker processes, 1 thread each), decode at batch B (cache
128, prompt 16), for several placements (one worker; the planner's layer-pipeline and attention-ffn plans; the
synthetic alternate placement) and micro-batch counts M. For each case the runtime measures

- step latency: the mean driver wall time of ``DistributedRunner.step`` (B rows, M micro-batches), after
  warm-up steps;
- throughput: B / the steady-state seconds per step of ``DistributedRunner.stream`` (micro-batch m's next step
  queued as soon as its step is back), from the completion times of the first and last timed streamed steps;

and the simulator (:mod:`tessera.sim.programs`) predicts both from the same programs (same graph, placement
and M): ``simulate_programs`` (one step, plus the driver's round trip) and ``simulate_stream`` (its period).
Its inputs are probes of the pool (:mod:`tessera.runtime.probe`), never timings of the case itself:

- kernel times: each device's program of the case run on its worker without its messages, kernels timed as
  the executor runs them in a step, alone and with the other device's program running at the same time
  (before and after the case's runtime steps, averaged); the printed breakdown shows how in-step kernel times
  differ from the host profile's (each kernel repeated on warm caches), which the planner uses;
- wake costs: the same programs alone with a sleep of 0.2 ms and of 2 ms at each receive: a worker that
  waited for a message resumes slower, and the extra kernel time per receive is charged to the first kernel
  after each simulated wait (interpolated by the wait's length);
- the link: gloo ping-pong between the two workers (latency per message, bandwidth);
- per-message CPU time: posting a receive and taking an arrived message (bursts both ways); a send call as
  real steps pay it (``measure_sends``: traced steps of a calibration placement that is none of the measured
  cases), while every other worker waits for a message and while another works (then gloo's I/O thread,
  which the sender waits for, has to wait for one of the host's cores too);
- the driver's round trip: a command to the workers and replies carrying the step's outputs (``step``), or
  one micro-batch's outputs (``stream``'s feedback).

Goal: simulated within 15% of measured (mean absolute error over the cases); the test
tests/sim/test_fidelity.py enforces a looser bound (40%) on one small case.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

MODEL = "smollm2-135m"
PROMPT, CTX = 16, 128
GOAL = 0.15
WAKE_PAUSES_S = (2e-4, 2e-3)  # the wake probe sleeps this long at each receive (a message's flight; longer)
CALIBRATION_BATCH = 2  # the send probe's case: a random placement at this batch, M = 2 (no measured case)
CALIBRATION = f"random placement, B = {CALIBRATION_BATCH}, M = 2"
# (label, how, M): a planner policy, a synthetic placement or one worker
CASES = (("one worker", "one", 1), ("layer-pipeline", "layer-pipeline", 1), ("layer-pipeline", "layer-pipeline", 2),
         ("attention-ffn", "attention-ffn", 2), ("alternate", "alternate", 2))


def local_slots(batch: int, m: int) -> torch.Tensor:
    """Row r lives in state instance r // (B / M), at slot r % (B / M) of it."""
    return torch.arange(batch) % (batch // m)


def decode_inputs(batch: int, m: int, position: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1000, (batch, 1), generator=torch.Generator().manual_seed(position))
    return {"input_ids": ids, "positions": torch.full((batch,), position), "slots": local_slots(batch, m)}


def output_bytes(graph, name: str) -> int:
    """Bytes of one micro-batch's step output ``name``."""
    from tessera.graph.codec import dtype_from_name
    from tessera.graph.ir import TensorRef

    ref = TensorRef.from_json(graph.outputs[name])
    return math.prod(ref.sizes) * dtype_from_name(ref.dtype).itemsize


@dataclass
class Measured:
    step_s: float  # mean driver wall of runner.step
    step_spread: float  # (max - min) / mean over the timed steps
    period_s: float  # streamed seconds per step (steady state)
    busy_s: list[float]  # per device, kernel seconds per step (runner.step, mean)


def measure(runner, batch: int, m: int, warmup: int, steps: int) -> Measured:
    """Prefill every row, ``warmup`` + ``steps`` decode steps (the last ``steps`` timed), then a stream of
    ``warmup`` + ``steps`` steps per micro-batch timed from the completion of its first step to its last."""
    ids = torch.randint(0, 1000, (batch, PROMPT), generator=torch.Generator().manual_seed(0))
    runner.step("prefill", {"input_ids": ids, "slots": local_slots(batch, m)})
    sp = runner.programs["decode"]
    active = [d for d, p in enumerate(sp.programs) if p.instructions]
    pos = PROMPT
    walls, busy = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        runner.step("decode", decode_inputs(batch, m, pos))
        wall = time.perf_counter() - t0
        pos += 1
        if i >= warmup:
            walls.append(wall)
            per = [0.0] * len(sp.programs)
            for d, c in zip(active, runner.last_timing.compute_s, strict=True):
                per[d] = c
            busy.append(per)
    rows = batch // m
    done: dict[tuple[int, int], float] = {}
    first = pos
    total = warmup + steps

    def inputs(mb: int, i: int) -> dict[str, torch.Tensor]:
        return {k: v[mb * rows:(mb + 1) * rows] for k, v in decode_inputs(batch, m, first + i).items()}

    def feed(mb: int, i: int, out) -> dict[str, torch.Tensor]:
        done[(mb, i)] = time.perf_counter()
        return inputs(mb, i + 1)

    # one step more than timed: feed is called when a step is back and another follows
    runner.stream("decode", [inputs(mb, 0) for mb in range(m)], total + 1, feed)
    start = max(done[(mb, warmup)] for mb in range(m))
    end = max(done[(mb, total - 1)] for mb in range(m))
    mean = statistics.fmean(walls)
    return Measured(mean, (max(walls) - min(walls)) / mean, (end - start) / (total - 1 - warmup),
                    [statistics.fmean(b[d] for b in busy) for d in range(len(sp.programs))])


@dataclass
class Case:
    batch: int
    label: str
    m: int
    transfers: int
    kb: float
    measured: Measured
    sim_step_s: float
    sim_period_s: float
    sim_busy_s: list[float]
    profile_step_s: float  # the same simulation with the host profile's kernel times (no contention)
    profile_period_s: float
    round_trip_s: tuple[float, float]  # step, streamed job


def err(sim: float, meas: float) -> float:
    return sim / meas - 1


def kernel_table(graph, alone: list[float], together: list[float], planned: list[float]) -> None:
    """Per op: the planner's kernel times (host profile), in-step alone and with the other worker computing."""
    rows: dict[str, list[float]] = {}
    for k, p, a, t in zip(graph.kernels, planned, alone, together, strict=True):
        r = rows.setdefault(k.op.removeprefix("aten.").removesuffix(".default"), [0, 0.0, 0.0, 0.0])
        r[0] += 1
        r[1] += p
        r[2] += a
        r[3] += t
    top = sorted(rows.items(), key=lambda kv: -kv[1][2])
    shown, rest = top[:4], top[4:]
    if rest:
        shown.append((f"{len(rest)} other ops", [sum(r[1][i] for r in rest) for i in range(4)]))
    shown.append(("step", [sum(r[1][i] for r in top) for i in range(4)]))
    print(f"  {'op':28}{'kernels':>8}{'profile ms':>12}{'in step ms':>12}{'both ms':>10}{'step/prof':>11}"
          f"{'us/kernel':>11}")
    for name, (n, p, a, t) in shown:
        print(f"  {name:28}{int(n):8d}{p * 1e3:12.2f}{a * 1e3:12.2f}{t * 1e3:10.2f}{a / p:10.2f}x"
              f"{(a - p) / n * 1e6:+10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and cases (a smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per case (default 10; quick 4)")
    parser.add_argument("--batches", default=None, help="batch sizes, comma-separated (default 4,8; quick 8)")
    args = parser.parse_args()

    from tessera.cost.model import CostModel
    from tessera.hardware.host import host_spec
    from tessera.runtime.distributed import DistributedRunner
    from tessera.runtime.pool import WorkerPool
    from tessera.runtime.probe import (
        ProgramTimes,
        measure_kernel_times,
        measure_link,
        measure_messages,
        measure_program_times,
        measure_round_trip,
    )
    from tessera.runtime.session import (
        host_profile,
        policy_placement,
        runtime_graphs,
        synthetic,
        weight_files,
    )
    from tessera.sim.pool_model import PoolModel
    from tessera.sim.programs import MessageCosts

    steps = args.steps or (4 if args.quick else 10)
    warmup = 2
    batches = [int(b) for b in (args.batches or ("8" if args.quick else "4,8")).split(",")]
    cases = CASES[2:4] if args.quick else CASES
    # the driver computes nothing; at 2 OpenMP threads each of its output copies wakes a second thread (ms here)
    torch.set_num_threads(1)
    print(f"# bench_sim_fidelity: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f} at start")
    print(f"\n{MODEL} decode (real weights), cache {CTX}, prompt {PROMPT}, on cpu:2 (2 workers, 1 thread each); "
          f"{steps} timed steps after {warmup} warm-up per case\n")
    files = weight_files(MODEL)
    t_start = time.perf_counter()
    results: list[Case] = []
    with WorkerPool.local(2, threads=1) as pool:
        link = measure_link(pool)
        msgs = measure_messages(pool)
        sends = calibrate_sends(pool, files, steps=2 if args.quick else 3)
        costs = MessageCosts(msgs.post_s, sends.idle_s, msgs.recv_s, send_busy_s=sends.busy_s)
        print(f"link cpu:0 -> cpu:1 (gloo ping-pong, one way): {link.describe()}")
        print(f"per-message CPU time (bursts): {msgs.describe()}")
        print(f"send calls in steps of the calibration placement ({CALIBRATION}): {sends.describe()}")
        shown: set[str] = set()
        for batch in batches:
            for label, how, m in cases:
                graphs = runtime_graphs(MODEL, PROMPT, CTX, batch=batch, micro_batches=m)
                g = graphs["decode"]
                rows = batch // m
                profile = host_profile(MODEL, graphs, 1)
                if g.hash not in shown and m == 1:
                    shown.add(g.hash)
                    probe_in = decode_inputs(batch, m, PROMPT)
                    alone, both = (measure_kernel_times(pool, ws, g, files, probe_in) for ws in ([0], [0, 1]))
                    print(f"\nkernel times of the decode graph at {rows} rows (1 thread): the host profile (each "
                          "kernel repeated on warm caches) vs inside whole steps on one worker alone and on both "
                          "workers at once (median per kernel; us/kernel: in step - profile):")
                    planned = [c.time_s for c in CostModel(host_spec(1), profile=profile).kernel_costs(g)]
                    kernel_table(g, alone[0], [statistics.median(c) for c in zip(*both, strict=True)], planned)
                if how == "one":
                    placements = {ph: [0] * len(gr.kernels) for ph, gr in graphs.items()}
                elif how in ("alternate", "random"):
                    placements = synthetic(graphs, 2, how).placements
                else:
                    placements = policy_placement(MODEL, graphs, 2, how, CTX - PROMPT, profile=profile, batch=batch,
                                                  micro_batches=m).placements
                runner = DistributedRunner(pool, graphs, placements, {"prefill": 1, "decode": m},
                                           weights_path=files, state_instances=m)
                sp = runner.programs["decode"]
                # the simulator's inputs for these programs: kernel times inside steps, measured before and
                # after the runtime's steps (this host's speed drifts by several percent within a minute) ...
                step_in = decode_inputs(batch, m, PROMPT)
                mb_in = [{k: v[mb * rows:(mb + 1) * rows] for k, v in step_in.items()} for mb in range(m)]
                before = measure_program_times(pool, sp, g, files, mb_in, workers=runner.members,
                                               wake_pauses_s=WAKE_PAUSES_S)
                meas = measure(runner, batch, m, warmup, steps)
                after = measure_program_times(pool, sp, g, files, mb_in, workers=runner.members,
                                               wake_pauses_s=WAKE_PAUSES_S)
                times = ProgramTimes.mean([before, after])
                # ... and the driver's round trips (a step: every used worker, M outputs from their holder; a
                # streamed job: one micro-batch's outputs)
                used = sorted({d for d, p in enumerate(sp.programs) if p.instructions})
                holder = next(d for d, p in enumerate(sp.programs) if p.outputs)
                out_bytes = sum(output_bytes(g, n) for n in sp.programs[holder].outputs)
                rt_step = measure_round_trip(pool, [runner.members[d] for d in used], out_bytes, m,
                                             holder=runner.members[holder])
                rt_job = measure_round_trip(pool, [runner.members[holder]], out_bytes, 1)
                model = PoolModel(times, link.link, costs)
                sim_step, timeline = model.step(sp, rt_step)
                total = warmup + steps
                _, stream = model.stream(sp, total, rt_job)
                sim_period = stream_period(stream, warmup, total)
                planned = [c.time_s for c in CostModel(host_spec(1), profile=profile).kernel_costs(g)]
                prof = [{key: planned[key[0]] for key in t} for t in times.alone]
                plain = PoolModel(ProgramTimes(prof, prof), link.link, costs, iterations=1)
                prof_step, _ = plain.step(sp, rt_step)
                _, prof_stream = plain.stream(sp, total, rt_job)
                case = Case(batch, label, m, len(sp.transfers), sp.cut_bytes / 1e3, meas, sim_step, sim_period,
                            timeline.busy_s, prof_step, stream_period(prof_stream, warmup, total), (rt_step, rt_job))
                results.append(case)
                print(f"B={batch} {label} M={m}: step {meas.step_s * 1e3:.1f} ms (sim {sim_step * 1e3:.1f}), "
                      f"stream {meas.period_s * 1e3:.1f} ms/step (sim {sim_period * 1e3:.1f})", flush=True)
    report(results)
    load = os.getloadavg()[0]
    print(f"\n(total {time.perf_counter() - t_start:.0f} s; load average {load:.2f} at the end)")
    if load > (os.cpu_count() or 1) + 0.5:
        print("WARNING: other processes used this host's cores during the run (the benchmark itself keeps a load "
              "of about 2): the measured times include their work; rerun on a quiet host")


def calibrate_sends(pool, files, steps: int):
    """Send costs measured in real steps of a calibration case that is none of the measured ones (a random
    placement of the decode graph at another batch size), after two untimed steps."""
    from tessera.runtime.distributed import DistributedRunner
    from tessera.runtime.probe import measure_sends
    from tessera.runtime.session import runtime_graphs, synthetic

    batch, m = CALIBRATION_BATCH, 2
    graphs = runtime_graphs(MODEL, PROMPT, CTX, batch=batch, micro_batches=m)
    runner = DistributedRunner(pool, graphs, synthetic(graphs, 2, "random", seed=0).placements,
                               {"prefill": 1, "decode": m}, weights_path=files, state_instances=m)
    ids = torch.randint(0, 1000, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    runner.step("prefill", {"input_ids": ids, "slots": local_slots(batch, m)})
    for i in range(2):
        runner.step("decode", decode_inputs(batch, m, PROMPT + i))
    return measure_sends(runner, "decode", [decode_inputs(batch, m, PROMPT + 2 + i) for i in range(steps)])


def stream_period(timeline, warmup: int, total: int) -> float:
    """Seconds per step between the completions of step ``warmup`` and step ``total - 1`` (as measured)."""
    m = timeline.micro_batches
    start = max(timeline.done_s[(mb, warmup)] for mb in range(m))
    end = max(timeline.done_s[(mb, total - 1)] for mb in range(m))
    return (end - start) / (total - 1 - warmup)


def report(results: list[Case]) -> None:
    print("\n## Measured vs simulated\n")
    print("step ms: mean driver wall time of DistributedRunner.step (measured) / simulate_programs + the driver's "
          "round trip (sim); rows/s: B / seconds per step of DistributedRunner.stream in steady state (measured) / "
          "simulate_stream (sim); err = sim / measured - 1; 'profile' columns: the same simulations with the kernel "
          "times the planner uses (the host profile's median where it has the kernel, else the cost model's "
          "roofline) instead of in-step ones (no contention).\n")
    header = (f"{'B':>2} {'placement':16}{'M':>2}{'xfers':>6}{'kB':>8}{'step ms':>9}{'sim':>8}{'err':>7}"
              f"{'rows/s':>8}{'sim':>8}{'err':>7}{'busy ms (meas/sim)':>24}{'spread':>8}"
              f"{'profile: step err':>19}{'rows/s err':>11}")
    print(header)
    print("-" * len(header))
    errors, prof_errors = [], []
    for c in results:
        meas = c.measured
        e_step, e_thr = err(c.sim_step_s, meas.step_s), err(meas.period_s, c.sim_period_s)
        p_step, p_thr = err(c.profile_step_s, meas.step_s), err(meas.period_s, c.profile_period_s)
        errors += [e_step, e_thr]
        prof_errors += [p_step, p_thr]
        busy = " | ".join("/".join(f"{b * 1e3:.0f}" for b in bs) for bs in (meas.busy_s, c.sim_busy_s))
        print(f"{c.batch:2d} {c.label:16}{c.m:2d}{c.transfers:6d}{c.kb:8.1f}{meas.step_s * 1e3:9.1f}"
              f"{c.sim_step_s * 1e3:8.1f}{e_step:+7.0%}{c.batch / meas.period_s:8.1f}{c.batch / c.sim_period_s:8.1f}"
              f"{e_thr:+7.0%}{busy:>24}{meas.step_spread:8.0%}{p_step:+19.0%}{p_thr:+11.0%}")
    few = [i for i, c in enumerate(results) if c.transfers < 10]
    if few and len(few) < len(results):
        sub = [abs(errors[2 * i + j]) for i in few for j in (0, 1)]
        many = [abs(errors[2 * i + j]) for i in range(len(results)) if i not in few for j in (0, 1)]
        print(f"\nby messages per step: placements with under 10 transfers per step "
              f"{statistics.fmean(sub):.1%} mean absolute error, the others {statistics.fmean(many):.1%}")
    mae = statistics.fmean(abs(e) for e in errors)
    step_mae = statistics.fmean(abs(e) for e in errors[0::2])
    thr_mae = statistics.fmean(abs(e) for e in errors[1::2])
    prof_mae = statistics.fmean(abs(e) for e in prof_errors)
    worst = max(abs(e) for e in errors)
    print(f"\nmean absolute error: step latency {step_mae:.1%}, throughput {thr_mae:.1%}, both {mae:.1%} (worst "
          f"{worst:.0%}); goal <= {GOAL:.0%}: {'met' if mae <= GOAL else 'NOT met'}. With the host profile's kernel "
          f"times: {prof_mae:.1%}")


if __name__ == "__main__":
    main()
