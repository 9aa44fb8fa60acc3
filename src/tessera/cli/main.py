"""The `tessera` command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.table import Table

from tessera.cli import options as opt
from tessera.cli.outputs import check_output_file, write_output
from tessera.console import err, out, print_error
from tessera.console import fail as _fail
from tessera.errors import TesseraError

app = typer.Typer(help="Tessera: kernel-granularity disaggregated serving on heterogeneous GPUs.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _mount_subcommands() -> None:
    from tessera.cli.cost import register as register_cost
    from tessera.cli.devices import register as register_hardware
    from tessera.cli.engines import register as register_engines
    from tessera.cli.evaluate import register as register_evaluate
    from tessera.cli.plan import register as register_plan
    from tessera.cli.ptx import ptx_app
    from tessera.cli.run import register as register_run
    from tessera.cli.serve import register as register_serve
    from tessera.cli.simulate import register as register_simulate
    from tessera.cli.validate import register as register_validate

    app.add_typer(ptx_app, name="ptx", help="Analyse and instrument PTX of opaque kernels.")
    register_hardware(app)
    register_cost(app)
    register_validate(app)
    register_plan(app)
    register_run(app)
    register_simulate(app)
    register_evaluate(app)
    register_serve(app)
    register_engines(app)


_mount_subcommands()


def _human(n: float, unit: str = "") -> str:
    for prefix in ("", "K", "M", "G", "T", "P", "E"):
        if abs(n) < 1000:
            return f"{n:.3g} {prefix}{unit}".strip()
        n /= 1000
    return f"{n:.3g} Z{unit}"


@app.command()
def models(as_json: bool = typer.Option(False, "--json", help="Print the catalog as JSON.")) -> None:
    """List the model catalog (any local Hugging Face model directory works too)."""
    from tessera.capture.models import list_models
    from tessera.capture.shapes import PHASES

    rows = [{"name": m.name, "family": m.family, "class": m.hf_class, "params": m.params, "source": m.source,
             "phases": list(PHASES[m.family])} for m in list_models()]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="Tessera model catalog")
    for col in ("name", "family", "class", "parameters", "phases", "source"):
        table.add_column(col, justify="right" if col == "parameters" else "left")
    for r in rows:
        table.add_row(r["name"], r["family"], r["class"], f"{r['params']:,}" if r["params"] else "-",
                      ", ".join(r["phases"]), r["source"])
    out.print(table)
    out.print("Any local Hugging Face model directory (with config.json) is accepted as MODEL too.")


@app.command()
def trace(
    model: str = opt.MODEL,
    phase: str = opt.PHASE,
    batch: int = opt.BATCH,
    seq: int = opt.SEQ,
    ctx: int = opt.CTX,
    image: str = opt.IMAGE,
    resolution: str = opt.RESOLUTION,
    device: str = typer.Option("meta", "--device", help="meta (no memory, any size) or cpu (random weights)."),
    output: Path = typer.Option(None, "--output", "-o", help="Write the versioned graph JSON here (missing "
                                "folders are created)."),
    graph_kind: str = opt.GRAPH,
    as_json: bool = opt.JSON,
) -> None:
    """Trace one model step into a KernelGraph and print its summary (and which parts fell back to eager)."""
    from tessera.capture.api import trace_model
    from tessera.capture.models import resolve_model
    from tessera.graph.summary import summarize

    try:
        check_output_file(output, "--output", "graph.json")
        spec = resolve_model(model)
        with err.status(f"building {spec.name} on {device} and tracing its {phase} step..."):
            graph = trace_model(model, phase, batch=batch, seq=seq, ctx=ctx, image=image, resolution=resolution,
                                device=device, graph=graph_kind)
        if output:
            write_output(output, "--output", graph.save, "graph.json")
    except TesseraError as e:
        _fail(e)
    summary = summarize(graph)
    if output:
        summary["graph_file"] = str(output)
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    _print_summary(summary)


def _print_summary(s: dict) -> None:
    shape = ", ".join(f"{k} {v}" for k, v in s["shape"].items())
    table = Table(title=f"{s['model']} {s['phase']} ({shape}) - {s['graph_kind']} graph {s['hash']}")
    for col in ("op class", "kernels", "FLOPs", "bytes moved"):
        table.add_column(col, justify="left" if col == "op class" else "right")
    for cls, row in s["by_class"].items():
        table.add_row(cls, str(row["kernels"]), _human(row["flops"]), _human(row["bytes"], "B"))
    table.add_row("[bold]total", f"[bold]{s['kernels']}", f"[bold]{_human(s['flops'])}", "")
    out.print(table)
    out.print(f"weights {_human(s['weight_bytes'], 'B')}, activations {_human(s['activation_bytes'], 'B')}, "
              f"state {_human(s['state_bytes'], 'B')}, inputs {_human(s['input_bytes'], 'B')}; "
              f"{s['buffers']} buffers, {s['accesses']} accesses, edges {s['edges']}; "
              f"traced in {s['trace_seconds']:.3f} s" + (f"; graph written to {s['graph_file']}"
                                                         if "graph_file" in s else ""), highlight=False)
    for fallback in s["fallbacks"]:
        out.print(f"[yellow]fallback:[/] {fallback}", highlight=False)


@app.command()
def profile(
    model: str = opt.MODEL,
    phase: str = opt.PHASE,
    batch: int = opt.BATCH,
    seq: int = opt.SEQ,
    ctx: int = opt.CTX,
    image: str = opt.IMAGE,
    resolution: str = opt.RESOLUTION,
    device: str = typer.Option("cpu", "--device", help="cpu (all cores), cpu:N (one of N workers: cores//N "
                               "threads), cuda or cuda:I."),
    threads: int = typer.Option(None, "--threads", "-t", help="CPU threads (overrides the cpu:N default)."),
    warmup: int = typer.Option(3, "--warmup", help="Untimed calls of each kernel before timing."),
    repeats: int = typer.Option(10, "--repeats", "-r", help="Timed calls of each kernel (the median is kept)."),
    output: Path = typer.Option(..., "--output", "-o", help="Write the versioned profile JSON here (missing "
                                "folders are created)."),
) -> None:
    """Time every kernel of one model step on a real device and write the profile."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tessera.capture.families.diffusion import parse_resolution
    from tessera.capture.families.vlm import parse_image_size
    from tessera.capture.models import resolve_model
    from tessera.capture.phases import check_phase
    from tessera.runtime.profiler import check_counts, profile_model, resolve_target

    try:
        check_output_file(output, "--output", "profile.json")
        spec = resolve_model(model)  # the model name is checked before anything else
        check_phase(spec, phase)
        target = resolve_target(device, threads)
        check_counts(warmup, repeats)
        img = parse_image_size(image) if image else None
        res = parse_resolution(resolution) if resolution else None
        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       console=err, transient=True)
        with bar:
            task = bar.add_task(f"building and tracing {spec.name} {phase} on {target.torch_device}", total=None)

            def progress(done: int, total: int) -> None:
                bar.update(task, description=f"timing kernels on {target.id}", completed=done, total=total)

            prof, graph = profile_model(model, phase, batch=batch, seq=seq, ctx=ctx, image=img, resolution=res,
                                        device=device, threads=threads, warmup=warmup, repeats=repeats,
                                        progress=progress)
        write_output(output, "--output", prof.save, "profile.json")
    except TesseraError as e:
        _fail(e)
    shape = ", ".join(f"{k} {v}" for k, v in prof.shape.items())
    where = f"{prof.device}" + (f", {prof.threads} threads" if prof.threads else "")
    table = Table(title=f"{prof.model} {prof.phase} ({shape}) on {where}")
    for col in ("op class", "kernels", "median time", "share"):
        table.add_column(col, justify="left" if col == "op class" else "right")
    total = prof.total_s
    for cls, (n, seconds) in prof.by_op_class().items():
        table.add_row(cls, str(n), _duration(seconds), f"{100 * seconds / total:.1f}%" if total else "-")
    table.add_row("[bold]total", f"[bold]{len(prof.kernels)}", f"[bold]{_duration(total)}", "")
    out.print(table)
    out.print(f"{prof.device_name}; graph {prof.graph_hash}; {len(prof.by_signature())} distinct kernel "
              f"signatures; median of {prof.repeats} calls after {prof.warmup} warm-up calls each; profile "
              f"written to {output}", highlight=False)


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def main() -> None:  # pragma: no cover - console entry point
    try:
        app()
    except TesseraError as e:
        print_error(e)
        sys.exit(2)
