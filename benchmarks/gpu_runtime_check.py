"""The runtime's worker on a CUDA GPU: one weight copy, CUDA graphs against eager, pinned transfers, and the
exactness of two GPU workers and a heterogeneous GPU + CPU pair.

Usage: python benchmarks/gpu_runtime_check.py [--steps N] [--threads T] [--micro-batches M] [--phases P]

smollm2-135m with its real weights, batch 8 (cache 128, prompt 16). It prints:

1. weight copies per worker across P phases (prefill and decode at batch 8, 4, 2, 1, ...: serve's buckets): a
   worker loads them all; every phase's executor must bind the worker's one copy of each weight (distinct
   storages counted), and on CUDA the allocated memory must grow by one copy's bytes, not P;
2. CUDA graph replay against eager: two in-process workers on cuda:0, graphs on and off, prefill every row
   then N decode steps fed the eager worker's greedy tokens: the largest absolute logit difference, steps
   torch.equal, greedy tokens matching; segments captured at load, replays, the kernels left eager and why;
3. the median decode step with and without graphs (wall inside the worker, and busy time from CUDA events);
4. transfer staging: a device -> host -> device round trip of 64 KiB, 1 MiB and 16 MiB through pinned buffers
   with non-blocking copies on a side stream, against pageable synchronous copies;
5. the distributed runtime, kernels split by layers over two worker processes: a single-process Executor on
   cuda:0 as the reference, two workers both on cuda:0 (transfers through gloo, staged in pinned host memory;
   CUDA graphs on) whose logits must be torch.equal to it, and the pair cuda:0 + the host CPU (T threads), which
   differs numerically (largest logit difference, greedy agreement), with step times, transfers and bytes.

Without CUDA it runs what the host can (1; 2 and 3 as the eager worker on the CPU with the segments a GPU
would capture; 4 and 5 are skipped with a message) and exits 0 when one weight copy is bound. With CUDA the
exit status is 0 when one copy is bound, graph replay equals eager within float tolerance with the same greedy
tokens, and check 5's two cuda:0 workers are torch.equal to the reference; 1 otherwise. Written to take about
two minutes on one H200 (run it through benchmarks/gpu_all.sh, which bounds it).
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
SIZES = (64 << 10, 1 << 20, 16 << 20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="decode steps (default 12 on CUDA, 1 on the CPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: min(8, cores))")
    parser.add_argument("--micro-batches", type=int, default=4, choices=(1, 2, 4, 8), help="M of check 5 (default 4)")
    parser.add_argument("--phases", type=int, default=5, help="phases loaded by one worker in check 1 (default 5)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if args.phases < 2:
        parser.error("--phases must be at least 2 (prefill and one decode bucket)")
    steps = args.steps if args.steps is not None else 12 if cuda else 1
    threads = args.threads or min(8, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tessera.runtime.session import weight_files

    t_start = time.perf_counter()
    device = "cuda:0" if cuda else "cpu"
    where = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda})" if cuda else
             f"no CUDA (torch {torch.__version__}{', a CPU-only build' if torch.version.cuda is None else ''}): "
             "the checks the host can run, on the CPU")
    print(f"# gpu_runtime_check: {where}, {os.cpu_count()} cores, {threads} threads; {MODEL} decode batch {BATCH}, "
          f"cache {CTX}, prompt {PROMPT}, {steps} decode step(s)")
    files = weight_files(MODEL)
    t0 = time.perf_counter()
    graphs = _graphs(args.phases)
    print(f"(traced {len(graphs)} phases in {time.perf_counter() - t0:.1f} s)")
    one_copy, eager = weight_copies(device, graphs, files)
    graphs_ok = graphs_vs_eager(device, graphs, files, steps, eager)
    del eager
    staging(device)
    exact = distributed(files, steps, threads, args.micro_batches) if cuda else True
    if not cuda:
        print("\n5. two workers on cuda:0, cuda:0 + cpu: skipped (no CUDA)")
    ok = one_copy and graphs_ok and exact
    print(f"\nsummary: {'one weight copy' if one_copy else 'SEVERAL weight copies'} per worker across "
          f"{args.phases} phases; " + (f"graph replay {'equals' if graphs_ok else 'DIFFERS from'} eager; two cuda:0 "
                                       f"workers {'EXACT' if exact else 'NOT exact'} vs the single-process Executor; "
                                       if cuda else "CUDA checks skipped; ")
          + f"total {time.perf_counter() - t_start:.0f} s")
    return 0 if ok else 1


def _graphs(phases: int) -> dict:
    """``phases`` graphs over one state of 8 slots: the prefill of one row, then decode at batch 8, 4, 2, 1, 3, 5,
    6, 7 (serve's buckets are such a set)."""
    from tessera.capture.api import trace_model

    out = {"prefill": trace_model(MODEL, "prefill", batch=1, seq=PROMPT, ctx=CTX, slots=BATCH)}
    batches = [8, 4, 2, 1, 3, 5, 6, 7]
    for b in batches[: phases - 1]:
        out[f"decode@{b}"] = trace_model(MODEL, "decode", batch=b, ctx=CTX, slots=BATCH)
    return out


def _worker(device: str, graphs: dict, files: list[str], cuda_graphs: bool):
    from tessera.program.program import single_device_program
    from tessera.runtime import commands as c
    from tessera.runtime.worker import Worker, WorkerConfig

    worker = Worker(WorkerConfig(0, "127.0.0.1", 0, torch.get_num_threads(), device=device, cuda_graphs=cuda_graphs),
                    store=None)
    t0 = time.perf_counter()
    worker.load(c.Load({p: c.PhaseLoad(g, single_device_program(g, device), []) for p, g in graphs.items()}, files,
                       None, 1))
    return worker, time.perf_counter() - t0


def weight_copies(device: str, graphs: dict, files: list[str]):
    """Check 1; whether every phase binds the worker's one copy of each weight, and the worker (no graphs)."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    worker, load_s = _worker(device, graphs, files, cuda_graphs=False)
    grown = torch.cuda.memory_allocated() - before if cuda else None
    weight_bytes = sum(t.nbytes for t in worker.weights.values())
    copies = {}
    for name, t in worker.weights.items():
        bound = {ph[3]._static[name].data_ptr() for ph in worker.phases.values() if name in ph[3]._static}
        copies[name] = len(bound | {t.data_ptr()})
    storages = len({ph[3]._static[n].data_ptr() for ph in worker.phases.values() for n in worker.weights
                    if n in ph[3]._static})
    one = all(n == 1 for n in copies.values()) and storages == len(worker.weights)
    print(f"\n1. weight copies: one worker on {device} loaded {len(graphs)} phases ({', '.join(graphs)}) in "
          f"{load_s:.1f} s: {len(worker.weights)} weights, {weight_bytes / 1e6:.1f} MB; "
          f"distinct weight storages bound by the phases' executors {storages} (one copy: {len(worker.weights)}); "
          f"weights bound more than once: {sum(n > 1 for n in copies.values())}")
    if cuda:
        state_bytes = sum(t.nbytes for inst in worker.state for t in inst.values())
        print(f"   CUDA memory grew {grown / 1e6:.1f} MB on load = {grown / weight_bytes:.2f} x the weights "
              f"(state {state_bytes / 1e6:.1f} MB and constants included; a copy per phase would be "
              f"{len(graphs)} x)")
        one = one and grown < 1.5 * weight_bytes + state_bytes
    else:
        print("   CUDA memory growth: skipped (no CUDA; on the host .to('cpu') never copies, so the count above is "
              "what shows)")
    return one, worker


def _run(worker, ids: torch.Tensor | None, steps: int, feed: list[torch.Tensor]):
    """Prefill every row of ``ids`` into its slot (None: none, the cache stays zero), then ``steps`` decode steps
    fed ``feed`` (the greedy tokens past its end)."""
    from tessera.runtime import commands as c

    for r in range(BATCH if ids is not None else 0):
        worker.step(c.Step("prefill", [{"input_ids": ids[r: r + 1], "slots": torch.tensor([r])}], [0]))
    logits, tokens, wall, busy = [], [], [], []
    token = feed[0]
    for i in range(steps):
        inputs = {"input_ids": token, "positions": torch.full((BATCH,), PROMPT + i), "slots": torch.arange(BATCH)}
        result = worker.step(c.Step(f"decode@{BATCH}", [inputs], [0]))
        out = result.outputs[0]["logits"].reshape(BATCH, -1)
        logits.append(out)
        tokens.append(out.argmax(-1).reshape(BATCH, 1))
        wall.append(result.seconds)
        busy.append(result.compute_s)
        token = feed[i + 1] if i + 1 < len(feed) else tokens[-1]
    return logits, tokens, wall, busy


def graphs_vs_eager(device: str, graphs: dict, files: list[str], steps: int, eager) -> bool:
    """Checks 2 and 3 (``eager``: a worker holding ``graphs`` without CUDA graphs); whether graph replay equals
    eager (True without CUDA)."""
    from tessera.program.program import single_device_program
    from tessera.runtime.segments import graph_segments

    cuda = device.startswith("cuda")
    ids = torch.randint(0, 1000, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0)) if cuda else None
    first = torch.randint(0, 1000, (BATCH, 1), generator=torch.Generator().manual_seed(1))
    e_logits, e_tokens, e_wall, e_busy = _run(eager, ids, steps, [first])
    g = graphs[f"decode@{BATCH}"]
    plan = graph_segments(g, single_device_program(g, device))
    reasons = sorted({r for r in plan.eager.values()})
    if not cuda:
        print(f"\n2. CUDA graphs: skipped (no CUDA). The decode program a GPU worker would capture: "
              f"{len(plan.segments)} segment(s) of {', '.join(str(len(s.kernels)) for s in plan.segments)} kernels; "
              f"{len(plan.eager)} kernel(s) eager: {'; '.join(reasons)}")
        print(f"3. eager worker on the CPU (no prefill, the cache zero): median decode step {_ms(e_wall)} (busy "
              f"{_ms(e_busy)} by the host clock); with graphs: skipped (no CUDA)")
        return True
    torch.cuda.empty_cache()
    served = {p: graphs[p] for p in ("prefill", f"decode@{BATCH}")}
    graphed, graph_load = _worker(device, served, files, cuda_graphs=True)
    at_load = {p: ph.stats().captured for p, ph in graphed.graphs.items()}
    g_logits, g_tokens, g_wall, g_busy = _run(graphed, ids, steps, [first, *e_tokens])
    stats = graphed.graphs[f"decode@{BATCH}"].stats()
    errors = {p: ph.load_error for p, ph in graphed.graphs.items() if ph.load_error}
    diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(g_logits, e_logits, strict=True)]
    equal = sum(torch.equal(a, b) for a, b in zip(g_logits, e_logits, strict=True))
    greedy = sum(torch.equal(a, b) for a, b in zip(g_tokens, e_tokens, strict=True))
    close = all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2) for a, b in zip(g_logits, e_logits,
                                                                                        strict=True))
    print(f"\n2. CUDA graph replay vs eager (two workers on {device}, {steps} decode steps of {BATCH} rows): max |logit "
          f"difference| {max(diffs):.3g} (per step {', '.join(f'{d:.3g}' for d in diffs)}); torch.equal on "
          f"{equal}/{steps} steps; greedy tokens match on {greedy}/{steps}")
    print(f"   captured at load: {at_load} graphs per phase (load of those {len(served)} phases {graph_load:.1f} s, "
          f"capture included); decode: {stats.segments} segment(s) of {', '.join(str(len(s.kernels)) for s in plan.segments)} "
          f"kernels, {stats.captured} graph(s), {stats.replays} replays, {stats.eager_runs} eager segment runs; "
          f"capture failures {stats.failed or 'none'}{f'; load errors {errors}' if errors else ''}; eager kernels: "
          f"{'; '.join(reasons)}")
    speedup = statistics.median(e_wall) / statistics.median(g_wall)
    print(f"3. median decode step: {_ms(g_wall)} with graphs, {_ms(e_wall)} eager ({speedup:.2f}x); busy (CUDA "
          f"events) {_ms(g_busy)} with graphs, {_ms(e_busy)} eager")
    return close and greedy == steps and not stats.failed


def staging(device: str) -> None:
    """Check 4."""
    if not device.startswith("cuda"):
        print("\n4. pinned + async staging vs pageable sync copies: skipped (no CUDA)")
        return
    from tessera.program.program import Piece
    from tessera.runtime.device_ops import device_ops
    from tessera.runtime.wire import pack, unpack

    ops = device_ops(device)
    print("\n4. transfer staging, device -> host -> device round trip (median of 20):")
    for n in SIZES:
        src = {"x": torch.randint(0, 255, (n,), dtype=torch.uint8, device=device).untyped_storage()}
        pieces = (Piece("x", ((0, n),)),)
        times = {"pageable, synchronous": [], "pinned, side stream": []}
        for _ in range(22):
            dst = {"x": torch.zeros(n, dtype=torch.uint8, device=device).untyped_storage()}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            flat = pack(src, pieces)
            recv = torch.empty(n, dtype=torch.uint8)
            recv.copy_(flat)  # what gloo does into the receiver's buffer
            unpack(dst, pieces, recv, torch.device(device))
            torch.cuda.synchronize()
            times["pageable, synchronous"].append(time.perf_counter() - t0)
            dst2 = {"x": torch.zeros(n, dtype=torch.uint8, device=device).untyped_storage()}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ops.begin_step()
            staged = ops.stage(src, pieces)
            staged.wait()
            recv = ops.recv_buffer(n)
            recv.copy_(staged.flat)
            ops.unpack(dst2, pieces, recv)
            ops.end_step()
            torch.cuda.synchronize()
            times["pinned, side stream"].append(time.perf_counter() - t0)
        same = torch.equal(torch.empty(0, dtype=torch.uint8, device=device).set_(dst2["x"]),
                           torch.empty(0, dtype=torch.uint8, device=device).set_(src["x"]))
        line = ", ".join(f"{k} {statistics.median(v[2:]) * 1e3:.3f} ms ({n / statistics.median(v[2:]) / 1e9:.2f} GB/s)"
                         for k, v in times.items())
        print(f"   {n >> 10} KiB: {line}; bytes arrive intact: {same}")
    print(f"   pinned buffers allocated: {ops.buffers.allocated} (reused per shape and dtype)")


def distributed(files: list[str], steps: int, threads: int, m: int) -> bool:
    """Check 5; whether the two cuda:0 workers are exact."""
    from bench_runtime import layer_split
    from tessera.graph.codec import dtype_from_name
    from tessera.program.program import single_device_program
    from tessera.runtime.distributed import DistributedRunner
    from tessera.runtime.executor import Executor
    from tessera.runtime.pool import WorkerPool
    from tessera.runtime.session import runtime_graphs
    from tessera.weights import load_weights

    per = BATCH // m
    graphs = runtime_graphs(MODEL, PROMPT, CTX, batch=BATCH, micro_batches=m)
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_weights(f))
    ids = torch.randint(0, 1000, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    slots = torch.arange(BATCH) % per
    dev = torch.device("cuda:0")
    ex = {ph: Executor(g, single_device_program(g, "cuda:0"), weights, dev) for ph, g in graphs.items()}
    g0 = graphs["decode"]
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
    print(f"\n5. distributed, kernels split by layers; reference (single process, Executor on cuda:0, M = {m} micro-"
          f"batches of {per}): median decode step {_ms(ref_s)}")
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
        print(f"   {name} ({pool.devices[0]} | {pool.devices[1]}): {len(sp.transfers)} transfers, "
              f"{sp.cut_bytes / 1e3:.1f} kB per decode step; setup {setup_s:.1f} s (CUDA graphs captured at load), "
              f"prefill of {BATCH} rows {prefill_s:.2f} s")
        print(f"   median decode step {_ms(secs)} (driver wall; reference {_ms(ref_s)}); worker step "
              f"{' / '.join(_ms([w[d] for w in worker_s]) for d in range(len(worker_s[0])))}; busy "
              f"{' / '.join(_ms([b[d] for b in busy]) for d in range(len(busy[0])))} (CUDA events on a GPU worker, "
              "the host clock on the CPU one)")
        diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref_logits, strict=True)]
        equal = [torch.equal(a, b) for a, b in zip(got, ref_logits, strict=True)]
        greedy = [torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(got, ref_logits, strict=True)]
        print(f"   vs reference: logits torch.equal on {sum(equal)}/{steps} steps; max |logit difference| per step "
              f"{', '.join(f'{d:.3g}' for d in diffs)}; greedy tokens match on {sum(greedy)}/{steps} steps")
        results[name] = (all(equal), max(diffs), sum(greedy))
    return results["2 workers on cuda:0"][0]


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} ms"


if __name__ == "__main__":
    sys.exit(main())
