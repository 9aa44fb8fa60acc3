"""Full-size `meta` traces of the catalog models: build and trace time, kernels, kernels per second.

Usage: python benchmarks/bench_trace.py [--repeat N] [--only NAME]
Goal: every trace under 10 s; llama-3.1-8b decode (batch 64, ctx 2048) under 0.5 s.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from tessera.capture.models import load_config, resolve_model
from tessera.capture.phases import build_modules, check_phase, resolve_shape, step_for
from tessera.capture.trace import trace

CASES = [
    ("llama-3.1-8b", "decode", dict(batch=64, ctx=2048)),
    ("llama-3.1-8b", "prefill", dict(batch=1, seq=2048)),
    ("gpt-oss-20b", "decode", dict(batch=64, ctx=2048)),
    ("gpt-oss-20b", "prefill", dict(batch=1, seq=2048)),
    ("mamba-codestral-7b", "decode", dict(batch=64, ctx=2048)),
    ("mamba-codestral-7b", "prefill", dict(batch=1, seq=2048)),
    ("qwen3-235b-a22b", "decode", dict(batch=64, ctx=2048)),
    ("qwen3-235b-a22b", "prefill", dict(batch=1, seq=2048)),
    ("smollm2-135m", "decode", dict(batch=64, ctx=2048)),
    ("smollm2-135m", "prefill", dict(batch=1, seq=2048)),
    ("qwen2.5-vl-7b", "encode", dict(batch=1, image=(504, 504))),
    ("qwen2.5-vl-7b", "prefill", dict(batch=1, seq=2048, image=(504, 504))),
    ("qwen2.5-vl-7b", "decode", dict(batch=64, ctx=2048, image=(504, 504))),
    ("sd3.5-medium", "encode", dict(batch=1, resolution=(1024, 1024))),
    ("sd3.5-medium", "step", dict(batch=1, resolution=(1024, 1024))),
    ("sd3.5-medium", "decode", dict(batch=1, resolution=(1024, 1024))),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="traces per case; the best is reported")
    parser.add_argument("--only", default=None, help="only cases of this model")
    args = parser.parse_args()
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'model':20s} {'phase':8s} {'shape':28s} {'build s':>8s} {'trace s':>8s} {'kernels':>8s} "
          f"{'kernels/s':>10s} {'edges':>7s}")
    for name, phase, shape_kw in CASES:
        if args.only and name != args.only:
            continue
        spec = resolve_model(name)
        check_phase(spec, phase)
        config = load_config(spec)
        shape = resolve_shape(spec, config, phase, **shape_kw)
        t0 = time.perf_counter()
        modules, values = build_modules(spec, "meta", config=None if spec.family == "diffusion" else config)
        build_s = time.perf_counter() - t0
        best, graph = float("inf"), None
        for _ in range(args.repeat):
            step = step_for(spec, modules, values, phase, shape, device="meta")
            t0 = time.perf_counter()
            graph = trace(step)
            best = min(best, time.perf_counter() - t0)
        desc = ", ".join(f"{k}={v if not isinstance(v, tuple) else 'x'.join(map(str, v))}"
                         for k, v in shape_kw.items())
        print(f"{name:20s} {phase:8s} {desc:28s} {build_s:8.2f} {best:8.3f} {len(graph.kernels):8d} "
              f"{len(graph.kernels) / best:10.0f} {len(graph.edges):7d}", flush=True)


if __name__ == "__main__":
    main()
