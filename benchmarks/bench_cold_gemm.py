"""A prompt step's GEMMs with their weights warm (the profiler's way: one weight called again and again) and
cold (a step's way: each weight read once from memory), against what the host overhead charges for them
(``max(profiled, weights / measured bandwidth)``, `tessera.cost.host_overhead`) and the two extremes (warm plus
the weights' streaming time).

    .venv/bin/python benchmarks/bench_cold_gemm.py [--bandwidth 7.64e9] [--rows 1,16,32,64]

Shapes: smollm2-135m's projections (hidden 576, MLP 1536) and its LM head (49152 x 576, beyond the last-level
cache even warm). Cold: a set of distinct weights of 192 MiB called in turn (as the overhead probe reads
weights); warm: the first of them each time. One thread, bf16, median of 3 timed passes after one untimed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

SHAPES = ((1536, 576), (576, 1536), (576, 576), (49152, 576))
SET_BYTES = 192 * 2**20


def per_call_s(x: torch.Tensor, weights: list[torch.Tensor], cold: bool) -> float:
    """Median seconds of one ``linear(x, w)`` over passes through ``weights`` (each in turn, or the first)."""
    times = []
    for p in range(4):
        t0 = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(x, w if cold else weights[0])
        if p:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bandwidth", type=float, default=7.64e9, help="the overhead probe's averaged bytes/s")
    ap.add_argument("--rows", default="1,16,32,64")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread; "
          f"{time.strftime('%Y-%m-%d %H:%M')}; load {os.getloadavg()[0]:.1f}; weights at {args.bandwidth / 1e9:.2f} GB/s")
    print("| weight (out x in) | rows | warm (us) | cold (us) | charged: max(warm, stream) | warm + stream | "
          "cold over charged |")
    print("|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for out_f, in_f in SHAPES:
            weights = [torch.randn(out_f, in_f).to(torch.bfloat16)
                       for _ in range(max(2, SET_BYTES // (out_f * in_f * 2)))]
            stream = out_f * in_f * 2 / args.bandwidth
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, in_f).to(torch.bfloat16)
                warm, cold = per_call_s(x, weights, False), per_call_s(x, weights, True)
                charged = max(warm, stream)
                print(f"| {out_f} x {in_f} | {rows} | {warm * 1e6:.1f} | {cold * 1e6:.1f} | {charged * 1e6:.1f} | "
                      f"{(warm + stream) * 1e6:.1f} | {(cold / charged - 1) * 100:+.0f}% |")
            del weights


if __name__ == "__main__":
    main()
