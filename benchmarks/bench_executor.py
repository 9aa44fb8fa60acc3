"""The executor's own cost per kernel: one process replaying smollm2-135m's served step graphs.

Usage: ``python benchmarks/bench_executor.py [--threads 1] [--repeats 20] [--graphs decode@32,prefill@8x64]
[--save FILE] [--check FILE]``.

Each graph is traced as `tessera serve` traces it (32 slots, context 512), loaded with the real weights, and
stepped ``--repeats`` times with `Executor.run` on fixed inputs (decode rows at position ``--position``, 63 by
default, of a cache filled by a prefill). Reported per graph: the step's wall time (min and median) and, from one step under cProfile, the
seconds in torch's C++ ops against Python (the executor's, tessera's kernel bodies', torch's around custom
ops), per kernel call. ``--save`` writes every step output; ``--check`` compares against such a file and
fails unless they are bit for bit equal (the same tokens and logits before and after an executor change).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import statistics
import time

import torch

from cprofile_parts import EXECUTOR, KERNEL_PYTHON, OTHER, TORCH_OPS, TORCH_PYTHON, profile_parts

MODEL, SLOTS, CTX, PROMPT = "smollm2-135m", 32, 512, 64


def graph_for(name: str):
    """The served bucket graph ``decode@R`` or ``prefill@RxS`` (traced on meta)."""
    from tessera.capture.api import trace_model

    phase, _, shape = name.partition("@")
    if phase == "decode":
        rows = int(shape)
        return trace_model(MODEL, "decode", batch=rows, ctx=CTX, slots=SLOTS if rows != SLOTS else None)
    rows, _, seq = shape.partition("x")
    return trace_model(MODEL, "prefill", batch=int(rows), seq=int(seq), ctx=CTX,
                       slots=SLOTS if int(rows) != SLOTS else None)


def inputs_for(graph, name: str, position: int = PROMPT - 1) -> dict[str, torch.Tensor]:
    """Fixed step inputs: token ids from a seeded generator, rows in slots 0.., decode at ``position``."""
    gen = torch.Generator().manual_seed(0)
    shape = graph.buffers["input_ids"].shape
    out = {"input_ids": torch.randint(100, 20000, shape, generator=gen), "slots": torch.arange(shape[0])}
    if name.startswith("decode"):
        out["positions"] = torch.full((shape[0],), position)
    return out


LABELS = {TORCH_OPS: "torch C++ ops", KERNEL_PYTHON: "tessera kernel bodies (Python)",
          TORCH_PYTHON: "torch Python (custom-op dispatch)", EXECUTOR: "executor Python", OTHER: "other"}


def split(profiler: cProfile.Profile) -> tuple[dict[str, float], int]:
    """Own seconds by part and the number of kernel calls, from one profiled step."""
    parts = profile_parts(pstats.Stats(profiler))
    return {LABELS[k]: v for k, v in parts.seconds.items()}, parts.kernel_calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--graphs", default="decode@32,prefill@8x64")
    ap.add_argument("--position", type=int, default=PROMPT - 1, help="decode rows' position (context - 1)")
    ap.add_argument("--save", default=None)
    ap.add_argument("--check", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tessera.program.program import single_device_program
    from tessera.runtime.executor import Executor
    from tessera.runtime.probe import zero_state
    from tessera.runtime.session import weight_files
    from tessera.weights import load_graph_weights

    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s); "
          f"{time.strftime('%Y-%m-%d %H:%M')}; load {os.getloadavg()[0]:.1f}")
    names = args.graphs.split(",")
    graphs = {n: graph_for(n) for n in ["prefill@8x64", *names] if n}
    weights: dict[str, torch.Tensor] = {}
    for g in graphs.values():
        weights.update(load_graph_weights(g, weight_files(MODEL), [n for n, b in g.buffers.items()
                                                                  if b.kind == "weight" and n not in weights]))
    state: dict[str, torch.Tensor] = {}
    for g in graphs.values():
        state.update(zero_state(g, [n for n in g.state if n not in state]))
    executors = {n: Executor(g, single_device_program(g), weights) for n, g in graphs.items()}
    executors["prefill@8x64"].run(inputs_for(graphs["prefill@8x64"], "prefill@8x64"), state)  # fill the cache
    results = {}
    for name in names:
        ex, inputs = executors[name], inputs_for(graphs[name], name, args.position)
        snapshot = {k: v.clone() for k, v in state.items()}
        times = []
        for _ in range(args.repeats):
            for k, v in snapshot.items():
                state[k].copy_(v)
            t0 = time.perf_counter()
            out = ex.run(inputs, state)
            times.append(time.perf_counter() - t0)
        results[name] = {k: v.clone() for k, v in out.items()}
        profiler = cProfile.Profile()
        profiler.enable()
        ex.run(inputs, state)
        profiler.disable()
        for k, v in snapshot.items():
            state[k].copy_(v)
        parts, calls = split(profiler)
        total = sum(parts.values())
        print(f"{name}: {len(graphs[name].kernels)} kernels, step min {min(times) * 1e3:.1f} ms, median "
              f"{statistics.median(times) * 1e3:.1f} ms ({args.repeats} steps); one step under cProfile "
              f"{total * 1e3:.1f} ms:")
        for what, s in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"  {what:<36} {s * 1e3:8.1f} ms {s / total:5.0%}  {s / max(calls, 1) * 1e6:7.1f} us per kernel")
    if args.save:
        torch.save(results, args.save)
    if args.check:
        want = torch.load(args.check)
        for name, outs in results.items():
            for k, v in outs.items():
                if not torch.equal(v, want[name][k]):
                    raise SystemExit(f"{name} output {k} differs from {args.check}")
        print(f"outputs bit for bit equal to {args.check}")


if __name__ == "__main__":
    main()
