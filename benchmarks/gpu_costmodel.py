"""Check the cost model against kernels measured on a CUDA GPU (CUDA events), per class.

    PYTHONPATH=src python3 benchmarks/gpu_costmodel.py [--repeats 20]

Profiles smollm2-135m (real weights) decode and prefill steps at a few shapes on `cuda`, maps the GPU
to its catalog id (e.g. H200), and prints the median |predicted/measured - 1| per class with the shipped
factors (CUDA-graph timing: no launch latency; CUDA events around one kernel include a small gap),
then fits this GPU's own per-class factors on half the shapes and reports the error on the other
half.

Production units (``--units``, on by default): smollm2-135m and llama-3.1-8b-shaped layers (the 8B's
dimensions, 2 layers, random weights) at decode batch 1 and 64 (ctx 2048) and prefill 512: every kernel of
the production graph is timed with CUDA events and compared with the cost model's prediction, per Tessera
fused op (torch.ops.tessera.<name>; ops not defined in this checkout are listed as skipped) and per class.
The CPU-side preparation (tracing on meta, predictions for the catalog device) runs without a GPU; the
timing needs CUDA and is skipped with a message otherwise (exit 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# the fused ops of the production graphs (BRIEF): timed where torch.ops.tessera defines them
FUSED_OPS = ("merged_linear", "rms_norm", "add_rms_norm", "rotary_", "mrope_", "silu_and_mul", "gelu_tanh_and_mul",
             "swigluoai_and_mul", "kv_write", "prefill_attention", "decode_attention", "topk_gating", "moe_align",
             "moe_gemm", "moe_mxfp4_gemm", "moe_sum", "sample")
UNIT_SHAPES = [("decode", dict(batch=1, ctx=2048)), ("decode", dict(batch=64, ctx=2048)),
               ("prefill", dict(batch=1, seq=512, ctx=1024))]


def llama8b_layers(tmp: Path, layers: int = 2) -> str:
    """A local model directory: llama-3.1-8b's config with ``layers`` layers (random weights)."""
    from tessera.capture.models import resolve_model

    config = json.loads((resolve_model("llama-3.1-8b").config_dir / "config.json").read_text())
    config["num_hidden_layers"] = layers
    folder = tmp / f"llama-3.1-8b-{layers}l"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def available_ops() -> tuple[list[str], list[str]]:
    """(defined, missing) fused ops of this checkout."""
    import tessera.kernels  # noqa: F401

    ns = torch.ops.tessera
    have = [n for n in FUSED_OPS if hasattr(ns, n)]
    return have, [n for n in FUSED_OPS if n not in have]


def _identity(kernel) -> str:
    from tessera.cost.features import cost_class, kernel_identity

    return kernel_identity(kernel) or f"[{cost_class(kernel)}]"


def predict_units(models: list[tuple[str, str]], device_id: str) -> dict:
    """CPU side: trace each (label, model) at every unit shape on meta and predict every kernel on the device."""
    from tessera.capture.api import trace_model
    from tessera.cost.model import CostModel
    from tessera.cost.profile import kernel_signature
    from tessera.hardware.devices import resolve_device

    cm = CostModel(resolve_device(device_id))
    out = {}
    for label, model in models:
        for phase, shape in UNIT_SHAPES:
            t0 = time.perf_counter()
            g = trace_model(model, phase, **shape)
            costs = cm.kernel_costs(g)
            pred = {kernel_signature(k): c.time_s for k, c in zip(g.kernels, costs, strict=True)}
            groups: dict[str, list[float]] = {}
            for k, c in zip(g.kernels, costs, strict=True):
                groups.setdefault(_identity(k), []).append(c.time_s)
            print(f"  {label} {phase} {shape}: {g.meta.get('graph', '?')} graph, {len(g.kernels)} kernels, predicted "
                  f"{sum(c.time_s for c in costs) * 1e3:.3f} ms on {device_id} ({time.perf_counter() - t0:.1f} s)")
            for ident, ts in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:8]:
                print(f"      {ident:22s} {len(ts):5d} kernels {sum(ts) * 1e6:10.1f} us")
            out[(label, phase, json.dumps(shape))] = (model, phase, shape, g, pred)
    return out


def measure_units(prepared: dict, repeats: int) -> None:
    """GPU side: time every kernel (CUDA events) and compare with the predictions per fused op and class."""
    from tessera.cost.features import cost_class
    from tessera.cost.profile import kernel_signature
    from tessera.runtime.profiler import profile_model

    rows: dict[str, list[tuple[float, float]]] = {}
    for (label, phase, _), (model, _, shape, _graph, pred) in prepared.items():
        prof, g = profile_model(model, phase, device="cuda", warmup=3, repeats=repeats, **shape)
        by_sig = {kernel_signature(k): k for k in g.kernels}
        measured = sum(t.median_s for t in prof.kernels)
        predicted = 0.0
        for t in prof.kernels:
            k = by_sig.get(t.signature)
            p = pred.get(t.signature)
            if k is None or p is None:
                continue
            predicted += p
            for key in (_identity(k), f"class {cost_class(k)}"):
                rows.setdefault(key, []).append((p, t.median_s))
        print(f"  {label} {phase} {shape}: measured {measured * 1e3:.3f} ms, predicted {predicted * 1e3:.3f} ms "
              f"(step ratio {predicted / measured:.2f})")
    print("per fused op / class: kernels, median |predicted/measured - 1|, sum measured us, sum predicted us")
    for key in sorted(rows, key=lambda k: (k.startswith("class"), k)):
        r = rows[key]
        err = statistics.median(abs(p / m - 1) for p, m in r)
        print(f"  {key:26s} {len(r):5d} {err:8.1%} {sum(m for _, m in r) * 1e6:12.1f} {sum(p for p, _ in r) * 1e6:12.1f}")


def units(repeats: int, device_id: str | None) -> None:
    have, missing = available_ops()
    print(f"fused ops defined: {', '.join(have) or 'none'}")
    if missing:
        print(f"skipped (not defined in this checkout): {', '.join(missing)}")
    cuda = torch.cuda.is_available()
    if device_id is None and cuda:
        from tessera.runtime.profiler import resolve_target

        device_id = resolve_target("cuda", None).id
    device_id = device_id or "H200"
    with tempfile.TemporaryDirectory() as tmp:
        models = [("smollm2-135m", "smollm2-135m"), ("llama-3.1-8b x2 layers", llama8b_layers(Path(tmp)))]
        print(f"CPU preparation: tracing production units, predicting on {device_id}")
        prepared = predict_units(models, device_id)
        if not cuda:
            print("no CUDA device: predictions above; timing the units needs a GPU (skipped)")
            return
        print(f"GPU: {torch.cuda.get_device_name()}: timing every kernel with CUDA events")
        measure_units(prepared, repeats)

CASES_FIT = [("decode", dict(batch=1, ctx=512)), ("decode", dict(batch=32, ctx=2048)),
             ("prefill", dict(batch=1, seq=512, ctx=1024))]
CASES_HELD = [("decode", dict(batch=8, ctx=1024)), ("decode", dict(batch=128, ctx=4096)),
              ("prefill", dict(batch=4, seq=256, ctx=512))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-units", action="store_true", help="skip the production-unit check")
    ap.add_argument("--units-only", action="store_true", help="only the production-unit check")
    ap.add_argument("--device", default=None, help="catalog id to predict for (default: the CUDA GPU's, else H200)")
    args = ap.parse_args()
    if not args.no_units:
        units(args.repeats, args.device)
        if args.units_only:
            return
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark profiles kernels on a GPU; nothing to do here")
        sys.exit(0)
    from tessera.cost.cpu_calibration import fit_host, relative_errors, samples
    from tessera.cost.efficiency import efficiency_for
    from tessera.runtime.profiler import profile_model

    def run(cases):
        rows, device_id = [], None
        for phase, shape in cases:
            prof, graph = profile_model("smollm2-135m", phase, device="cuda", warmup=3, repeats=args.repeats, **shape)
            device_id = prof.device
            s = samples(graph, prof)
            rows += s
            print(f"  {phase} {shape}: {len(s)} kernels, {sum(x.measured_s for x in s) * 1e3:.2f} ms measured")
        return rows, device_id

    print(f"GPU: {torch.cuda.get_device_name()}")
    fit_rows, device_id = run(CASES_FIT)
    held_rows, _ = run(CASES_HELD)
    from tessera.hardware.devices import resolve_device

    spec = resolve_device(device_id)
    shipped = efficiency_for(spec)
    print(f"catalog device {spec.id}; shipped factors: {shipped.source}")
    own = fit_host(fit_rows, spec)
    for label, eff in (("shipped factors", shipped), ("factors fitted on this GPU (fit shapes)", own)):
        errs = relative_errors(held_rows, spec, eff)
        print(f"held-out shapes, {label}:")
        for cls in sorted(errs, key=lambda c: (c == "overall", c)):
            print(f"  {cls:13s} {len(errs[cls]):5d} kernels  median |err| {statistics.median(errs[cls]):.1%}")
    for cls in own.fitted:
        e = own.classes[cls]
        print(f"  fitted {cls:13s} compute {e.compute:.3f} memory {e.memory:.3f} overhead {e.overhead_s * 1e6:.2f} us")


if __name__ == "__main__":
    main()
