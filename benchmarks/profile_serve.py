"""Where a `tessera serve` step's time goes: the serving engine in this process under a fixed workload (all
requests at once, as `tessera bench --workload fixed:...` sends them, without HTTP), profiled.

Per step kind (prefill / decode): steps, real rows and tokens against the bucket's (padding), the engine's
step wall time, the backend's share of it (the rest is the engine's own Python: building inputs, sampling
bookkeeping, detokenising, events) and, on workers, each worker's busy seconds. With ``--local`` the steps
run in this process and a cProfile of the engine thread splits the backend's time into kernels (torch ops,
`tessera::` custom ops included) and the executor's Python around them (binding views, outputs, freeing), per
kernel call; the decode attention's share is reported beside the context it reads (every slot position up
to ``--max-context``) against the contexts the requests really had (padding in context).

Usage: ``python benchmarks/profile_serve.py [--local] [--threads 2] [--cluster cpu:2] [--slots 8]
[--workload 64,32,32] [--top 25]``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import threading
import time

import numpy as np

from cprofile_parts import EXECUTOR, KERNEL_PYTHON, OTHER, TORCH_OPS, TORCH_PYTHON, profile_parts

MODEL = "smollm2-135m"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local", action="store_true", help="every step in this process (cProfile of the kernels)")
    ap.add_argument("--cluster", default="cpu:2")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--slots", type=int, default=None, help="default: tessera serve's")
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--workload", default="64,32,32", help="prompt tokens, output tokens, requests")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    n_in, n_out, n_req = (int(v) for v in args.workload.split(","))

    import torch

    from tessera.serve.config import ServeConfig
    from tessera.serve.engine import GenerationParams
    from tessera.serve.launch import start_engine

    kw = {} if args.slots is None else {"slots": args.slots}
    cfg = ServeConfig(MODEL, "cpu:1" if args.local else args.cluster, max_context=args.max_context,
                      local=args.local, threads=args.threads, **kw)
    if args.local and args.threads:
        torch.set_num_threads(args.threads)
    engine, how = start_engine(cfg)
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}; {MODEL} {'--local' if args.local else args.cluster}, "
          f"{cfg.slots} slots, context {cfg.max_context}, threads {args.threads or 'default'}: {how}")
    lanes = getattr(engine, "lanes", None)
    if lanes is None:
        engine.stop()  # its workers would outlive this process
        raise SystemExit("profile_serve.py profiles one engine (its lanes); request-dist replicas are engines of "
                         "their own: bench them with tessera bench")
    for name in sorted(engine.placements.placements):
        if name.split(":")[0] in ("prefill@64", "decode@8") or name.startswith(("prefill@8x64", "decode@32")):
            where = engine.placements.placements[name]
            print(f"placement {name}: " + ", ".join(f"worker {w}: {where.count(w)} kernels" for w in sorted(set(where))))
    word = engine.tokenizer(" the", add_special_tokens=False).input_ids[-1]
    steps: list[tuple] = []  # phase, requests, tokens, wall, backend seconds, busy seconds by device, rows, seq
    profiler = cProfile.Profile()
    profiling = threading.Event()
    start_step, end_step, backend_run = lanes.start, lanes.finish, engine.backend.run
    started: dict[int, tuple[float, dict, float]] = {}  # id(step) -> start time, busy then, backend seconds

    def timed_run(phase, inputs, owners=()):  # a local backend runs the step inside submit
        t0 = time.perf_counter()
        out = backend_run(phase, inputs, owners)
        timed_run.seconds = time.perf_counter() - t0
        return out

    def profiled_start(step):
        busy0, t0 = engine.backend.busy_s(), time.perf_counter()
        timed_run.seconds = None
        if profiling.is_set():
            profiler.enable()
        try:
            return start_step(step)
        finally:
            profiler.disable()
            started[id(step)] = (t0, busy0, timed_run.seconds)

    def profiled_end(step, handle, context):
        if profiling.is_set():
            profiler.enable()
        try:
            end_step(step, handle, context)
        finally:
            profiler.disable()
        t0, busy0, backend_s = started.pop(id(step))
        wall = time.perf_counter() - t0
        busy1 = engine.backend.busy_s()
        tokens = sum(r.context - 1 if step.phase == "prefill" else r.context for r in step.requests)
        if profiling.is_set():  # steps in flight on workers: their wall times overlap, the backend's is the wall
            steps.append((step.phase, len(step.requests), tokens, wall, wall if backend_s is None else backend_s,
                          {d: busy1[d] - busy0.get(d, 0.0) for d in busy1}, step.rows, step.seq))

    engine.backend.run = timed_run
    lanes.start, lanes.finish = profiled_start, profiled_end

    def serve(n: int, out: int) -> tuple[float, list[float]]:
        done = threading.Barrier(n + 1)
        firsts: dict[int, float] = {}
        t0 = time.perf_counter()

        def sink_for(i):
            def sink(kind, payload):
                if kind == "token" and i not in firsts:
                    firsts[i] = time.perf_counter() - t0
                if kind in ("done", "error"):
                    threading.Thread(target=done.wait, daemon=True).start()
            return sink

        for i in range(n):
            engine.submit([word] * n_in, GenerationParams(max_tokens=out), sink_for(i))
        done.wait(3600)
        return time.perf_counter() - t0, sorted(firsts.values())

    runner = getattr(engine.backend, "runner", None)
    try:
        serve(8, 16)  # warm-up (not recorded)
        moved = getattr(runner, "moved_bytes", 0)
        profiling.set()
        wall, ttft = serve(n_req, n_out)
        profiling.clear()
        moved = getattr(runner, "moved_bytes", 0) - moved
    finally:
        engine.stop()
    tokens = n_req * n_out
    print(f"workload {n_in} in, {n_out} out, {n_req} requests at once: {wall:.2f} s, {tokens / wall:.1f} tokens/s, "
          f"TTFT p50 {np.percentile(ttft, 50):.2f} s (engine-side, no HTTP)")
    stepped = sum(s[3] for s in steps)
    print(f"steps {len(steps)}: {stepped:.2f} s of the {wall:.2f} s (the rest: the engine waiting and its loop)")
    print(f"{'kind':<8} {'steps':>5} {'rows':>6} {'bucket rows':>11} {'tokens':>7} {'bucket tokens':>13} "
          f"{'wall s':>7} {'backend s':>9} {'engine s':>8} {'busy s per worker':>18}")
    for kind in ("prefill", "decode"):
        mine = [s for s in steps if s[0] == kind]
        if not mine:
            continue
        rows = sum(s[1] for s in mine)
        brows = sum(s[6] for s in mine)
        toks = sum(s[2] for s in mine)
        btoks = sum(s[6] * s[7] for s in mine) if kind == "prefill" else brows * cfg.max_context
        devices = sorted({d for s in mine for d in s[5]})
        busy = [sum(s[5].get(d, 0.0) for s in mine) for d in devices]
        print(f"{kind:<8} {len(mine):>5} {rows:>6} {brows:>11} {toks:>7} {btoks:>13} {sum(s[3] for s in mine):>7.2f} "
              f"{sum(s[4] for s in mine):>9.2f} {sum(s[3] - s[4] for s in mine):>8.2f} "
              f"{' / '.join(f'{d} {b:.2f}' for d, b in zip(devices, busy, strict=True)):>18}")
    print("(decode tokens: the contexts the rows read; bucket tokens: rows x the cache's positions every row reads)")
    order = [s[0] for s in steps]
    first = [s[3] for i, s in enumerate(steps) if s[0] == "decode" and (i == 0 or order[i - 1] == "prefill")]
    later = [s[3] for i, s in enumerate(steps) if s[0] == "decode" and i > 0 and order[i - 1] == "decode"]
    if first and later:
        print(f"decode steps right after a prefill: {len(first)}, mean {np.mean(first):.3f} s; the others: "
              f"{len(later)}, mean {np.mean(later):.3f} s; state moved between workers: {moved / 1e6:.0f} MB")
    if not args.local:
        return
    stats = pstats.Stats(profiler)
    found = profile_parts(stats)
    labels = {TORCH_OPS: "kernels (torch's C++ ops)", KERNEL_PYTHON: "tessera's kernels' Python (composing torch ops)",
              TORCH_PYTHON: "torch's Python around ops (custom-op dispatch)",
              EXECUTOR: "executor Python (views, outputs, frees)",
              OTHER: "engine and the rest (inputs, sampling, detokenising, events)"}
    parts = {labels[k]: v for k, v in found.seconds.items()}
    calls = found.kernel_calls
    total = sum(parts.values())
    print(f"cProfile of the engine thread, steps only (its own cost inflates the Python parts): {total:.2f} s")
    print(f"  Python function calls per kernel call: {stats.total_calls / max(calls, 1):.1f}")
    for what, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
        per = f", {seconds / calls * 1e6:.1f} us per kernel call" if calls else ""
        print(f"  {what}: {seconds:.2f} s ({seconds / total:.0%}{per})")
    print(f"  of the kernels, scaled_dot_product_attention (prefill and decode attention): {found.attention_s:.2f} s; "
          f"kernel calls: {calls}")
    print("top by own time:")
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
