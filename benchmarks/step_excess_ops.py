"""Per op of smollm2-135m's decode step run as a worker runs it (one thread, in one process): each kernel's
median time in the step against its profile taken in the same process and the executor's dispatch (the host
overhead probe's, from the tiny step), grouped by op, class and whether a GEMM ran just before it; then the same
step with an 8 MB cache flush before each kernel that reads no weight matrix. `runtime.step_excess_probe`
charges (`HostOverhead.in_step_s`) the same comparison's median over those kernels.

    PYTHONPATH=src .venv/bin/python benchmarks/step_excess_ops.py [--rows 4] [--passes 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

WEIGHT_CLASSES = ("gemm", "gemv")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--passes", type=int, default=10)
    args = ap.parse_args()
    import torch

    from tessera.capture.trace import trace
    from tessera.cost.features import cost_class
    from tessera.program.program import single_device_program
    from tessera.runtime.executor import Executor
    from tessera.runtime.overhead_probe import gemm_weight_shapes, host_overhead
    from tessera.runtime.profiler import build_profile_step, profile_graph
    from tessera.weights import unique_state

    torch.set_num_threads(1)
    print(f"# load average {os.getloadavg()[0]:.2f}")
    step = build_profile_step("smollm2-135m", "decode", batch=args.rows, ctx=128, slots=max(8, args.rows))
    graph = trace(step)
    weights, _ = unique_state(step.modules)
    overhead = host_overhead(1, gemm_weight_shapes([graph]))
    profiled = {t.index: t.median_s for t in profile_graph(graph, weights, step.inputs, step.state, threads=1,
                                                           warmup=3, repeats=args.passes).kernels}
    program = single_device_program(graph, "cpu")
    ex = Executor(graph, program, weights, torch.device("cpu"))
    state = {n: t.clone() for n, t in step.state.items()}
    flush = torch.empty(8 * 2**20 // 4, dtype=torch.float32)
    classes = {k.index: cost_class(k) for k in graph.kernels}

    def run(flushed: bool) -> dict[int, list[float]]:
        per: dict[int, list[float]] = defaultdict(list)
        with torch.no_grad():
            for p in range(args.passes + 2):
                ex.prepare(step.inputs, state)
                for ins in program.instructions:
                    if ins.kind == "run":
                        if flushed and classes[ins.kernel] not in WEIGHT_CLASSES:
                            flush.add_(1.0)
                        t0 = time.perf_counter()
                        ex.run_kernel(ins.kernel)
                        if p >= 2:
                            per[ins.kernel].append(time.perf_counter() - t0)
                    elif ins.kind == "free":
                        ex.free(ins.buffer)
                ex.release()
        return {k: statistics.median(v) for k, v in per.items()}

    in_step, flushed = run(False), run(True)
    order = [ins.kernel for ins in program.instructions if ins.kind == "run"]
    after_gemm = {k: i > 0 and classes[order[i - 1]] in WEIGHT_CLASSES for i, k in enumerate(order)}
    print(f"{len(order)} kernels: in the step {sum(in_step.values()) * 1e3:.1f} ms, profiled "
          f"{sum(profiled.values()) * 1e3:.1f} ms; dispatch {overhead.dispatch_s * 1e6:.1f} us a kernel")
    groups: dict[tuple, list[int]] = defaultdict(list)
    for k in order:
        groups[(graph.kernels[k].op, classes[k], after_gemm[k])].append(k)
    print("| op | class | after a GEMM | kernels | in the step (us) | profiled (us) | over profile + dispatch (us) |")
    print("|---|---|---|---|---|---|---|")
    for (op, cls, after), ks in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        over = statistics.median(in_step[k] - profiled[k] - overhead.dispatch_s for k in ks)
        print(f"| {op} | {cls} | {'yes' if after else 'no'} | {len(ks)} | "
              f"{statistics.median(in_step[k] for k in ks) * 1e6:.1f} | "
              f"{statistics.median(profiled[k] for k in ks) * 1e6:.1f} | {over * 1e6:.1f} |")
    light = [k for k in order if classes[k] not in WEIGHT_CLASSES]
    print(f"{len(light)} kernels reading no weight matrix: in the step {sum(in_step[k] for k in light) * 1e3:.2f} ms, "
          f"after an 8 MB flush each {sum(flushed[k] for k in light) * 1e3:.2f} ms, profiled + dispatch "
          f"{sum(profiled[k] + overhead.dispatch_s for k in light) * 1e3:.2f} ms; median over profile "
          f"{statistics.median(in_step[k] - profiled[k] for k in light) * 1e6:.1f} us")
    print(f"# load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
