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
from tessera.plan.config import LATENCY_BUCKET, AdmissionConfig, PlanConfig
from tessera.sim.config import SimulationConfig

_SIM = SimulationConfig(PlanConfig(model="", cluster=""))


def _s(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def simulate(
    model: str = opt.MODEL,
    cluster: str = opt.CLUSTER,
    workload: str = opt.WORKLOAD,
    policy: str = opt.POLICY,
    device: str = opt.DEVICE,
    plan_file: Path = typer.Option(None, "--plan", help="Simulate this plan file (from `tessera plan -o`) "
                                   "instead of planning --policy."),
    max_batch: int = opt.MAX_BATCH,
    max_num_seqs: int = opt.MAX_NUM_SEQS,
    memory_utilization: float = opt.MEMORY_UTILIZATION,
    block_size: int = opt.BLOCK_SIZE,
    max_context: int = typer.Option(_SIM.max_context, "--max-context", help="Longest prompt + output a "
                                    "request may have; longer ones are rejected."),
    seed: int = typer.Option(_SIM.seed, "--seed", help="Seed of the arrivals and lengths of a poisson workload."),
    prices: str = opt.PRICES,
    weights_dtype: str = opt.WEIGHTS_DTYPE,
    kv_dtype: str = opt.KV_DTYPE,
    skew: float = opt.ROUTING_SKEW,
    engine_shapes: bool = typer.Option(True, "--engine-shapes/--static-shapes", help="Run steps at their own "
                                       "rows, prompt and context, as a serving engine does (default), or padded "
                                       "to the power-of-two buckets `tessera serve` traces."),
    engine: str = typer.Option("tessera", "--engine", help="The serving engine to simulate: tessera (Tessera's "
                               "own runtime: kernel-level programs, its scheduler) or vllm (the plan's engines as "
                               "vLLM schedules them: chunked prefill and decodes under one token budget)."),
    step_times: Path = typer.Option(None, "--step-times", help="With --engine vllm: every engine steps as this "
                                    "measured engine does (a file from `tessera profile-engine -o`), instead of "
                                    "the cost model's prediction for its device."),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", help="With --engine vllm: the "
                                               "token budget of one engine step (vLLM's default for its OpenAI "
                                               "server on a CPU and on GPUs under 70 GB)."),
    shares: str = typer.Option(None, "--shares", help="With --engine vllm: the router's route shares, as `tessera "
                               "serve --engine vllm --shares` (auto, the default | throughput | latency)."),
    monitor: bool = typer.Option(False, "--monitor/--no-monitor", help="Switch between the plan's throughput "
                                 "and latency step plans as `tessera serve`'s online monitor does (its default "
                                 "settings; latency plans added where the plan has none), instead of running "
                                 "the throughput plans throughout."),
    latency_rows: int = typer.Option(None, "--latency-rows", help="With --monitor: requests in flight while the "
                                     f"latency plans run (as `tessera serve --latency-rows`; default {LATENCY_BUCKET})."),
    factors: Path = opt.FACTORS,
    as_json: bool = opt.JSON,
) -> None:
    """Simulate serving a workload: the planned deployment's steps timed by running its device programs
    against the cost model, requests batched by the serving scheduler (every figure is predicted); or, with
    --engine vllm, the plan's vLLM engines, their steps timed from measured or predicted step times."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tessera.cost.options import CostOptions
    from tessera.sim.requests import simulate as run_simulation

    try:
        config = SimulationConfig(PlanConfig(model, cluster, workload, policy, device=device, max_batch=max_batch,
                                             prices=prices, cost=CostOptions(weights_dtype, kv_dtype,
                                                                               factors=opt.load_factors(factors)),
                                             routing_skew=skew,
                                             admission=AdmissionConfig(max_num_seqs, memory_utilization, block_size)),
                                  plan_file, max_context, seed)
        _check_engine(engine, step_times, max_num_batched_tokens, shares)
        _check_monitor(engine, monitor, latency_rows)
        ctx, plan = config.deployment(progress=lambda s: _err.print(f"[dim]{s}[/]"))
        if engine == "vllm":
            _simulate_vllm(ctx, plan, config, step_times, max_num_batched_tokens, shares or "auto", as_json)
            return
        with Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=_err, transient=True, disable=as_json) as bar:
            task = bar.add_task("requests", total=None)
            switching = None
            if monitor:
                from tessera.plan.objective_steps import add_objective_steps
                from tessera.sched.monitor import Monitor

                add_objective_steps(ctx, plan, "latency")
                switching = Monitor()
            result = run_simulation(ctx, plan, seed, max_context=max_context, engine_shapes=engine_shapes,
                                    progress=lambda done, total: bar.update(task, completed=done, total=total),
                                    monitor=switching, latency_rows=latency_rows or LATENCY_BUCKET)
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
    table.add_row("preemptions (KV blocks ran out)", f"{result.preemptions:,}")
    if monitor:
        table.add_row("objective switches (online monitor)", f"{result.switches:,}")
    for lane, busy in result.lane_busy_s.items():
        table.add_row(f"busy: {lane}", f"{busy / result.makespan_s:.0%}" if result.makespan_s > 0 else "-")
    _out.print(table)
    for line in result.rejections:
        _out.print(f"  rejected: {line}")


def _check_monitor(engine: str, monitor: bool, latency_rows: int | None) -> None:
    from tessera.sim.requests import SimulationSetupError

    if monitor and engine != "tessera":
        raise SimulationSetupError("--monitor switches Tessera's own engine between its plans; the vLLM simulator "
                                   "follows the router's shares (--shares): leave --monitor out")
    if latency_rows is not None and not monitor:
        raise SimulationSetupError("--latency-rows caps the latency plans the monitor switches to: give it with "
                                   "--monitor")
    if latency_rows is not None and latency_rows < 1:
        raise SimulationSetupError(f"--latency-rows must be at least 1 (got {latency_rows})")


def _check_engine(engine: str, step_times: Path | None, max_num_batched_tokens: int, shares: str | None) -> None:
    from tessera.plan.shares import SHARE_MODES
    from tessera.sim.vllm_engines import VLLMSimulationError

    if engine not in ("tessera", "vllm"):
        raise VLLMSimulationError(f"--engine must be tessera or vllm (got {engine!r})")
    for name, given in (("--step-times", step_times), ("--shares", shares)):
        if engine == "tessera" and given is not None:
            raise VLLMSimulationError(f"{name} is an option of the vLLM simulator: give it with --engine vllm")
    if shares is not None and shares not in SHARE_MODES:
        raise VLLMSimulationError(f"--shares must be one of {', '.join(SHARE_MODES)} (got {shares!r})")
    if max_num_batched_tokens < 1:
        raise VLLMSimulationError(f"--max-num-batched-tokens must be at least 1 (got {max_num_batched_tokens})")


def _simulate_vllm(ctx, plan, config: SimulationConfig, step_times: Path | None, max_num_batched_tokens: int,
                   shares: str, as_json: bool) -> None:
    """`tessera simulate --engine vllm`: the plan's engines under vLLM's scheduling; prints the summary."""
    from tessera.cost.engine_steps import EngineStepTimes
    from tessera.sim.vllm_deployment import share_switch, vllm_engines
    from tessera.sim.vllm_engines import simulate_vllm
    from tessera.workload import draw_requests

    measured = EngineStepTimes.load(step_times) if step_times is not None else None
    engines, routes = vllm_engines(ctx, plan, measured, max_num_batched_tokens,
                                   progress=lambda s: _err.print(f"[dim]{s}[/]"))
    result = simulate_vllm(engines, routes, draw_requests(ctx.workload, config.seed), share_switch(plan, shares))
    summary = result.summary()
    summary.update(model=plan.model, policy=plan.policy, workload=ctx.workload_text, engine="vllm",
                   cluster=ctx.cluster.describe(), step_times=str(step_times) if step_times else "predicted")
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    where = f"measured ({measured.device or measured.source})" if measured else "predicted by the cost model"
    table = Table(title=f"{plan.model} on {ctx.cluster.describe()}, {plan.policy} on vLLM engines\n"
                        f"{ctx.workload_text} (simulated; step times {where})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("throughput", f"{summary['throughput'] or 0:,.4g} tokens/s")
    table.add_row("completed", f"{summary['completed']}")
    table.add_row("makespan", _s(summary["duration_s"]))
    table.add_row("TTFT p50 / p99", f"{_s(summary['ttft_p50_s'])} / {_s(summary['ttft_p99_s'])}")
    table.add_row("TPOT p50 / p99", f"{_s(summary['tpot_p50_s'])} / {_s(summary['tpot_p99_s'])}")
    table.add_row("steps", f"{summary['steps']:,}")
    table.add_row("preemptions (KV blocks ran out)", f"{summary['preemptions']:,}")
    for e in engines:
        table.add_row(f"busy: {e.name}", f"{e.busy_s / summary['duration_s']:.0%}" if summary["duration_s"] else "-")
    _out.print(table)


def register(app: typer.Typer) -> None:
    """Add the simulate command to the main CLI."""
    app.command()(simulate)
