"""The `tessera` command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from tessera.errors import TesseraError

app = typer.Typer(help="Tessera: kernel-granularity disaggregated serving on heterogeneous GPUs.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
out = Console()
err = Console(stderr=True, soft_wrap=True)  # errors are never wrapped: paths stay greppable


def _mount_subcommands() -> None:
    from tessera.capture.ptx.cli import ptx_app

    app.add_typer(ptx_app, name="ptx", help="Analyse and instrument PTX of opaque kernels.")


_mount_subcommands()


def _fail(e: Exception) -> None:
    err.print(f"[bold red]error:[/] {e}", highlight=False)
    raise typer.Exit(2)


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
    from tessera.capture.phases import PHASES

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
    model: str = typer.Argument(..., help="Catalog name (see `tessera models`) or a local HF model directory."),
    phase: str = typer.Option("decode", "--phase", "-p", help="prefill|decode (LLM, MoE, SSM); "
                              "encode|prefill|decode (VLM); encode|step|decode (diffusion)."),
    batch: int = typer.Option(None, "--batch", "-b", help="Batch size (default: 1 for prefill, 8 for decode)."),
    seq: int = typer.Option(None, "--seq", "-s", help="Prompt length of a prefill (default 512)."),
    ctx: int = typer.Option(None, "--ctx", "-c", help="KV-cache capacity bucket (default 2048)."),
    image: str = typer.Option(None, "--image", help="VLM image size WxH (default 504x504)."),
    resolution: str = typer.Option(None, "--resolution", help="Diffusion resolution N or WxH (default 1024)."),
    device: str = typer.Option("meta", "--device", help="meta (no memory, any size) or cpu (random weights)."),
    output: Path = typer.Option(None, "--output", "-o", help="Write the versioned graph JSON here."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Trace one model step into a KernelGraph and print its summary."""
    from tessera.capture.models import resolve_model
    from tessera.capture.phases import check_phase, make_step
    from tessera.capture.steps.diffusion import parse_resolution
    from tessera.capture.steps.vlm import parse_image_size
    from tessera.capture.trace import trace as run_trace
    from tessera.graph.summary import summarize

    try:
        spec = resolve_model(model)  # the model name is checked before anything else
        check_phase(spec, phase)
        if device not in ("meta", "cpu"):
            raise TesseraError(f"--device must be meta or cpu (got {device!r})")
        img = parse_image_size(image) if image else None
        res = parse_resolution(resolution) if resolution else None
        with err.status(f"building {spec.name} on {device} and tracing its {phase} step..."):
            step = make_step(model, phase, batch=batch, seq=seq, ctx=ctx, image=img, resolution=res,
                             device=device)
            graph = run_trace(step)
        if output:
            graph.save(output)
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
    table = Table(title=f"{s['model']} {s['phase']} ({shape}) - graph {s['hash']}")
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


def main() -> None:  # pragma: no cover - console entry point
    try:
        app()
    except TesseraError as e:
        err.print(f"[bold red]error:[/] {e}")
        sys.exit(2)
