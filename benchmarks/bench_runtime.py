"""The distributed runtime on this host: its overhead on one worker, and pipelining efficiency on two.

Usage: python benchmarks/bench_runtime.py [--quick] [--out DIR] [--steps N] [--threads T]

smollm2-135m with its real weights, decode at batch 8 (cache 128, prompt 16: every row is prefilled first,
then decode steps feed the tokens an eager greedy run produced, at positions 16, 17, ...).

1. Overhead: one worker process (T threads, default all cores) running every kernel of the batch-8 decode
   graph, against plain eager PyTorch in the driver (T threads), steps interleaved eager / runtime so both
   see the same machine load; medians. "runtime" is the driver's wall time of runner.step (inputs out,
   logits back), "worker" the worker's own step time, "kernels" the time inside its kernel calls.
2. Pipelining on two workers (1 thread each) for a layer split, attention-ffn alternation and the planner's
   plan (policy tessera on cpu:2 with this host's measured kernel times), at M = 4 micro-batches (graphs
   traced at batch 2, 4 state instances) and M = 1 (the batch-8 graph: no pipelining).
3. A Gantt chart of one traced pipelined step (layer split, M = 4), from the workers' own timestamps.

Speed goals (checked here, never by tests): runtime overhead <= 15% over eager; pipelining efficiency
>= 85% for the layer split at M = 4.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

MODEL = "smollm2-135m"
BATCH, PROMPT, CTX = 8, 16, 128
OVERHEAD_GOAL, EFFICIENCY_GOAL = 0.15, 0.85
OVERHEAD_STEPS = 8  # at least this many interleaved steps in the overhead comparison


# ------------------------------------------------------------------------------------------------------------
# inputs shared by every run: the prompts and the decode tokens of an eager greedy run


@dataclass
class Workload:
    ids: torch.Tensor  # [B, PROMPT]
    tokens: list[torch.Tensor] = field(default_factory=list)  # decode step i feeds tokens[i] [B, 1]

    def prefill(self, micro_batches: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids, "slots": local_slots(micro_batches)}

    def decode(self, i: int, micro_batches: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "positions": torch.full((BATCH,), PROMPT + i),
                "slots": local_slots(micro_batches)}


def local_slots(micro_batches: int) -> torch.Tensor:
    """Row r lives in state instance r // (B / M), at slot r % (B / M) of it."""
    return torch.arange(BATCH) % (BATCH // micro_batches)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------------------------------------------
# 1. overhead


def greedy_tokens(work: Workload, n: int) -> None:
    """The decode tokens every run feeds: eager greedy decoding from the prompts (``n`` steps)."""
    from tessera.capture.eager import EagerRunner
    from tessera.capture.pretrained import load_pretrained

    spec, model, values = load_pretrained(MODEL)
    eager = EagerRunner(spec, model, values, slots=BATCH, ctx=CTX)
    first = eager("prefill", {"input_ids": work.ids, "slots": torch.arange(BATCH)})["tokens"]
    work.tokens = [first.reshape(BATCH, 1)]
    for i in range(n - 1):
        work.tokens.append(eager("decode", work.decode(i, 1))["tokens"].reshape(BATCH, 1))


def overhead(work: Workload, threads: int, warmup: int, steps: int, files: list[str]) -> tuple[float, float]:
    """Median eager and runtime (driver wall) decode step at ``threads`` threads; prints a table."""
    from tessera.capture.eager import EagerRunner
    from tessera.capture.pretrained import load_pretrained
    from tessera.runtime.distributed import DistributedRunner
    from tessera.runtime.pool import WorkerPool
    from tessera.runtime.session import runtime_graphs

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    spec, model, values = load_pretrained(MODEL)
    eager = EagerRunner(spec, model, values, slots=BATCH, ctx=CTX)
    eager("prefill", {"input_ids": work.ids, "slots": torch.arange(BATCH)})
    graphs = runtime_graphs(MODEL, PROMPT, CTX, batch=BATCH, micro_batches=1)
    rows: dict[str, list[float]] = {"eager": [], "runtime": [], "worker": [], "kernels": []}
    greedy_same = 0
    with WorkerPool.local(1, threads=threads) as pool:
        runner = DistributedRunner(pool, graphs, {ph: [0] * len(g.kernels) for ph, g in graphs.items()},
                                   {"prefill": 1, "decode": 1}, weights_path=files, state_instances=1)
        runner.step("prefill", work.prefill(1))
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            e = eager("decode", work.decode(i, 1))["logits"]
            e_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            r = runner.step("decode", work.decode(i, 1))["logits"]
            r_s = time.perf_counter() - t0
            greedy_same += bool(torch.equal(e.argmax(-1), r.argmax(-1)))
            if i >= warmup:
                rows["eager"].append(e_s)
                rows["runtime"].append(r_s)
                rows["worker"].append(runner.last_timing.worker_seconds[0])
                rows["kernels"].append(runner.last_timing.compute_s[0])
    torch.set_num_threads(before)
    e, r = median(rows["eager"]), median(rows["runtime"])
    w, k = median(rows["worker"]), median(rows["kernels"])
    print(f"\n{threads} thread{'s' if threads > 1 else ''} (eager in the driver, the runtime's one worker):")
    print(f"{'':28}{'median ms':>10}{'min ms':>9}{'vs eager':>10}")
    for name, label in (("eager", "eager"), ("runtime", "runtime: driver wall"),
                        ("worker", "runtime: worker step"), ("kernels", "runtime: inside kernels")):
        med = median(rows[name])
        print(f"{label:28}{med * 1e3:10.1f}{min(rows[name]) * 1e3:9.1f}{(med / e - 1) * 100:+9.1f}%")
    print(f"overhead (driver wall vs eager) {(r / e - 1) * 100:+.1f}%; of the runtime's step: driver and "
          f"messages {(r - w) * 1e3:.1f} ms, worker outside kernels {(w - k) * 1e3:.1f} ms, kernels "
          f"{(k - e) * 1e3:+.1f} ms vs eager's whole step; greedy tokens equal eager's on "
          f"{greedy_same}/{warmup + steps} steps")
    return e, r


# ------------------------------------------------------------------------------------------------------------
# 2. pipelining


def layer_split(graph) -> list[int]:
    """First half of the layers on device 0, the rest on 1; kernels outside layers go to 0 before the first
    layer and to 1 after the last."""
    layers = sorted({k.layer for k in graph.kernels if k.layer is not None})
    half = layers[len(layers) // 2]
    out, seen = [], False
    for k in graph.kernels:
        if k.layer is None:
            out.append(1 if seen else 0)
        else:
            seen = True
            out.append(0 if k.layer < half else 1)
    return _by_units(graph, out)


def attention_ffn(graph) -> list[int]:
    """Attention kernels on device 0, FFN kernels on 1; others (norms, residual adds, rotary tables, embedding,
    head) with the next attention/FFN kernel in program order (the last ones with the one before)."""
    from tessera.cost.features import block_of

    blocks = [block_of(k) for k in graph.kernels]
    dev = [0 if b == "attention" else 1 if b == "ffn" else None for b in blocks]
    nxt = None
    for i in range(len(dev) - 1, -1, -1):
        if dev[i] is None:
            dev[i] = nxt
        else:
            nxt = dev[i]
    prev = 0
    for i, d in enumerate(dev):
        dev[i] = prev if d is None else d
        prev = dev[i]
    return _by_units(graph, dev)


def _by_units(graph, placement: list[int]) -> list[int]:
    """Kernels that must share a device (state, indirect kernels) go with their unit's first kernel."""
    from tessera.graph.dataflow import colocation_units

    units = colocation_units(graph)
    first: dict[int, int] = {}
    for k, u in enumerate(units):
        first.setdefault(u, placement[k])
    return [first[u] for u in units]


@dataclass
class Run:
    """Decode steps of one runner: driver wall seconds, in-step kernel time per device, logits per step and
    (traced steps) the timelines per device."""

    seconds: list[float] = field(default_factory=list)
    busy: list[list[float]] = field(default_factory=list)  # per step, per device (0 where it has no work)
    logits: list[torch.Tensor] = field(default_factory=list)
    traced: list[tuple[float, list[list[tuple]]]] = field(default_factory=list)  # (seconds, timelines per device)

    def step(self, runner, inputs: dict[str, torch.Tensor], trace: bool, timed: bool) -> None:
        sp = runner.programs["decode"]
        t0 = time.perf_counter()
        self.logits.append(runner.step("decode", inputs, trace=trace)["logits"])
        seconds = time.perf_counter() - t0
        timing = runner.last_timing
        active = [d for d, p in enumerate(sp.programs) if p.instructions]  # the devices last_timing lists, in order
        if trace:
            timelines: list[list[tuple]] = [[] for _ in sp.programs]
            for d, tl in zip(active, timing.timelines, strict=True):
                timelines[d] = tl
            self.traced.append((seconds, timelines))
        if timed:
            self.seconds.append(seconds)
            busy = [0.0] * len(sp.programs)
            for d, c in zip(active, timing.compute_s, strict=True):
                busy[d] = c
            self.busy.append(busy)


def run_pair(one, runner, work: Workload, m: int, warmup: int, steps: int, traced: int) -> tuple[Run, Run]:
    """Prefill every row on both runners, then ``warmup + steps`` decode steps alternating a traced step of the
    one-worker runner ``one`` and a timed step of ``runner`` (so both see the same load on the host), then
    ``traced`` traced steps of ``runner``."""
    one.step("prefill", work.prefill(m))
    runner.step("prefill", work.prefill(m))
    ref, run = Run(), Run()
    for i in range(warmup + steps):
        ref.step(one, work.decode(i, m), trace=True, timed=i >= warmup)
        run.step(runner, work.decode(i, m), trace=False, timed=i >= warmup)
    for i in range(warmup + steps, warmup + steps + traced):
        run.step(runner, work.decode(i, m), trace=True, timed=False)
    ref.traced = ref.traced[warmup:]
    return ref, run


def streamed(runner, work: Workload, m: int, warmup: int, steps: int) -> tuple[float, list[float]]:
    """Seconds per decode step when the micro-batches are streamed through the pipeline step after step
    (``DistributedRunner.stream``: no fill and drain per step), after a fresh prefill and ``warmup`` steps;
    and each worker's seconds inside kernels per step meanwhile."""
    rows = BATCH // m

    def inputs(mb: int, i: int) -> dict[str, torch.Tensor]:
        return {k: v[mb * rows:(mb + 1) * rows] for k, v in work.decode(i, m).items()}

    runner.step("prefill", work.prefill(m))
    if warmup:
        runner.stream("decode", [inputs(mb, 0) for mb in range(m)], warmup, lambda mb, i, out: inputs(mb, i + 1))
        runner.step("prefill", work.prefill(m))
    t0 = time.perf_counter()
    runner.stream("decode", [inputs(mb, 0) for mb in range(m)], steps, lambda mb, i, out: inputs(mb, i + 1))
    return (time.perf_counter() - t0) / steps, [b / steps for b in runner.last_timing.compute_s]


def kernel_times(runs: list[Run]) -> dict[tuple[int, int], float]:
    """(kernel, micro-batch) -> median run time over the traced steps of one-worker runs."""
    per: dict[tuple[int, int], list[float]] = {}
    for run in runs:
        for _, timelines in run.traced:
            for tl in timelines:
                for kind, k, mb, start, end in tl:
                    if kind == "run":
                        per.setdefault((k, mb), []).append(end - start)
    return {key: median(v) for key, v in per.items()}


def schedule_bound(sp, alone: dict[tuple[int, int], float]) -> float:
    """The step time of the runtime's own instruction order with the standalone kernel times and free transfers
    (a send is posted when its kernel ends; a receive waits for it): what fill, drain and imbalance alone cost."""
    from tessera.sim.programs import simulate_programs

    return simulate_programs(sp, lambda d, k, m: alone[(k, m)]).makespan_s


def pipelining(work: Workload, warmup: int, steps: int, out_dir: Path, files: list[str]) -> None:
    from tessera.errors import TesseraError
    from tessera.report.gantt import gantt
    from tessera.runtime.distributed import DistributedRunner
    from tessera.runtime.pool import WorkerPool
    from tessera.runtime.session import host_profile, policy_placement, runtime_graphs

    print("\n## 2. Pipelining efficiency on two workers (1 thread each)\n")
    print(f"{MODEL} decode, {BATCH} rows per step, cache {CTX}; M micro-batches of {BATCH}/M rows (graphs traced "
          "at that batch, M state instances); M = 1 is the batch-8 graph, without pipelining.")
    print(f"- step ms: median driver wall time of a decode step ({steps} steps after {warmup} warm-up); "
          "rows/s = rows per step / step ms.")
    print("- alone ms: a device's standalone compute per step = the time of its kernels run alone: every kernel "
          "of the same graph on ONE worker of its own (1 thread, no transfers), traced, its steps alternating with "
          "the placement's (same host load), median per (kernel, micro-batch), summed over the kernels the "
          "placement gives the device.")
    print("- efficiency = rows/s / ideal rows/s, ideal = rows per step / max over devices of alone ms.")
    print("- schedule bound: the efficiency the runtime's instruction order allows with the standalone kernel "
          "times and free transfers (a step ends when the last device ends: pipeline fill and drain, imbalance).")
    print("- busy ms: each worker's time inside its kernels during the measured steps (median); above alone ms by "
          "the slowdown of two workers sharing the cores, caches and memory.")
    print("- exact: the logits of every step are torch.equal to the one-worker run's.")
    print("- streamed: the same decode steps with the micro-batches streamed through the pipeline "
          "(`DistributedRunner.stream`: micro-batch m's next step is queued as soon as its step is back, so a step "
          "no longer fills and drains the pipeline); ms per step, efficiency, and utilisation = the busiest "
          "worker's time inside its kernels / step time (what the schedule achieves, whatever the kernels' "
          "slowdown from sharing the host).\n")
    header = (f"{'placement':25}{'M':>2}{'xfers':>6}{'kB/step':>9}{'step ms':>9}{'rows/s':>8}"
              f"{'alone ms d0/d1':>16}{'ideal':>7}{'effic.':>8}{'sched.':>8}{'busy ms d0/d1':>15}{'exact':>6}"
              f"{'streamed ms':>12}{'effic.':>8}{'util.':>7}")
    print(header)
    print("-" * len(header))
    gantt_path = None
    results = []
    notes = []
    with WorkerPool.local(1, threads=1) as pool_one, WorkerPool.local(2, threads=1) as pool:
        for m in (4, 1):
            graphs = runtime_graphs(MODEL, PROMPT, CTX, batch=BATCH, micro_batches=m)
            mbs = {"prefill": 1, "decode": m}
            everything = {ph: [0] * len(g.kernels) for ph, g in graphs.items()}
            placements = {"layer split": {ph: layer_split(g) for ph, g in graphs.items()},
                          "attention-ffn": {ph: attention_ffn(g) for ph, g in graphs.items()}}
            t0 = time.perf_counter()
            try:
                profile = host_profile(MODEL, graphs, 1)
                plan = policy_placement(MODEL, graphs, 2, "tessera", CTX - PROMPT, profile=profile, batch=BATCH,
                                        micro_batches=m)
                placements["planner (tessera)"] = plan.placements
                notes.append(f"planner at M = {m}: {plan.how}; planned in {time.perf_counter() - t0:.1f} s "
                             "(host profile included)")
                if plan.micro_batches.get("decode", 1) != m:
                    notes.append(f"the planner chose decode M = {plan.micro_batches.get('decode')}; run at M = {m}")
            except TesseraError as e:
                notes.append(f"planner at M = {m}: no runnable plan: {e}")
            rows, refs = [], []
            for name, placement in placements.items():
                one = DistributedRunner(pool_one, graphs, everything, mbs, weights_path=files, state_instances=m)
                runner = DistributedRunner(pool, graphs, placement, mbs, weights_path=files, state_instances=m)
                sp = runner.programs["decode"]
                want_gantt = name == "layer split" and m == 4
                ref, run = run_pair(one, runner, work, m, warmup, steps, 3 if want_gantt else 0)
                refs.append(ref)
                alone = kernel_times([ref])
                step_s = median(run.seconds)
                dev_alone = [sum(t for (k, _), t in alone.items() if sp.placement[k] == d) for d in range(2)]
                bottleneck = max(dev_alone)
                eff = bottleneck / step_s
                bound = bottleneck / schedule_bound(sp, alone)
                busy = [median([b[d] for b in run.busy]) for d in range(2)]
                exact = all(torch.equal(a, b) for a, b in zip(run.logits[: len(ref.logits)], ref.logits, strict=True))
                stream_s, stream_busy = streamed(runner, work, m, warmup, steps) if m > 1 else (step_s, busy)
                rows.append(f"{name:25}{m:2d}{len(sp.transfers):6d}{sp.cut_bytes / 1e3:9.1f}{step_s * 1e3:9.1f}"
                            f"{BATCH / step_s:8.1f}{f'{dev_alone[0] * 1e3:.1f} / {dev_alone[1] * 1e3:.1f}':>16}"
                            f"{BATCH / bottleneck:7.1f}{eff:8.0%}{bound:8.0%}"
                            f"{f'{busy[0] * 1e3:.1f} / {busy[1] * 1e3:.1f}':>15}{'yes' if exact else 'NO':>6}"
                            f"{stream_s * 1e3:12.1f}{bottleneck / stream_s:8.0%}{max(stream_busy) / stream_s:7.0%}")
                results.append((name, m, eff, bound, BATCH / step_s, bottleneck / stream_s,
                                max(stream_busy) / stream_s))
                if eff > bound + 0.02:
                    notes.append(f"{name} at M = {m}: efficiency above its schedule bound: the standalone kernel "
                                 "times were disturbed (another process on the host); rerun")
                if min(dev_alone) == 0:
                    notes.append(f"{name} at M = {m} runs every kernel on one device")
                if want_gantt:
                    seconds, timelines = sorted(run.traced, key=lambda t: t[0])[len(run.traced) // 2]
                    gantt_path = gantt(timelines, sp.devices, out_dir / "gantt_layer_split_m4.png",
                                       f"{MODEL} decode, batch {BATCH} as M = 4 micro-batches of 2, layer split "
                                       f"over 2 workers (1 thread each): one traced step, {seconds * 1e3:.0f} ms "
                                       "driver wall")
            # the one-worker runs of every placement together: the reference row
            alone = kernel_times(refs)
            one_s = median([s for r in refs for s in r.seconds])
            total = sum(alone.values())
            results.append(("one worker", m, total / one_s, 1.0, BATCH / one_s, total / one_s, total / one_s))
            print(f"{'one worker (traced)':25}{m:2d}{0:6d}{0.0:9.1f}{one_s * 1e3:9.1f}{BATCH / one_s:8.1f}"
                  f"{f'{total * 1e3:.1f} / -':>16}{BATCH / total:7.1f}{total / one_s:8.0%}{'100%':>8}"
                  f"{f'{median([b[0] for r in refs for b in r.busy]) * 1e3:.1f} / -':>15}{'ref':>6}")
            for row in rows:
                print(row)
    for note in notes:
        print(f"  {note}")
    layer4 = next(r for r in results if r[0] == "layer split" and r[1] == 4)
    layer1 = next(r for r in results if r[0] == "layer split" and r[1] == 1)
    print(f"\nlayer split: efficiency {layer4[5]:.0%} with micro-batches streamed through the pipeline (M = 4; "
          f"goal >= {EFFICIENCY_GOAL:.0%}: {'met' if layer4[5] >= EFFICIENCY_GOAL else 'NOT met'}; the busiest worker "
          f"is inside its kernels {layer4[6]:.0%} of the time), {layer4[2]:.0%} "
          f"with pipelining inside each step (its schedule bound is {layer4[3]:.0%}: each step fills and drains the "
          f"pipeline), {layer1[2]:.0%} without (M = 1)")
    best = max(results, key=lambda r: r[4])
    one = {r[1]: r[4] for r in results if r[0] == "one worker"}
    print(f"highest throughput: {best[0]} at M = {best[1]}, {best[4]:.1f} rows/s; on one worker, 4 micro-batches of "
          f"{BATCH // 4} rows take {one[1] / one[4]:.1f}x the time of one batch-{BATCH} step (each reads all weights)")
    if gantt_path is not None:
        print("\n## 3. Gantt chart\n")
        print(f"{gantt_path}: one traced layer-split step at M = 4 (the median of 3 traced steps by driver wall "
              "time); each worker's times are relative to its own step start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps (a smoke run)")
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for the Gantt PNG (default out/)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per run (default 16; quick 4)")
    parser.add_argument("--threads", type=int, default=None, help="threads of the overhead comparison "
                        "(default: all cores)")
    args = parser.parse_args()
    from tessera.runtime.session import weight_files

    steps = args.steps or (4 if args.quick else 16)
    warmup = 1 if args.quick else 2
    threads = args.threads or os.cpu_count() or 1
    print(f"# bench_runtime: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f} at start")
    torch.manual_seed(0)
    work = Workload(torch.randint(0, 1000, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0)))
    files = weight_files(MODEL)
    t0 = time.perf_counter()
    torch.set_num_threads(threads)
    greedy_tokens(work, warmup + max(steps, OVERHEAD_STEPS) + 3)
    print("\n## 1. Runtime overhead: one worker vs eager PyTorch\n")
    print(f"{MODEL} decode, batch {BATCH}, cache {CTX}, prompt {PROMPT}; {max(steps, OVERHEAD_STEPS)} steps after "
          f"{warmup} warm-up, eager and runtime steps interleaved (both see the same machine load); the runtime "
          "prefills row by row and eager all rows at once, so their logits differ in the last bits")
    e, r = overhead(work, threads, warmup, max(steps, OVERHEAD_STEPS), files)
    print(f"=> overhead of the runtime at {threads} threads: {(r / e - 1) * 100:+.1f}% (goal <= {OVERHEAD_GOAL:.0%}: "
          f"{'met' if r / e - 1 <= OVERHEAD_GOAL else 'NOT met'})")
    if threads > 1:
        overhead(work, 1, warmup, max(steps, OVERHEAD_STEPS), files)
    pipelining(work, warmup, steps, args.out, files)
    print(f"\n(total {time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.2f} at the end)")


if __name__ == "__main__":
    main()
