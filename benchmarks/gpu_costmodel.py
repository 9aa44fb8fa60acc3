"""Check the cost model against kernels measured on a CUDA GPU (CUDA events), per class.

    PYTHONPATH=src python3 benchmarks/gpu_costmodel.py [--repeats 20]

Profiles smollm2-135m (real weights) decode and prefill steps at a few shapes on `cuda`, maps the GPU
to its catalog id (e.g. H200), and prints the median |predicted/measured - 1| per class with the shipped
factors (CUDA-graph timing: no launch latency; CUDA events around one kernel include a small gap),
then fits this GPU's own per-class factors on half the shapes and reports the error on the other
half. Needs a CUDA GPU; prints what it would do otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

CASES_FIT = [("decode", dict(batch=1, ctx=512)), ("decode", dict(batch=32, ctx=2048)),
             ("prefill", dict(batch=1, seq=512, ctx=1024))]
CASES_HELD = [("decode", dict(batch=8, ctx=1024)), ("decode", dict(batch=128, ctx=4096)),
              ("prefill", dict(batch=4, seq=256, ctx=512))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
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
