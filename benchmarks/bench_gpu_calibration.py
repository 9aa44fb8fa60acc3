"""Fit the GPU efficiency factors on the measured A100-PCIE / L40S kernels and report held-out error.

    python benchmarks/bench_gpu_calibration.py [--write]

--write stores the fitted factors (with provenance and errors) in src/tessera/cost/data/gpu_factors.json,
the data the cost model reads.
"""

from __future__ import annotations

import json
import sys
import time

from rich.console import Console
from rich.table import Table

from tessera.cost.efficiency import GPU_FACTORS_FILE, prior_efficiency
from tessera.cost.gpu_calibration import (
    IDENTITY_MARGIN,
    REFERENCE,
    TARGET,
    calibrate_gpus,
    cross_validated,
    error_table,
    factors_document,
    identity_error_table,
    load_pairs,
    load_points,
    predict_target,
)
from tessera.hardware.devices import resolve_device


def _table(title: str, rows: dict[str, dict[str, float]]) -> Table:
    t = Table(title=title)
    for col in ("class", "kernels", "calibrated |err|", "prior |err|", "faster side right"):
        t.add_column(col, justify="left" if col == "class" else "right")
    for cls, r in sorted(rows.items(), key=lambda kv: (kv[0] == "overall", kv[0])):
        t.add_row(cls, str(r["kernels"]), f"{r['calibrated']:.1%}", f"{r['prior']:.1%}",
                  f"{r['faster_side_agreement']:.0%}")
    return t


def main() -> None:
    out = Console(highlight=False)
    t0 = time.perf_counter()
    cal = calibrate_gpus(progress=lambda cls, loo, prior: out.print(
        f"  {cls:13s} leave-one-out median |err| {loo:.1%} vs priors {prior:.1%} -> "
        f"{'fitted' if loo < prior else 'priors kept'}" if "(" not in cls else
        f"  {cls:13s} leave-one-out median |err| {loo:.1%} vs class factors {prior:.1%} -> "
        f"{'fitted' if loo < IDENTITY_MARGIN * prior else 'class factors kept'}"))
    out.print(f"fitted in {time.perf_counter() - t0:.1f} s; {cal.excluded} mismatched positions excluded; "
              f"A100-PCIE LM-head DRAM efficiency (bytes known) {cal.anchor:.2f}")
    t = Table(title="Fitted factors (floor cycles; L40S efficiencies relative to A100-PCIE priors)")
    for col in ("class", "kernels", "floor cycles", "L40S compute", "L40S memory", "fit |err|"):
        t.add_column(col, justify="left" if col == "class" else "right")
    for cls, f in cal.fits.items():
        t.add_row(cls, str(f.fit_kernels), f"{f.floor_cycles:.0f}", f"{f.target_compute:.2f}",
                  f"{f.target_memory:.2f}", f"{f.fit_error:.1%}")
    out.print(t)
    if cal.op_fits:
        t = Table(title="Fitted per Tessera identity (measured vLLM kernels mapped to fused ops)")
        for col in ("identity", "from class", "kernels", "floor cycles", "L40S compute", "L40S memory", "fit |err|"):
            t.add_column(col, justify="left" if col in ("identity", "from class") else "right")
        for ident, f in cal.op_fits.items():
            t.add_row(ident, cal.op_classes[ident], str(f.fit_kernels), f"{f.floor_cycles:.0f}",
                      f"{f.target_compute:.2f}", f"{f.target_memory:.2f}", f"{f.fit_error:.1%}")
        out.print(t)
    before = calibrate_gpus(by_identity=False)
    out.print(_table("Held-out third, class factors only (before identity fits)", error_table(before.held_out)))
    out.print(_table("Held-out third by Tessera identity (calibrated = identity factors where kept)",
                     identity_error_table(cal.held_out)))
    out.print(_table("Held-out third of the pairs file: predicted L40S time from the A100-PCIE time (median |err|)",
                     error_table(cal.held_out)))
    t0 = time.perf_counter()
    cv = cross_validated(load_pairs()[0])
    out.print(_table(f"3-fold cross-validation: every usable position predicted by factors fitted without it "
                     f"({time.perf_counter() - t0:.0f} s)", error_table(cv)))
    cv_before = cross_validated(load_pairs()[0], by_identity=False)
    out.print(_table("3-fold cross-validation, class factors only (before identity fits)", error_table(cv_before)))
    out.print(_table("3-fold cross-validation by Tessera identity", identity_error_table(cv)))
    ref, tgt = resolve_device(REFERENCE), resolve_device(TARGET)
    pts, _ = load_points()
    def ref_eff(k):
        e = cal.reference.classes[k.cost_class]
        return e if k.identity not in cal.reference.ops else \
            type(e)(e.compute, e.memory, cal.reference.ops[k.identity].floor_cycles, e.overhead_s)

    rows = [(k, predict_target(k, ref, tgt, ref_eff(k), cal.target.for_kernel(k.cost_class, k.identity)),
             predict_target(k, ref, tgt, prior_efficiency(ref).classes[k.cost_class],
                            prior_efficiency(tgt).classes[k.cost_class])) for k in pts]
    out.print(_table("Points file (individual launches; same runs as the pairs, so not independent)",
                     error_table(rows)))
    if "--write" in sys.argv:
        GPU_FACTORS_FILE.write_text(json.dumps(factors_document(cal, cv), indent=2) + "\n")
        out.print(f"written {GPU_FACTORS_FILE}")


if __name__ == "__main__":
    main()
