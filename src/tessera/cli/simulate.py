"""`tessera simulate`: serve a workload with one policy's deployment in the cluster simulator."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from tessera.cli import options as opt
from tessera.console import err as _err
from tessera.console import fail as _fail
from tessera.console import out as _out
from tessera.errors import TesseraError
from tessera.sched.scheduler import DEFAULT_MAX_CONTEXT


def _s(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def simulate(
    model: str = opt.MODEL,
    cluster: str = typer.Option(..., "--cluster", help="Devices: shorthand such as A100:1,L40S:1 or a cluster "
                                "YAML file (see `tessera devices --cluster`)."),
    workload: str = typer.Option(None, "--workload", "-w", help="fixed:in=..,out=..,requests=.. | "
                                 "poisson:rate=..,lengths=azure-conv|FILE[,requests=N] | images:steps=..,"
                                 "resolution=.. (default fixed:in=1024,out=1024,requests=192; "
                                 "images:steps=28,resolution=1024 for diffusion)."),
    policy: str = typer.Option("tessera", "--policy", help="homogeneous | request-dist | prefill-decode | "
                               "attention-ffn | layer-pipeline | tessera."),
    device: str = typer.Option(None, "--device", "-d", help="homogeneous: the device type (default: the only one)."),
    plan_file: Path = typer.Option(None, "--plan", help="Simulate this plan file (from `tessera plan -o`) "
                                   "instead of planning --policy."),
    max_batch: int = typer.Option(None, "--max-batch", help="Most sequences (images) in flight per replica "
                                  "(default 64; 4 for diffusion)."),
    max_context: int = typer.Option(DEFAULT_MAX_CONTEXT, "--max-context", help="Longest prompt + output a "
                                    "request may have; longer ones are rejected."),
    seed: int = typer.Option(0, "--seed", help="Seed of the arrivals and lengths of a poisson workload."),
    prices: str = typer.Option("relative", "--prices", help="relative or cloud_usd."),
    weights_dtype: str = opt.WEIGHTS_DTYPE,
    kv_dtype: str = opt.KV_DTYPE,
    skew: float = typer.Option(0.0, "--routing-skew", help="MoE routing skew (Zipf exponent; 0 = uniform)."),
    as_json: bool = opt.JSON,
) -> None:
    """Simulate serving a workload: the planned deployment's steps timed by running its device programs
    against the cost model, requests batched by the serving scheduler (every figure is predicted)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tessera.cli.plan import make_context
    from tessera.plan.deployment import DeploymentPlan, PlanFileError
    from tessera.plan.planner import plan_policy
    from tessera.plan.policies import check_policy
    from tessera.sim.requests import simulate as run_simulation

    try:
        check_policy(policy)
        if max_context < 1:
            raise TesseraError(f"--max-context must be at least 1 (got {max_context})")
        ctx = make_context(model, cluster, workload, max_batch, prices, weights_dtype, kv_dtype, skew)
        if plan_file is not None:
            plan = DeploymentPlan.load(plan_file)
            if plan.model != model:
                raise PlanFileError(f"plan file {plan_file} is for {plan.model}, not {model}; plan {model} again")
        else:
            _err.print(f"[dim]planning {policy} for {model} on {ctx.cluster.describe()} ({ctx.workload_text})[/]")
            plan = plan_policy(ctx, policy, "throughput", device)
        with Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=_err, transient=True, disable=as_json) as bar:
            task = bar.add_task("requests", total=None)
            result = run_simulation(ctx, plan, seed, max_context=max_context,
                                    progress=lambda done, total: bar.update(task, completed=done, total=total))
    except TesseraError as e:
        _fail(e)
    summary = result.summary()
    summary.update(predicted_throughput=plan.throughput, cluster=ctx.cluster.describe(), device=plan.device)
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    per = "token" if result.unit == "tokens/s" else "image"
    table = Table(title=f"{model} on {ctx.cluster.describe()}, {plan.policy}"
                        f"{f' ({plan.device})' if plan.device else ''}\n{ctx.workload_text} (simulated, predicted "
                        "GPU times)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("throughput", f"{result.throughput:,.4g} {result.unit}")
    table.add_row("planner's estimate (cost model, no DES)", f"{plan.throughput:,.4g} {result.unit}")
    table.add_row("completed / rejected", f"{result.completed} / {result.rejected}")
    table.add_row("makespan", _s(result.makespan_s))
    table.add_row("TTFT p50 / p99" if per == "token" else "latency p50 / p99",
                  f"{_s(summary['ttft_p50_s'])} / {_s(summary['ttft_p99_s'])}")
    if per == "token":
        table.add_row("TPOT p50 / p99", f"{_s(summary['tpot_p50_s'])} / {_s(summary['tpot_p99_s'])}")
    table.add_row(f"normalised latency (per {per})", _s(result.norm_latency_s))
    table.add_row("steps", f"{result.steps:,}")
    for lane, busy in result.lane_busy_s.items():
        table.add_row(f"busy: {lane}", f"{busy / result.makespan_s:.0%}" if result.makespan_s > 0 else "-")
    _out.print(table)
    for line in result.rejections:
        _out.print(f"  rejected: {line}")


def register(app: typer.Typer) -> None:
    """Add the simulate command to the main CLI."""
    app.command()(simulate)
