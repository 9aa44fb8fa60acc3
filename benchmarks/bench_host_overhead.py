"""The host overhead model against steps run as a worker runs them, in one process: per step shape of
smollm2-135m (real weights, one thread), the executor's measured step beside the kernels' profiled sum
(what the simulator charged before) and the cost model's charge with this host's measured overhead (the
executor's dispatch per kernel, weights read from memory), and per op the measured and charged seconds.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_host_overhead.py [--passes 10] [--ops]

Steps run back to back with their profile in the same process (the probe's figures: this host's cached ones,
or measured now), so a load change between them moves both.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections import defaultdict

MODEL = "smollm2-135m"
SHAPES = (("decode", 1, None), ("decode", 4, None), ("decode", 8, None), ("prefill", 1, 64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--ops", action="store_true", help="per op: measured in the step, profiled, charged")
    args = ap.parse_args()

    import torch

    from tessera.capture.trace import trace
    from tessera.cost.model import CostModel
    from tessera.hardware.devices import resolve_device
    from tessera.program.program import single_device_program
    from tessera.runtime.executor import Executor
    from tessera.runtime.overhead_probe import gemm_weight_shapes, host_overhead
    from tessera.runtime.profiler import build_profile_step, profile_graph
    from tessera.runtime.step_excess_probe import timed_passes, with_step_excess
    from tessera.weights import unique_state

    torch.set_num_threads(1)
    cpu = resolve_device("cpu:1")
    print(f"# {MODEL}, 1 thread, {args.passes} passes a shape; load average {os.getloadavg()[0]:.2f}")
    rows = []
    for phase, batch, seq in SHAPES:
        step = build_profile_step(MODEL, phase, batch=batch, seq=seq, ctx=128, slots=8 if phase == "decode" else None)
        graph = trace(step)
        weights, _ = unique_state(step.modules)
        overhead = host_overhead(1, gemm_weight_shapes([graph]))
        prof = profile_graph(graph, weights, step.inputs, step.state, threads=1, warmup=3, repeats=args.passes)
        plain = CostModel(cpu, profile=prof).kernel_costs(graph)
        prof.overhead = overhead
        charged = CostModel(cpu, profile=prof).kernel_costs(graph)
        prof.overhead = with_step_excess(overhead, MODEL)  # a kernel's measured excess inside a real decode step
        in_step = CostModel(cpu, profile=prof).kernel_costs(graph)
        program = single_device_program(graph, "cpu")
        ex = Executor(graph, program, weights, torch.device("cpu"))
        state = {n: t.clone() for n, t in step.state.items()}
        per, passes = timed_passes(ex, program, step.inputs, state, args.passes)
        measured = statistics.median(passes)
        profiled, model = sum(c.time_s for c in plain), sum(c.time_s for c in charged)
        rows.append((f"{phase} {batch}x{seq or 1}", len(graph.kernels), measured, profiled, model, prof.overhead,
                     sum(c.time_s for c in in_step)))
        if args.ops:
            by_op: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
            for k in graph.kernels:
                r = by_op[k.op]
                r[0] += 1
                r[1] += statistics.median(per[k.index])
                r[2] += plain[k.index].time_s
                r[3] += charged[k.index].time_s
            print(f"\n{phase} {batch}x{seq or 1}: op, kernels, measured in the step, profiled, charged (ms)")
            for op, (n, m, p_, c) in sorted(by_op.items(), key=lambda kv: -kv[1][1]):
                print(f"  {op:40s} {n:4d} {m * 1e3:8.2f} {p_ * 1e3:8.2f} {c * 1e3:8.2f}")
    print(f"\nload average {os.getloadavg()[0]:.2f}; host overhead: {rows[-1][5].describe()}")
    print("| step | kernels | measured (ms) | profiled sum (ms) | error | charged with host overhead (ms) | error | "
          "and the in-step excess (ms) | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, k, m, p, c, _, e in rows:
        print(f"| {name} | {k} | {m * 1e3:.1f} | {p * 1e3:.1f} | {(p / m - 1):+.0%} | {c * 1e3:.1f} | {(c / m - 1):+.0%} | "
              f"{e * 1e3:.1f} | {(e / m - 1):+.0%} |")


if __name__ == "__main__":
    main()
