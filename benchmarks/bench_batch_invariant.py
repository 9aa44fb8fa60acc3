"""Cost of batch-invariant steps: smollm2-135m decode (and one prefill) step times with the default kernels and
with GEMMs row by row (`Executor(batch_invariant=True)`), replayed in one process.

    PYTHONPATH=src python benchmarks/bench_batch_invariant.py --rows 1,4,8,16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tessera.capture.api import trace_model
from tessera.runtime.generate import ReplayRunner
from tessera.runtime.probe import zero_state
from tessera.runtime.session import weight_files
from tessera.weights import load_graph_weights

MODEL = "smollm2-135m"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=64, help="prompt bucket of the prefill step timed (0: none)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    graphs = {f"decode@{b}": trace_model(MODEL, "decode", batch=b, ctx=args.ctx, slots=max(rows)) for b in rows}
    if args.prefill:
        graphs[f"prefill@{args.prefill}"] = trace_model(MODEL, "prefill", batch=1, seq=args.prefill, ctx=args.ctx,
                                                        slots=max(rows))
    weights: dict[str, torch.Tensor] = {}
    for g in graphs.values():
        weights.update(load_graph_weights(g, weight_files(MODEL), [n for n, b in g.buffers.items()
                                                                   if b.kind == "weight" and n not in weights]))
    state = zero_state(next(iter(graphs.values())))
    runners = {mode: ReplayRunner(graphs, weights, state, batch_invariant=mode) for mode in (False, True)}
    out = []
    for phase in graphs:
        b = int(phase.split("@")[1])
        if phase.startswith("decode"):
            inputs = {"input_ids": torch.ones(b, 1, dtype=torch.long), "positions": torch.full((b,), 10),
                      "slots": torch.arange(b)}
        else:
            inputs = {"input_ids": torch.ones(1, b, dtype=torch.long), "slots": torch.tensor([0])}
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):  # interleaved, so load from elsewhere hits both modes alike
            for mode, runner in runners.items():
                t0 = time.perf_counter()
                runner(phase, inputs)
                times[mode].append(time.perf_counter() - t0)
        default, invariant = (statistics.median(times[m]) for m in (False, True))
        out.append({"phase": phase, "default_ms": round(default * 1e3, 1), "invariant_ms": round(invariant * 1e3, 1),
                    "slowdown": round(invariant / default, 2)})
        print(json.dumps(out[-1]), flush=True)


if __name__ == "__main__":
    main()
