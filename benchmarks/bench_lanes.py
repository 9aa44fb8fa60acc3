"""The serving engine's lanes in flight at once against the same engine on one lane, in one process.

    .venv/bin/python benchmarks/bench_lanes.py [--rounds 2] [--requests 6] [--gap 0.3] [--tokens 16]

smollm2-135m (real weights) served on cpu:2 (one thread per worker) under the prefill-decode plan for both
objectives (prefill on one worker, decode on the other). Each round starts the engine twice, one after the
other: as it runs (two lanes: a prefill step runs while a decode step runs) and forced onto one lane (every
step after the last: what the engine did before steps were in flight). Requests arrive ``--gap`` seconds apart
and generate ``--tokens`` greedy tokens each. Printed per run: tokens/s over the run, TTFT and TPOT p50, and
the mean kernel seconds of a prefill step and of a decode step from the backend's step log (how much the two
workers slow each other down when they work at once).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at", "In 1492,",
           "The best way to", "My favourite colour is", "The sun rises in"]


def _run(lanes: str, requests: int, gap_s: float, tokens: int) -> dict[str, float]:
    from tessera.serve.config import ServeConfig
    from tessera.serve.engine import GenerationParams
    from tessera.serve.lanes import Lane
    from tessera.serve.launch import start_engine

    cfg = ServeConfig(MODEL, "cpu:2", slots=8, max_context=128, policy="prefill-decode",
                      latency_policy="prefill-decode", threads=1)
    engine, _ = start_engine(cfg)
    if lanes == "one":
        workers = frozenset(w for a in engine.placements.placements.values() for w in a)
        engine.lanes.lanes = lambda: [Lane(frozenset({"prefill", "decode"}), workers)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    finished = threading.Event()
    count = [0]

    def sink(kind, _payload):
        if kind in ("done", "error"):
            count[0] += 1
            if count[0] == requests:
                finished.set()

    try:
        t0 = time.perf_counter()
        gens = []
        for p in prompts:
            gens.append(engine.submit(engine.tokenizer(p).input_ids, GenerationParams(max_tokens=tokens), sink))
            time.sleep(gap_s)
        if not finished.wait(600):
            raise SystemExit("the requests did not finish within 600 s")
        wall = time.perf_counter() - t0
        log = list(engine.backend.step_log)
    finally:
        engine.stop()
    compute = {"prefill": [], "decode": []}
    for timing in log:
        compute[timing.phase.split("@")[0]].append(sum(timing.compute_s))
    return {"tokens_s": sum(len(g.tokens) for g in gens) / wall,
            "ttft_s": statistics.median(g.sched.first_output_s - g.sched.arrival_s for g in gens),
            "tpot_s": statistics.median((g.sched.finish_s - g.sched.first_output_s) / (len(g.tokens) - 1)
                                        for g in gens if len(g.tokens) > 1),
            "prefill_s": statistics.fmean(compute["prefill"]), "decode_s": statistics.fmean(compute["decode"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between arrivals")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per request")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print(f"{MODEL} on cpu:2 (prefill-decode, 1 thread per worker), {args.requests} requests {args.gap:g} s apart, "
          f"{args.tokens} tokens each")
    print("| round | lanes | tokens/s | TTFT p50 (s) | TPOT p50 (ms) | prefill step kernels (s) | decode step kernels (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        for lanes in ("two", "one") if r % 2 == 0 else ("one", "two"):
            m = _run(lanes, args.requests, args.gap, args.tokens)
            print(f"| {r + 1} | {lanes} | {m['tokens_s']:.2f} | {m['ttft_s']:.2f} | {m['tpot_s'] * 1e3:.0f} | "
                  f"{m['prefill_s']:.3f} | {m['decode_s']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
