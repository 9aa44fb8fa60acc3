"""`tessera ptx ...`: analyse kernels' parameter accesses, and instrument PTX to record address ranges.

The main CLI mounts `ptx_app` as `tessera ptx`. Exit codes of `analyze`: 0 when at least one kernel
was analysed and nothing went wrong; 1 when something could not be analysed (syntax errors, a binary
without PTX, SASS-only kernels) though everything else is still printed; 2 when a file cannot be read.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from tessera.capture.ptx.analyze import analyze_ptx
from tessera.capture.ptx.extract import extract_ptx
from tessera.capture.ptx.instrument import instrument_ptx
from tessera.capture.ptx.results import KernelAccess
from tessera.cli.outputs import check_output_file, write_output
from tessera.console import out as _out
from tessera.console import print_error as _warn
from tessera.errors import TesseraError

ptx_app = typer.Typer(help="Analyse PTX kernels (which arguments they read and write) and instrument them.",
                      no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

_ACCESS_STYLE = {"none": "dim", "read": "green", "write": "yellow", "read-write": "bold red"}


def _sources(path: Path) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """([(name, PTX text)], problems, SASS-only kernels) of one input file; TesseraError/OSError if unreadable."""
    res = extract_ptx(path)
    return [(src.name, src.text) for src in res.ptx], list(res.errors), list(res.sass_only)


def _table(k: KernelAccess) -> Table:
    where = f"{k.file}" + (f", {k.target}" if k.target else "") + (f", line {k.line}" if k.line else "")
    title = f"{escape(k.name)}  [dim]({escape(where)})[/]"
    if k.indirect:
        title += "  [bold magenta]indirect[/]"
    table = Table(title=title, title_justify="left", show_lines=False)
    for col, kw in (("#", {"justify": "right"}), ("parameter", {"overflow": "fold"}), ("kind", {}), ("access", {}),
                    ("indirect", {}), ("reason", {"overflow": "fold"})):
        table.add_column(col, **kw)
    for p in k.params:
        style = _ACCESS_STYLE.get(p.access, "")
        table.add_row(str(p.index), escape(p.name), p.kind, f"[{style}]{p.access}[/]",
                      "yes" if p.indirect else "", escape(p.reason))
        for first, last, count, f in _field_runs(p.fields):
            fstyle = _ACCESS_STYLE.get(f.access, "")
            where = f"  +{first}" if count == 1 else f"  +{first}..+{last} ({count} fields)"
            table.add_row("", where, "field", f"[{fstyle}]{f.access}[/]", "yes" if f.indirect else "",
                          escape(f.reason))
    return table


def _field_runs(fields):
    """Runs of consecutive 8-byte fields with the same access, flag and reason: (first, last, count, field)."""
    runs: list[list] = []
    for f in fields:
        if runs:
            r = runs[-1]
            g = r[3]
            if f.offset == r[1] + 8 and (f.access, f.indirect, f.reason) == (g.access, g.indirect, g.reason):
                r[1] = f.offset
                r[2] += 1
                continue
        runs.append([f.offset, f.offset, 1, f])
    return [tuple(r) for r in runs]


@ptx_app.command()
def analyze(
    files: list[Path] = typer.Argument(..., help="PTX files, or CUDA binaries (.cubin, .fatbin, .o, .so, .a, "
                                                 "executables) to take the PTX from."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of kernels instead of tables."),
) -> None:
    """Which pointer arguments each kernel reads and writes (conservative: never under-reports)."""
    kernels: list[KernelAccess] = []
    errors = 0
    unreadable = 0
    for path in files:
        try:
            sources, problems, sass_only = _sources(path)
        except (TesseraError, OSError) as e:
            _warn(str(e))
            unreadable += 1
            continue
        for message in problems:
            _warn(message)
            errors += 1
        if not sources:
            listed = ", ".join(sass_only) if sass_only else "none found"
            _warn(f"{path}: contains no PTX to analyse; SASS-only kernels: {listed}")
            errors += 1
        elif sass_only:
            _warn(f"{path}: kernels present only as SASS (no PTX to analyse; treat them as reading and "
                  f"writing all their arguments): {', '.join(sass_only)}")
            errors += 1
        for name, text in sources:
            found, syntax = analyze_ptx(text, name)
            for e in syntax:
                _warn(str(e))
                errors += 1
            kernels.extend(found)
    if as_json:
        print(json.dumps([k.to_json() for k in kernels], indent=2))
    else:
        for k in kernels:
            _out.print(_table(k))
        if kernels:
            _out.print(f"{len(kernels)} kernel(s) analysed.")
    if unreadable:
        raise typer.Exit(2)
    if errors or not kernels:
        if not kernels and not errors:
            _warn("no kernels found")
        raise typer.Exit(1)


@ptx_app.command()
def instrument(
    file: Path = typer.Argument(..., help="A PTX file (or a binary holding exactly one PTX module)."),
    out: Path = typer.Option(..., "-o", "--output", help="Where to write the instrumented PTX."),
    as_json: bool = typer.Option(False, "--json", help="Print the instrumented and skipped sites as JSON."),
) -> None:
    """Record the first and last byte address of each global access (atom.min/max into an extra buffer)."""
    try:
        check_output_file(out, "--output", "kernels.ranges.ptx")
        sources, problems, sass_only = _sources(file)
    except (TesseraError, OSError) as e:
        _warn(str(e))
        raise typer.Exit(2) from None
    for message in problems:
        _warn(message)
    if len(sources) != 1:
        what = "no PTX" if not sources else f"{len(sources)} PTX modules"
        _warn(f"{file}: holds {what}; instrument needs exactly one (extract it to a .ptx file first)"
              + (f"; SASS-only kernels: {', '.join(sass_only)}" if sass_only else ""))
        raise typer.Exit(2)
    name, text = sources[0]
    try:
        result = instrument_ptx(text, name)
    except TesseraError as e:
        _warn(str(e))
        raise typer.Exit(1) from None
    try:
        write_output(out, "--output", lambda path: path.write_text(result.text), "kernels.ranges.ptx")
    except TesseraError as e:
        _warn(str(e))
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps({"output": str(out), "buffer_param": result.buffer_param, "sites": result.sites,
                          "skipped": result.skipped}, indent=2))
        return
    table = Table(title=f"instrumented sites -> {escape(str(out))} (buffer parameter {result.buffer_param})",
                  title_justify="left")
    for col in ("function", "line", "slot", "mode", "width", "params"):
        table.add_column(col, justify="right" if col in ("line", "slot", "width") else "left")
    for s in result.sites:
        table.add_row(escape(str(s.get("function", ""))), str(s.get("line", "")), str(s.get("slot", "")),
                      str(s.get("mode", "")), str(s.get("width", "")),
                      ", ".join(str(p) for p in s.get("params", [])))
    _out.print(table)
    if result.skipped:
        skipped = Table(title="not instrumented (treated conservatively)", title_justify="left")
        for col in ("function", "line", "reason"):
            skipped.add_column(col, overflow="fold")
        for s in result.skipped:
            skipped.add_row(escape(str(s.get("function", ""))), str(s.get("line", "")),
                            escape(str(s.get("reason", ""))))
        _out.print(skipped)
    _out.print(f"{len(result.sites)} site(s) instrumented, {len(result.skipped)} skipped.")
