"""`tessera validate`: measured kernel and step times against Tessera's predictions, and time factors fitted
on them."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from tessera.cli import options as opt
from tessera.cli.outputs import check_output_file, write_output
from tessera.console import err as _err
from tessera.console import fail as _fail
from tessera.console import out as _out
from tessera.cost.factors import MIN_FIT_MEASUREMENTS
from tessera.errors import TesseraError


def _pct(x: float) -> str:
    return f"{x:+.1%}" if x <= -0.0005 else f"{abs(x):.1%}"


def validate(
    measurements: list[Path] = typer.Argument(..., help="Measurement files: the CSV device,model,op,shape,seconds "
                                              "(docs/commands.md), `tessera profile` JSON, Nsight Systems "
                                              "cuda_gpu_trace CSV exports, or the calibration set's TSV."),
    fit: Path = typer.Option(None, "--fit", help="Write time factors here (per device and op class, the factor "
                             "that zeroes its median error), for --factors of estimate, plan, simulate and census."),
    min_count: int = typer.Option(MIN_FIT_MEASUREMENTS, "--min-count", help="--fit: fit a factor only for a "
                                  "device and op class with at least this many measurements."),
    factors: Path = opt.FACTORS,
    plot: Path = typer.Option(None, "--plot", help="Write a PNG of predicted against measured times (log-log, "
                              "one panel per device)."),
    phase: str = typer.Option("decode", "--phase", help="Phase of the steps in Nsight exports (decode or "
                              "prefill): how their GEMMs are costed, since a trace records no shapes."),
    reference: str = typer.Option(None, "--reference", help="Device whose Nsight kernel times predict the "
                                  "other devices' (default: the first device in the files)."),
    weights_dtype: str = opt.WEIGHTS_DTYPE,
    kv_dtype: str = opt.KV_DTYPE,
    eager: bool = opt.EAGER,
    graph_kind: str = opt.GRAPH,
    as_json: bool = opt.JSON,
) -> None:
    """Compare measured times with Tessera's predictions: error per device and op class, cross-device ratios."""
    from tessera.cost.options import CostOptions
    from tessera.cost.validation import ValidationConfig, fit_factors
    from tessera.cost.validation import validate as run_validation

    try:
        check_output_file(fit, "--fit", "factors.json")
        check_output_file(plot, "--plot", "validate.png")
        if phase not in ("decode", "prefill"):
            raise TesseraError(f"--phase must be decode or prefill (got {phase!r})")
        config = ValidationConfig(tuple(measurements), CostOptions(weights_dtype, kv_dtype, not eager,
                                                                   opt.load_factors(factors)),
                                  phase, reference, graph_kind)
        with _err.status("reading measurements...") as status:
            result = run_validation(config, progress=lambda s: status.update(s + "..."))
        fitted = None
        if fit is not None:
            if min_count < 1:
                raise TesseraError(f"--min-count must be at least 1 (got {min_count})")
            fitted = fit_factors(result, "tessera validate on " + ", ".join(p.name for p in measurements),
                                 min_count)
            write_output(fit, "--fit", fitted.save, "factors.json")
        if plot is not None:
            from tessera.report.validation_plot import validation_scatter

            names = ", ".join(p.name for p in measurements)
            write_output(plot, "--plot", lambda png: validation_scatter(result, png, f"tessera validate: {names}"),
                         "validate.png")
    except TesseraError as e:
        _fail(e)
    if as_json:
        doc = result.to_dict() | {"files": [str(p) for p in measurements],
                                  "factors": str(factors) if factors else None}
        if fitted is not None:
            doc["fit"] = {"file": str(fit), "devices": fitted.as_mapping()}
        print(json.dumps(doc, indent=2))
        return
    fitted_map = fitted.as_mapping() if fitted else {}
    table = Table(title="predicted vs measured, per device and op class"
                        + (f" (factors {factors})" if factors else ""))
    cols = ["device", "op class", "n", "median |err|", "p90 |err|", "median err", "predicted"]
    if fitted:
        cols.append("fitted factor")
    for col in cols:
        table.add_column(col, justify="left" if col in ("device", "op class", "predicted") else "right")
    for g in result.groups:
        s = g.stats
        row = [g.device, g.op_class, str(s.count), f"{s.median_abs:.1%}", f"{s.p90_abs:.1%}", _pct(s.median_signed),
               g.basis]
        if fitted:
            name = "*" if g.op_class == "step" else g.op_class
            value = fitted_map.get(g.device, {}).get(name)
            row.append("-" if value is None else f"{value:.3g}")
        table.add_row(*row)
    for device, s in result.overall.items():
        table.add_row(f"[bold]{device}", "[bold]all", f"[bold]{s.count}", f"[bold]{s.median_abs:.1%}",
                      f"[bold]{s.p90_abs:.1%}", f"[bold]{_pct(s.median_signed)}", "", *([""] if fitted else []))
    _out.print(table)
    if result.ratios:
        rt = Table(title="cross-device ratios t(b) / t(a): measured vs predicted")
        for col in ("a", "b", "op class", "n", "measured", "predicted", "median |err|", "p90 |err|",
                    "faster side agrees"):
            rt.add_column(col, justify="left" if col in ("a", "b", "op class") else "right")
        for r in result.ratios:
            rt.add_row(r.device_a, r.device_b, r.op_class, str(r.count), f"{r.measured_median:.3g}",
                       f"{r.predicted_median:.3g}", f"{r.stats.median_abs:.1%}", f"{r.stats.p90_abs:.1%}",
                       f"{r.faster_side_agreement:.0%}")
        _out.print(rt)
    _out.print("err = predicted / measured - 1; ratio columns are medians over the pairs")
    for device, n in result.references.items():
        _out.print(f"{device}: reference of {n} shape-less kernels (their times fix each kernel's size; not "
                   "predicted themselves)")
    if result.unpaired:
        _out.print(f"{len(result.unpaired)} shape-less kernels measured on one device only (nothing to predict "
                   f"them from), e.g. {result.unpaired[0]}")
    if result.excluded:
        _out.print(f"{len(result.excluded)} left out, e.g. {result.excluded[0]}")
    if fit is not None:
        _out.print(f"time factors written to {fit} (take them with --factors {fit})")
    if plot is not None:
        _out.print(f"plot written to {plot}")


def register(app: typer.Typer) -> None:
    """Add the validate command to the main CLI."""
    app.command()(validate)
