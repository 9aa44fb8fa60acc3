"""Bytes over bandwidth: how far each catalog model's predicted decode step is from moving its bytes once.

    PYTHONPATH=src python3 benchmarks/bench_bandwidth_bound.py [--batch 64] [--ctx 2048] [--devices A100,L40S]

For each model (default graph kind: production where the model type has fused units) a decode step is traced
on meta and priced on each device. The bytes the step must move are the weights each kernel reads in their
deployed format (native: as traced, e.g. gpt-oss experts as MXFP4 blocks + scales; only the experts the
batch's tokens route to, in expectation; embedding tables only the rows gathered), plus the KV cache and
other state read and written. bound = bytes / DRAM bandwidth; ratio = predicted / bound (>= 1; the excess
is latency floors, activations, compute, and imperfect bandwidth).
"""

from __future__ import annotations

import argparse
import math
import time

from tessera.cost.features import FeatureExtractor, is_kv_buffer
from tessera.cost.model import CostModel
from tessera.cost.options import CostOptions
from tessera.hardware.devices import resolve_device

MODELS = ("llama-3.1-8b", "gpt-oss-20b", "mamba-codestral-7b", "qwen2.5-vl-7b", "smollm2-135m")


def must_move(graph, options: CostOptions) -> dict[str, float]:
    """Bytes of weights (deployed format, as the kernels read them), KV cache and other state of one step."""
    features = FeatureExtractor(graph, options).all()
    weights = sum(f.weight_bytes for f in features)
    kv = sum(f.kv_bytes for f in features)
    state = 0.0
    for a in graph.accesses:
        b = graph.buffers[a.buffer]
        if b.kind == "state" and not is_kv_buffer(a.buffer):
            state += math.prod(a.sizes) * a.itemsize
    return {"weights": weights, "kv": kv, "state": state, "total": weights + kv + state}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--devices", default="A100,L40S")
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    from tessera.capture.api import trace_model

    options = CostOptions()
    devices = [resolve_device(d) for d in args.devices.split(",")]
    print(f"decode step, batch {args.batch}, ctx {args.ctx}; weights {options.describe_weights()}, "
          f"KV {options.kv_dtype}, CUDA graphs")
    head = f"{'model':20s} {'graph':10s} {'kernels':>7s} {'weights GB':>10s} {'KV GB':>7s} {'state GB':>8s}"
    for d in devices:
        head += f" | {d.id + ' pred ms':>14s} {'bound ms':>8s} {'ratio':>6s}"
    print(head)
    for model in args.models.split(","):
        t0 = time.perf_counter()
        try:
            graph = trace_model(model, "decode", batch=args.batch, ctx=args.ctx)
        except Exception as e:  # noqa: BLE001 - one model's failure must not hide the others
            print(f"{model:20s} trace failed: {type(e).__name__}: {e}")
            continue
        moved = must_move(graph, options)
        line = (f"{model:20s} {str(graph.meta.get('graph', '?')):10s} {len(graph.kernels):7d} "
                f"{moved['weights'] / 1e9:10.3f} {moved['kv'] / 1e9:7.3f} {moved['state'] / 1e9:8.3f}")
        for d in devices:
            pred = CostModel(d, options).step_time(graph)
            bound = moved["total"] / d.memory_bandwidth
            line += f" | {pred * 1e3:14.3f} {bound * 1e3:8.3f} {pred / bound:6.2f}"
        print(line + f"   ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
