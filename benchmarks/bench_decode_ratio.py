"""Decode steps' predicted A100/L40S ratio per cost class, eager graph beside production graph, and GPT-oss-20B's
decode per kernel identity beside the measured calibration set.

Usage: python benchmarks/bench_decode_ratio.py [--model llama-3.1-8b] [--batches 64] [--ctx 2048]

Part 1 traces the model's decode step as both graph kinds and prints, per cost class, the kernels, FLOPs, bytes
and predicted time on A100 and L40S, and t(L40S)/t(A100). The two graphs run the same arithmetic on the same
weights and cache, so a class ratio that moves between them is a cost-model artefact of the graph's shape
(kernel count, fusion), not of the hardware. Part 2 predicts GPT-oss-20B's production decode step on the
measured parts (A100-PCIE, L40S) and compares each kernel identity's time-weighted ratio with the measured one
(`src/tessera/cost/data/calibration/gptoss20b_a100_l40s_kernel_pairs.tsv`, decode positions weighted by
launches; the measured batch is not recorded). Part 3 compares absolute times on each measured part for the
three decode GEMMs whose bytes are known from GPT-oss-20B's shapes (QKV 2880->5120, 29.5 MB; o_proj 4096->2880,
23.6 MB; the LM head, 1.158 GB), predicted at several batch sizes since the measured one is not recorded. Every
GPU figure here except the measured columns is a prediction.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from tessera.capture.api import trace_model
from tessera.cost.features import FeatureExtractor
from tessera.cost.gpu_calibration import load_pairs
from tessera.cost.model import CostModel
from tessera.hardware.devices import resolve_device

GEMM_CLASSES = ("gemm", "gemv")


def class_table(model: str, batch: int, ctx: int) -> None:
    """Per class and graph kind: kernels, GFLOP, GB moved, A100 and L40S time, their ratio."""
    a100, l40s = resolve_device("A100"), resolve_device("L40S")
    print(f"{model} decode, batch {batch}, ctx {ctx}; t(L40S)/t(A100) per class (predicted)")
    print(f"{'graph':10s} {'class':12s} {'kernels':>7s} {'GFLOP':>8s} {'GB':>7s} {'A100 ms':>8s} {'L40S ms':>8s} "
          f"{'ratio':>6s}")
    for kind in ("eager", "production"):
        graph = trace_model(model, "decode", batch=batch, ctx=ctx, graph=kind)
        feats = FeatureExtractor(graph).all()
        ta, tl = CostModel(a100).kernel_costs(graph, feats), CostModel(l40s).kernel_costs(graph, feats)
        rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
        for f, ca, cl in zip(feats, ta, tl, strict=True):
            r = rows[f.cost_class]
            r[0] += 1
            r[1] += f.flops
            r[2] += f.bytes
            r[3] += ca.time_s
            r[4] += cl.time_s
        total = [len(feats), sum(r[1] for r in rows.values()), sum(r[2] for r in rows.values()),
                 sum(c.time_s for c in ta), sum(c.time_s for c in tl)]
        for cls, r in [*sorted(rows.items(), key=lambda kv: -kv[1][3]), ("step", total)]:
            print(f"{kind:10s} {cls:12s} {r[0]:7d} {r[1] / 1e9:8.1f} {r[2] / 1e9:7.2f} {r[3] * 1e3:8.2f} "
                  f"{r[4] * 1e3:8.2f} {r[4] / r[3]:6.2f}")


def _label(identity: str | None, cost_class: str, block: str) -> str | None:
    if identity == "lm_head" or (cost_class in GEMM_CLASSES and block == "other"):
        return "lm_head"
    if cost_class in GEMM_CLASSES and identity in (None, "merged_linear"):
        return "dense GEMMs (QKV, o_proj, router)"
    return identity


def identity_table(batch: int, ctx: int) -> None:
    """GPT-oss-20B decode: each identity's time-weighted t(L40S)/t(A100-PCIE), predicted and measured."""
    measured: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    usable, _ = load_pairs()
    for k in usable:
        label = _label(k.identity, k.cost_class, k.block) if k.phase == "decode" else None
        if label:
            measured[label][0] += k.reference_s * k.launches
            measured[label][1] += k.target_s * k.launches
    ref, tgt = resolve_device("A100-PCIE"), resolve_device("L40S")
    graph = trace_model("gpt-oss-20b", "decode", batch=batch, ctx=ctx)
    feats = FeatureExtractor(graph).all()
    predicted: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for f, ca, cl in zip(feats, CostModel(ref).kernel_costs(graph, feats), CostModel(tgt).kernel_costs(graph, feats),
                         strict=True):
        label = _label(f.op, f.cost_class, f.block)
        if label:
            predicted[label][0] += ca.time_s
            predicted[label][1] += cl.time_s
    print(f"\ngpt-oss-20b production decode, batch {batch}, ctx {ctx}: t(L40S)/t(A100-PCIE), time-weighted")
    print(f"{'identity':36s} {'predicted':>9s} {'measured':>9s} {'error':>7s}")
    for label in sorted(set(measured) & set(predicted), key=lambda x: -measured[x][0]):
        p, m = predicted[label][1] / predicted[label][0], measured[label][1] / measured[label][0]
        print(f"{label:36s} {p:9.2f} {m:9.2f} {p / m - 1:+7.1%}")


# (A100-PCIE us, L40S / A100-PCIE ratio) of the measured decode positions (pairs file: medians over launches)
MEASURED_GEMMS = {"qkv": (26.944, 1.7216), "o_proj": (21.344, 1.7095), "lm_head": (739.365, 2.4222)}


def _gemm_name(scope: str, op: str) -> str | None:
    if scope.endswith("lm_head"):
        return "lm_head"
    if scope.endswith("self_attn") and "merged_linear" in op:
        return "qkv"
    return "o_proj" if scope.endswith("o_proj") else None


def absolute_table(batches: list[int], ctx: int) -> None:
    """GPT-oss-20B's decode QKV, o_proj and LM head: predicted time on each measured part against measured."""
    ref, tgt = resolve_device("A100-PCIE"), resolve_device("L40S")
    print(f"\ngpt-oss-20b production decode GEMMs with known bytes: predicted vs measured us (error), ctx {ctx}")
    print(f"{'batch':>5s} {'kernel':8s} {'A100-PCIE':>10s} {'measured':>9s} {'error':>6s} {'L40S':>8s} {'measured':>9s} "
          f"{'error':>6s}")
    for b in batches:
        graph = trace_model("gpt-oss-20b", "decode", batch=b, ctx=ctx)
        feats = FeatureExtractor(graph).all()
        seen: dict[str, tuple[float, float]] = {}
        for k, ca, cl in zip(graph.kernels, CostModel(ref).kernel_costs(graph, feats),
                             CostModel(tgt).kernel_costs(graph, feats), strict=True):
            name = _gemm_name(k.scope, k.op)
            if name and name not in seen:
                seen[name] = (ca.time_s * 1e6, cl.time_s * 1e6)
        for name, (a, m) in MEASURED_GEMMS.items():
            pa, pl = seen[name]
            print(f"{b:5d} {name:8s} {pa:10.1f} {a:9.1f} {pa / a - 1:+6.0%} {pl:8.1f} {a * m:9.1f} "
                  f"{pl / (a * m) - 1:+6.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--batches", default="64", help="comma-separated decode batch sizes")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--oss-batch", type=int, default=64, help="GPT-oss-20B decode batch of part 2")
    args = parser.parse_args()
    for b in (int(x) for x in args.batches.split(",")):
        class_table(args.model, b, args.ctx)
    identity_table(args.oss_batch, args.ctx)
    absolute_table([8, 32, 64, 128], args.ctx)


if __name__ == "__main__":
    main()
