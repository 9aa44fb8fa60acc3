"""The distributed runtime on a CUDA GPU: exactness of two GPU workers, and a heterogeneous GPU + CPU pair.

Usage: python benchmarks/gpu_runtime_check.py [--steps N] [--threads T] [--micro-batches M]

Needs a machine with a CUDA GPU and a CUDA build of torch (on a machine without one it stops at once with a
message and exit status 2). smollm2-135m with its real weights, batch 8 (cache 128, prompt 16), graphs traced at
batch 8 / M with M state instances (default M = 4: pipelined micro-batches), every row prefilled first, then
N decode steps feeding the reference's greedy tokens. The kernels are split by layers (first half of the layers
on worker 0, the rest on worker 1). It prints:

1. the reference: a single-process Executor on cuda:0 running the same graphs micro-batch by micro-batch;
2. two worker processes both on cuda:0 (transfers through gloo, staged in host memory): logits must be
   torch.equal to the reference at every step (same kernels on the same device);
3. the heterogeneous pair, worker 0 on cuda:0 and worker 1 on the host CPU (T threads): CPU and GPU kernels
   differ numerically, so it reports the largest absolute logit difference to the reference and whether the
   greedy tokens match, step by step;
4. step times (medians) of each, transfers and bytes per step.

Exit status: 0 when check 2 is exact, 1 otherwise. Takes well under 2 minutes on one H200.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

MODEL = "smollm2-135m"
BATCH, PROMPT, CTX = 8, 16, 128


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="decode steps (default 12)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: min(8, cores))")
    parser.add_argument("--micro-batches", type=int, default=4, choices=(1, 2, 4, 8), help="M (default 4)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"gpu_runtime_check: needs a CUDA GPU, and torch {torch.__version__} sees none "
              f"(torch.cuda.is_available() is False{'; this torch is a CPU-only build' if torch.version.cuda is None else ''})."
              " Run it on a machine with an NVIDIA GPU and a CUDA build of torch.", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_runtime import layer_split
    from tessera.program.program import single_device_program
    from tessera.runtime.distributed import DistributedRunner
    from tessera.runtime.executor import Executor
    from tessera.runtime.pool import WorkerPool
    from tessera.runtime.session import runtime_graphs, weight_files
    from tessera.weights import load_weights

    t_start = time.perf_counter()
    m, steps = args.micro_batches, args.steps
    threads = args.threads or min(8, os.cpu_count() or 1)
    per = BATCH // m
    gpu = torch.cuda.get_device_name(0)
    print(f"# gpu_runtime_check: {gpu}, torch {torch.__version__} (CUDA {torch.version.cuda}), {os.cpu_count()} cores; "
          f"{MODEL} decode batch {BATCH} as M = {m} micro-batches of {per}, cache {CTX}, prompt {PROMPT}, "
          f"{steps} decode steps; CPU worker threads {threads}")
    graphs = runtime_graphs(MODEL, PROMPT, CTX, batch=BATCH, micro_batches=m)
    files = weight_files(MODEL)
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_weights(f))
    ids = torch.randint(0, 1000, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    slots = torch.arange(BATCH) % per

    # ---- 1. the reference: one process, the Executor on cuda:0, micro-batch by micro-batch ----
    dev = torch.device("cuda:0")
    ex = {ph: Executor(g, single_device_program(g, "cuda:0"), weights, dev) for ph, g in graphs.items()}
    g0 = graphs["decode"]
    from tessera.graph.codec import dtype_from_name

    state = [{s: torch.zeros(g0.buffers[s].shape, dtype=dtype_from_name(g0.buffers[s].dtype), device=dev)
              for s in g0.state} for _ in range(m)]
    logits = []
    for r in range(BATCH):
        out = ex["prefill"].run({"input_ids": ids[r: r + 1], "slots": slots[r: r + 1]}, state[r // per])
        logits.append(out["logits"].cpu().clone())
    tokens = [torch.cat(logits).argmax(-1).reshape(BATCH, 1)]
    ref_logits, ref_s = [], []

    def decode_inputs(i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": tokens[i], "positions": torch.full((BATCH,), PROMPT + i), "slots": slots}

    for i in range(steps):
        inputs = decode_inputs(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = []
        for c in range(m):
            rows = slice(c * per, (c + 1) * per)
            outs.append(ex["decode"].run({n: t[rows] for n, t in inputs.items()}, state[c])["logits"])
        step_logits = torch.cat(outs).cpu()
        ref_s.append(time.perf_counter() - t0)
        ref_logits.append(step_logits)
        tokens.append(step_logits.argmax(-1).reshape(BATCH, 1))
    del ex, state
    torch.cuda.empty_cache()
    print(f"\n1. reference (single process, Executor on cuda:0): median decode step {_ms(ref_s)}")

    # ---- 2 and 3: worker pairs under the layer split ----
    placements = {ph: layer_split(g) for ph, g in graphs.items()}
    results = {}
    for name, devices in (("2 workers on cuda:0", ["cuda:0", "cuda:0"]), ("cuda:0 + cpu", ["cuda:0", "cpu"])):
        t0 = time.perf_counter()
        with WorkerPool.local(2, threads=threads, devices=devices) as pool:
            runner = DistributedRunner(pool, graphs, placements, {"prefill": 1, "decode": m}, weights_path=files,
                                       state_instances=m)
            setup_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            runner.step("prefill", {"input_ids": ids, "slots": slots})
            prefill_s = time.perf_counter() - t1
            got, secs, worker_s, busy = [], [], [], []
            for i in range(steps):
                t1 = time.perf_counter()
                got.append(runner.step("decode", decode_inputs(i))["logits"])
                secs.append(time.perf_counter() - t1)
                worker_s.append(runner.last_timing.worker_seconds)
                busy.append(runner.last_timing.compute_s)
            sp = runner.programs["decode"]
        print(f"\n{'2' if name.startswith('2') else '3'}. {name} ({pool.devices[0]} | {pool.devices[1]}), layer "
              f"split: {len(sp.transfers)} transfers, {sp.cut_bytes / 1e3:.1f} kB per decode step; setup "
              f"{setup_s:.1f} s, prefill of {BATCH} rows {prefill_s:.2f} s")
        print(f"   median decode step {_ms(secs)} (driver wall; reference {_ms(ref_s)}); worker step "
              f"{' / '.join(_ms([w[d] for w in worker_s]) for d in range(len(worker_s[0])))}; inside kernels "
              f"{' / '.join(_ms([b[d] for b in busy]) for d in range(len(busy[0])))} (kernel time is measured "
              "without synchronising the GPU: launches only)")
        diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref_logits, strict=True)]
        equal = [torch.equal(a, b) for a, b in zip(got, ref_logits, strict=True)]
        greedy = [torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(got, ref_logits, strict=True)]
        print(f"   vs reference: logits torch.equal on {sum(equal)}/{steps} steps; max |logit difference| per step "
              f"{', '.join(f'{d:.3g}' for d in diffs)}; greedy tokens match on {sum(greedy)}/{steps} steps "
              f"({sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(got, ref_logits, strict=True))}"
              f"/{steps * BATCH} rows)")
        results[name] = (all(equal), max(diffs), sum(greedy))
    exact, _, _ = results["2 workers on cuda:0"]
    _, hetero_diff, hetero_greedy = results["cuda:0 + cpu"]
    print(f"\nsummary: two cuda:0 workers {'EXACT' if exact else 'NOT exact'} vs the single-process Executor; "
          f"cuda:0 + cpu: max |logit difference| {hetero_diff:.3g}, greedy tokens match on {hetero_greedy}/{steps} "
          f"steps; total {time.perf_counter() - t_start:.0f} s")
    return 0 if exact else 1


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} ms"


if __name__ == "__main__":
    sys.exit(main())
