"""Honest CPU calibration of the cost model: fit on smollm2-135m, predict other models and shapes.

    python benchmarks/bench_costmodel.py [--threads T] [--repeats R] [--write]

Fit set: smollm2-135m (real weights) decode and prefill steps at a few batch sizes and contexts.
Held out: (a) a different Llama config (hidden 384, 8 layers, 6 heads / 2 KV heads, FFN 1024; random
weights) and (b) smollm2-135m at batch sizes and contexts not in the fit set. Every kernel is profiled
on this CPU (median of R runs); the per-class factors are fitted on the fit set only, then the
roofline predicts each held-out kernel. Prints the median absolute relative error per class and overall
(goal: at most 25% on held-out kernels) and the step-time error. --write stores the fitted factors as
this host's CPU factors (read by `tessera estimate --device cpu`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tessera.cost.cpu_calibration import fit_host, relative_errors, samples, timing_spread
from tessera.cost.efficiency import host_factors_file, save_factors
from tessera.hardware.host import host_spec
from tessera.runtime.profiler import profile_model

FIT = [("smollm2-135m", "decode", dict(batch=1, ctx=256)), ("smollm2-135m", "decode", dict(batch=4, ctx=512)),
       ("smollm2-135m", "prefill", dict(batch=1, seq=64, ctx=256)),
       ("smollm2-135m", "prefill", dict(batch=2, seq=128, ctx=256))]
HELD_SHAPES = [("smollm2-135m", "decode", dict(batch=8, ctx=1024)),
               ("smollm2-135m", "prefill", dict(batch=1, seq=256, ctx=512))]
OTHER_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=384,
                    intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                    max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                    torch_dtype="bfloat16", hidden_act="silu")


def held_out_other(tmp: Path) -> list[tuple[str, str, dict]]:
    folder = tmp / "llama-h384-l8"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(OTHER_CONFIG))
    return [(str(folder), "decode", dict(batch=2, ctx=384)), (str(folder), "decode", dict(batch=16, ctx=768)),
            (str(folder), "prefill", dict(batch=1, seq=96, ctx=256))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="threads per worker (default: those of one cpu:2 worker)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    out = Console(highlight=False, width=120)
    device = host_spec(args.threads)
    out.print(f"host: {device.name}, {device.threads} threads; measured fp32 {device.flops['fp32'] / 1e9:.0f} "
              f"GFLOP/s, bf16 {device.flops.get('bf16', 0) / 1e9:.0f} GFLOP/s, bandwidth "
              f"{device.memory_bandwidth / 1e9:.1f} GB/s, dispatch {device.launch_latency_s * 1e6:.1f} us")

    def run(cases):
        rows, steps = [], []
        for model, phase, shape in cases:
            t0 = time.perf_counter()
            prof, graph = profile_model(model, phase, device="cpu", threads=args.threads, warmup=2,
                                        repeats=args.repeats, **shape)
            s = samples(graph, prof)
            rows += s
            steps.append((f"{Path(model).name} {phase} {shape}", s))
            out.print(f"  profiled {Path(model).name} {phase} {shape}: {len(s)} kernels, "
                      f"{sum(x.measured_s for x in s) * 1e3:.1f} ms of kernels ({time.perf_counter() - t0:.1f} s)")
        return rows, steps

    out.print("fit set (smollm2-135m, real weights):")
    fit_rows, _ = run(FIT)
    factors = fit_host(fit_rows, device)
    with tempfile.TemporaryDirectory() as tmp:
        out.print("held out (another config; other shapes):")
        held_rows, held_steps = run(held_out_other(Path(tmp)) + HELD_SHAPES)
    fit_err = relative_errors(fit_rows, device, factors)
    held_err = relative_errors(held_rows, device, factors)
    table = Table(title=f"CPU cost model: median |predicted/measured - 1| per kernel ({device.threads} threads)")
    spread = timing_spread(held_rows)
    for col in ("class", "fit kernels", "fit error", "held-out kernels", "held-out error", "noise floor", "overhead",
                "compute eff", "memory eff"):
        table.add_column(col, justify="left" if col == "class" else "right")
    for cls in sorted(held_err, key=lambda c: (c == "overall", c)):
        e = factors.classes.get(cls)
        table.add_row(cls, str(len(fit_err.get(cls, []))), f"{statistics.median(fit_err[cls]):.1%}" if cls in fit_err
                      else "-", str(len(held_err[cls])), f"{statistics.median(held_err[cls]):.1%}",
                      f"{statistics.median(spread[cls]):.1%}" if spread.get(cls) else "-",
                      f"{e.overhead_s * 1e6:.1f} us" if e and e.overhead_s else "-",
                      f"{e.compute:.3f}" if e else "-", f"{e.memory:.3f}" if e else "-")
    out.print(table)
    out.print("noise floor: median |t/median - 1| of identical kernels (same signature) timed separately within one "
              "held-out step, e.g. the same op in different layers")
    from tessera.cost.roofline import kernel_time

    for label, rows in held_steps:
        measured = sum(s.measured_s for s in rows)
        predicted = sum(kernel_time(s.features, device, factors.classes[s.features.cost_class]).time_s for s in rows)
        out.print(f"  step {label}: measured {measured * 1e3:.2f} ms, predicted {predicted * 1e3:.2f} ms "
                  f"({predicted / measured - 1:+.1%})")
    overall = statistics.median(held_err["overall"])
    out.print(f"held-out overall median |err| {overall:.1%} (goal <= 25%): {'met' if overall <= 0.25 else 'NOT met'}")
    if args.write:
        save_factors(factors, host_factors_file())
        out.print(f"factors written to {host_factors_file()}")


if __name__ == "__main__":
    main()
