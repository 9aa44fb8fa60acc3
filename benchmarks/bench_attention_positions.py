"""How Tessera's CPU decode attention kernel's time scales with the rows and the cache positions they read, and
what a batch of mixed positions costs against every row at its furthest or at its mean position.

    .venv/bin/python benchmarks/bench_attention_positions.py

smollm2-135m's attention shapes (9 query heads, 3 KV heads of 64, bf16), a cache of 32 slots x 512 positions,
one thread; each figure the median of 30 calls after 3 warm-up calls, in milliseconds.
"""

from __future__ import annotations

import random
import statistics
import time

SLOTS, HEADS, KV_HEADS, HEAD_DIM, CTX = 32, 9, 3, 64, 512


def main() -> None:
    import torch

    from tessera.kernels.attention import decode_attention

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    k_cache = torch.randn(SLOTS, KV_HEADS, CTX, HEAD_DIM, dtype=torch.bfloat16)
    v_cache = torch.randn(SLOTS, KV_HEADS, CTX, HEAD_DIM, dtype=torch.bfloat16)

    def ms(positions: list[int], repeats: int = 30) -> float:
        rows = len(positions)
        q = torch.randn(rows, HEADS, 1, HEAD_DIM, dtype=torch.bfloat16)
        slots, at = torch.arange(rows), torch.tensor(positions)
        for _ in range(3):
            decode_attention(q, k_cache, v_cache, slots, at, HEAD_DIM**-0.5, 0, None)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            decode_attention(q, k_cache, v_cache, slots, at, HEAD_DIM**-0.5, 0, None)
            times.append((time.perf_counter_ns() - t0) * 1e-6)
        return statistics.median(times)

    positions = (0, 15, 63, 127, 255, 511)
    print("| rows | " + " | ".join(f"position {p}" for p in positions) + " |")
    print("|---" * (len(positions) + 1) + "|")
    for rows in (1, 4, 8, 32):
        print(f"| {rows} | " + " | ".join(f"{ms([p] * rows):.3f}" for p in positions) + " |")
    random.seed(0)
    mixes = {"half at 15, half at 511": [15] * 16 + [511] * 16, "half at 63, half at 255": [63] * 16 + [255] * 16,
             "uniform 0-300": [random.randint(0, 300) for _ in range(32)]}
    print("\n| 32 rows at mixed positions | mixed | every row at the furthest | every row at the mean |")
    print("|---|---|---|---|")
    for name, mix in mixes.items():
        furthest, mean = max(mix), round(statistics.mean(mix))
        print(f"| {name} (furthest {furthest}, mean {mean}) | {ms(mix):.3f} | {ms([furthest] * 32):.3f} | "
              f"{ms([mean] * 32):.3f} |")


if __name__ == "__main__":
    main()
