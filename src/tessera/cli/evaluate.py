"""`tessera evaluate`: the evaluation suite (:mod:`tessera.evaluation.suite`) as a markdown report with plots."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

import typer

from tessera.cli.outputs import check_output_folder, make_folder
from tessera.console import err as _err
from tessera.console import fail as _fail
from tessera.console import out as _out
from tessera.errors import TesseraError
from tessera.limits import CPU_WORKERS


def evaluate(
    output: Path = typer.Option(Path("docs/results"), "--output", "-o", help="Folder for README.md (the "
                                "report), results.json and the plots."),
    only: list[str] = typer.Option(None, "--only", help="Run only this section (repeatable): offline "
                                   "(with throughput per cost), online, clusters, network, two-gpus."),
    quick: bool = typer.Option(False, "--quick", help="A tiny suite (smollm2-135m on A100+L40S, small "
                               "workloads, the policies without a MILP search) that checks the pipeline."),
    models: str = typer.Option(None, "--models", help="Comma-separated models for the offline, two-gpus "
                               "(and, with --quick, every) section, instead of the defaults."),
    pairs: str = typer.Option(None, "--pairs", help="Comma-separated GPU pairs such as A100+L40S,B200+H100."),
    policies: str = typer.Option(None, "--policies", help="Comma-separated policies to plan (default: all of "
                                 "them; --quick: those without a MILP search)."),
    online_requests: int = typer.Option(None, "--online-requests", help="Requests per online simulation "
                                        "(default 200; 24 with --quick)."),
    budget: float = typer.Option(None, "--budget", help="No item of the suite starts after this many "
                                 "seconds (default 720); items left out are listed in the report."),
    prices: str = typer.Option("relative", "--prices", help="relative (published relative prices) or "
                               "cloud_usd (estimated $/h)."),
    jobs: int = typer.Option(None, "--jobs", "-j", help="Worker processes (default: 2, or 1 on a one-core "
                             "machine); with one, --verbose also prints the planner's progress lines."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also print the planner's progress lines "
                                 "(with --jobs 1)."),
) -> None:
    """Evaluate every policy on the evaluation models, GPU pairs, clusters and networks (plan + simulate) and
    write a markdown report with plots; every GPU figure is predicted by the cost model."""
    from tessera.evaluation.config import SuiteConfig, check_sections
    from tessera.evaluation.report import write_report
    from tessera.evaluation.suite import run_suite

    t0 = time.perf_counter()
    try:
        check_output_folder(output, "--output")  # before the suite's minutes of work
        sections = check_sections(only)
        overrides = {}
        if models:
            overrides["models"] = tuple(m.strip() for m in models.split(",") if m.strip())
        if pairs:
            overrides["pairs"] = tuple(p.strip() for p in pairs.split(",") if p.strip())
        if policies:
            overrides["policies"] = tuple(p.strip() for p in policies.split(",") if p.strip())
        if online_requests is not None:
            overrides["online_requests"] = online_requests
        if budget is not None:
            overrides["budget_s"] = budget
        overrides["prices"] = prices
        if quick:
            config = SuiteConfig.quick(**overrides)
        else:
            config = SuiteConfig(**overrides)
        config.check()
        if jobs is None:
            jobs = min(2, os.cpu_count() or 1)
        CPU_WORKERS.check(jobs, "--jobs")  # each job is a worker process, like a cpu worker
        result = run_suite(config, sections, progress=lambda s: _err.print(s, highlight=False, markup=False),
                           detail=(lambda s: _err.print(f"  {s}", style="dim", markup=False)) if verbose else None,
                           jobs=jobs)
        make_folder(output, "--output")
        written = write_report(result, output, _command(output, only, quick, models, pairs, policies,
                                                        online_requests, budget, prices))
    except TesseraError as e:
        _fail(e)
    _out.print(f"report written to {written['README.md']} ({len(written) - 2} plots, results.json) in "
               f"{time.perf_counter() - t0:.0f} s; every GPU figure in it is predicted", highlight=False)
    for item in result.skipped:
        _out.print(f"  skipped for the time budget: {item}", highlight=False)


def _command(output: Path, only, quick, models, pairs, policies, online_requests, budget, prices) -> str:
    """The command line that regenerates this report (the options that were given)."""
    parts = [".venv/bin/tessera", "evaluate", "-o", str(output)]
    for name in only or []:
        parts += ["--only", name]
    if quick:
        parts.append("--quick")
    for flag, value in (("--models", models), ("--pairs", pairs), ("--policies", policies),
                        ("--online-requests", online_requests), ("--budget", budget)):
        if value is not None:
            parts += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    if prices != "relative":
        parts += ["--prices", prices]
    return shlex.join(parts)


def register(app: typer.Typer) -> None:
    """Add the evaluate command to the main CLI."""
    app.command()(evaluate)
