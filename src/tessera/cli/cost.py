"""`tessera estimate` (predicted step time on one device), `tessera census` (which device each kernel is
faster on) and `tessera calibrate` (fit this host's CPU factors)."""

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
from tessera.errors import TesseraError


def _seconds(t: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t * 1e9:.3g} ns"


def estimate(
    model: str = opt.MODEL,
    device: str = typer.Option(..., "--device", "-d", help="Device id or alias (see `tessera devices`); cpu[:N] "
                               "is this host (N workers share its cores)."),
    phase: str = opt.PHASE,
    batch: int = opt.BATCH,
    seq: int = opt.SEQ,
    ctx: int = opt.CTX,
    image: str = opt.IMAGE,
    resolution: str = opt.RESOLUTION,
    weights_dtype: str = opt.WEIGHTS_DTYPE,
    kv_dtype: str = opt.KV_DTYPE,
    eager: bool = opt.EAGER,
    profile: Path = typer.Option(None, "--profile", help="A profile measured on DEVICE (`tessera profile`): its "
                                 "kernel times replace the roofline's."),
    factors: Path = opt.FACTORS,
    graph_kind: str = opt.GRAPH,
    as_json: bool = opt.JSON,
) -> None:
    """Predict one step's time on one device, with its breakdown by op class and block."""
    from tessera.capture.api import trace_model
    from tessera.cost.model import CostModel, memory_footprint
    from tessera.cost.options import CostOptions
    from tessera.cost.profile import Profile
    from tessera.graph.summary import summarize
    from tessera.hardware.devices import resolve_device

    try:
        spec = resolve_device(device)
        options = CostOptions(weights_dtype=weights_dtype, kv_dtype=kv_dtype, cuda_graphs=not eager,
                              factors=opt.load_factors(factors))
        prof = Profile.load(profile) if profile else None
        with _err.status(f"tracing {model} {phase} and estimating on {spec.id}..."):
            graph = trace_model(model, phase, batch=batch, seq=seq, ctx=ctx, image=image, resolution=resolution,
                                graph=graph_kind)
            cm = CostModel(spec, options, prof)
            est = cm.estimate(graph)
    except TesseraError as e:
        _fail(e)
    shape = summarize(graph)["shape"]
    mem = memory_footprint(graph, options)
    result = {"model": graph.model, "phase": graph.phase, "shape": shape, "device": spec.id,
              "options": {"weights_dtype": weights_dtype, "kv_dtype": kv_dtype, "cuda_graphs": not eager},
              "predicted": est.measured < len(est.kernels), "measured_kernels": est.measured,
              "kernels": len(est.kernels), "step_time_s": est.step_time_s,
              "by_class": est.by("cost_class", graph), "by_block": est.by("block", graph),
              "bound": {b: sum(c.bound == b for c in est.kernels) for b in ("compute", "memory", "latency", "measured")},
              "memory": {"weight_bytes": mem.weight_bytes, "state_bytes": mem.state_bytes,
                         "device_bytes": spec.memory_bytes, "fits": mem.total_bytes <= spec.memory_bytes},
              "factors": cm.efficiency.source}
    if as_json:
        print(json.dumps(result, indent=2))
        return
    label = "predicted" if est.measured == 0 else f"{est.measured} of {len(est.kernels)} kernels measured, rest predicted"
    shape_txt = ", ".join(f"{k} {v}" for k, v in shape.items())
    table = Table(title=f"{graph.model} {graph.phase} ({shape_txt}) on {spec.id} - {label}")
    for col in ("op class", "kernels", "time", "share"):
        table.add_column(col, justify="left" if col == "op class" else "right")
    for cls, row in result["by_class"].items():
        table.add_row(cls, str(row["kernels"]), _seconds(row["time_s"]), f"{row['share']:.1%}")
    table.add_row("[bold]step", f"[bold]{len(est.kernels)}", f"[bold]{_seconds(est.step_time_s)}", "100%")
    _out.print(table)
    blocks = ", ".join(f"{b} {_seconds(r['time_s'])} ({r['share']:.0%})" for b, r in result["by_block"].items())
    bounds = ", ".join(f"{n} {b}" for b, n in result["bound"].items() if n)
    _out.print(f"step_time {_seconds(est.step_time_s)} ({label}); by block: {blocks}; kernels bound by: {bounds}")
    _out.print(f"factors: {cm.efficiency.source}")
    if mem.total_bytes > spec.memory_bytes:
        _err.print(f"[bold yellow]warning:[/] weights ({mem.weight_bytes / 1e9:.1f} GB) and state "
                   f"({mem.state_bytes / 1e9:.1f} GB) exceed one {spec.id}'s {spec.memory_bytes / 1e9:.0f} GB: the step "
                   "cannot run on a single device; the time assumes it could (a plan splits it across devices)")


def _wxh(size: list[int] | None) -> str | None:
    return f"{size[0]}x{size[1]}" if size else None


def calibrate(
    profiles: list[Path] = typer.Argument(..., help="Profiles measured on this host (`tessera profile --device cpu`)."),
    output: Path = typer.Option(None, "--output", "-o", help="Where to write the factors (default: this host's "
                                "factors file in the Tessera cache, which `estimate --device cpu` reads)."),
) -> None:
    """Fit this host's per-class CPU factors on measured profiles."""
    from tessera.capture.api import trace_model
    from tessera.cost.cpu_calibration import fit_host, relative_errors, samples
    from tessera.cost.efficiency import host_factors_file, save_factors
    from tessera.cost.profile import Profile
    from tessera.hardware.host import host_spec

    try:
        check_output_file(output, "--output", "factors.json")
        rows = []
        threads: set[int | None] = set()
        for p in profiles:
            prof = Profile.load(p)
            if prof.device != "cpu":
                raise TesseraError(f"{p}: measured on {prof.device}; calibrate fits the CPU from CPU profiles")
            threads.add(prof.threads)
            if len(threads) > 1:
                raise TesseraError(f"{p}: measured with {prof.threads} threads, the others with "
                                   f"{sorted(t for t in threads if t != prof.threads)}: fit one thread count at a time")
            sh = prof.shape
            with _err.status(f"retracing {prof.model} {prof.phase} for {p.name}..."):
                graph = trace_model(prof.model, prof.phase, batch=sh.get("batch"), seq=sh.get("seq"),
                                    ctx=sh.get("ctx"), image=_wxh(sh.get("image")),
                                    resolution=_wxh(sh.get("resolution")))
            rows += samples(graph, prof)
        device = host_spec(threads.pop())
        factors = fit_host(rows, device)
        target = output or host_factors_file()
        write_output(target, "--output", lambda path: save_factors(factors, path), "factors.json")
    except TesseraError as e:
        _fail(e)
    errs = relative_errors(rows, device, factors)
    table = Table(title=f"CPU factors fitted on {len(rows)} kernels ({device.threads} threads)")
    for col in ("class", "kernels", "overhead", "compute eff", "memory eff", "median |err|"):
        table.add_column(col, justify="left" if col == "class" else "right")
    for cls in factors.fitted:
        e = factors.classes[cls]
        table.add_row(cls, str(len(errs[cls])), _seconds(e.overhead_s or 0), f"{e.compute:.3f}", f"{e.memory:.3f}",
                      f"{sorted(errs[cls])[len(errs[cls]) // 2]:.1%}")
    _out.print(table)
    _out.print(f"written to {target}")


def census(
    model: str = opt.MODEL,
    devices: str = typer.Option(..., "--devices", help="Exactly two devices, comma separated (e.g. A100,L40S); "
                                "ratios are t(second) / t(first) and step-time shares use the first's time."),
    phases: list[str] = typer.Option(None, "--phase", "-p", help="A phase to include (repeatable; default: every "
                                     "phase of the model's family, each at its default shapes)."),
    batch: int = opt.BATCH,
    seq: int = opt.SEQ,
    ctx: int = opt.CTX,
    image: str = opt.IMAGE,
    resolution: str = opt.RESOLUTION,
    weights_dtype: str = opt.WEIGHTS_DTYPE,
    kv_dtype: str = opt.KV_DTYPE,
    eager: bool = opt.EAGER,
    plot: Path = typer.Option(None, "--plot", help="Where to write the ratio-CDF PNG (default without --json: "
                              "census_<model>_<devA>_<devB>.png in the current directory; with --json: none)."),
    plot_by: str = typer.Option("phase", "--plot-by", help="One CDF curve per phase, class or block."),
    no_plot: bool = typer.Option(False, "--no-plot", help="Do not write the PNG."),
    factors: Path = opt.FACTORS,
    graph_kind: str = opt.GRAPH,
    as_json: bool = opt.JSON,
) -> None:
    """Which kernels are predicted faster on each of two devices: shares by class, block and phase, and a plot."""
    import re

    from tessera.cost.census import census_phases, parse_devices, run_census
    from tessera.cost.options import CostOptions
    from tessera.report.plots import PLOT_GROUPS, PlotError, census_ratio_cdf

    try:
        if plot_by not in PLOT_GROUPS:
            raise PlotError(f"--plot-by {plot_by!r} is not a grouping; use one of {', '.join(PLOT_GROUPS)}")
        check_output_file(plot, "--plot", "census.png")
        chosen = census_phases(model, phases)  # model and phases are checked before anything is traced
        spec_a, spec_b = parse_devices(devices)
        options = CostOptions(weights_dtype=weights_dtype, kv_dtype=kv_dtype, cuda_graphs=not eager,
                              factors=opt.load_factors(factors))
        with _err.status(f"tracing {model}...") as status:
            result = run_census(model, (spec_a, spec_b), chosen, options=options, batch=batch, seq=seq, ctx=ctx,
                                image=image, resolution=resolution, graph=graph_kind,
                                progress=lambda p: status.update(f"tracing {model} {p} and predicting on "
                                                                 f"{spec_a.id} and {spec_b.id}..."))
        target = None
        if not no_plot and (plot is not None or not as_json):  # --json prints; it writes only what --plot asks
            safe = re.sub(r"[^A-Za-z0-9._-]+", "-", result.model).strip("-") or "model"
            path = plot or Path(f"census_{safe}_{spec_a.id}_{spec_b.id}.png")
            target = write_output(path, "--plot", lambda png: census_ratio_cdf(result, png, plot_by), "census.png")
    except TesseraError as e:
        _fail(e)
    a, b = result.device_a, result.device_b
    if as_json:
        print(json.dumps(result.to_dict() | {"plot": str(target) if target else None}, indent=2))
        return
    shapes = "; ".join(f"{p}: " + ", ".join(f"{k} {v}" for k, v in s.items()) for p, s in result.shapes.items())
    _out.print(f"{result.model} census, {a} vs {b} - every time predicted by the cost model ({shapes}; weights "
               f"{options.describe_weights()}, KV {kv_dtype}, {'eager launches' if eager else 'CUDA graphs'})")
    equal = result.overall.kernels_equal > 0
    for title, rows in (("by phase", result.by_phase), ("by cost class", result.by_class),
                        ("by block", result.by_block)):
        table = Table(title=f"{result.model}: kernels predicted faster on {a} or {b}, {title}")
        cols = ["group", "kernels", f"kernels -> {a}", f"kernels -> {b}"] + (["equal"] if equal else []) + \
            [f"time -> {a}", f"time -> {b}", f"median t({b})/t({a})"]
        for col in cols:
            table.add_column(col, justify="left" if col == "group" else "right")
        for name, s in [*rows.items(), ("[bold]all", result.overall)]:
            table.add_row(name, str(s.kernels), f"{s.kernel_share('a'):.1%}", f"{s.kernel_share('b'):.1%}",
                          *([f"{s.kernel_share('equal'):.1%}"] if equal else []),
                          f"{s.time_share('a'):.1%}", f"{s.time_share('b'):.1%}", f"{s.ratios.median:.3g}")
        _out.print(table)
    _out.print(f"kernels -> X: share of the kernels predicted faster on X; time -> X: share of the predicted step "
               f"time on {a} (the first device) that those kernels carry.")
    for p, t in result.step_time_s.items():
        _out.print(f"predicted step time, {p}: {a} {_seconds(t[a])}, {b} {_seconds(t[b])} "
                   f"(t({b})/t({a}) = {t[b] / t[a]:.3g})")
    if target:
        _out.print(f"plot (predicted ratio CDF by {plot_by}) written to {target}")


def register(app: typer.Typer) -> None:
    """Add the cost commands to the main CLI."""
    app.command()(estimate)
    app.command()(calibrate)
    app.command()(census)
