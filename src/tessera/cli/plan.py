"""`tessera plan`: solve one policy's deployment plan, or compare every policy."""

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
from tessera.plan.config import AdmissionConfig, PlanConfig, PlanConfigError
from tessera.plan.problem import OBJECTIVES

_PLAN = PlanConfig(model="", cluster="")


def _ms(t: float) -> str:
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def plan(
    model: str = opt.MODEL,
    cluster: str = opt.CLUSTER,
    workload: str = opt.WORKLOAD,
    max_batch: int = opt.MAX_BATCH,
    max_num_seqs: int = opt.MAX_NUM_SEQS,
    memory_utilization: float = opt.MEMORY_UTILIZATION,
    block_size: int = opt.BLOCK_SIZE,
    policy: str = opt.POLICY,
    device: str = opt.DEVICE,
    objective: str = typer.Option(_PLAN.objective, "--objective", help=" | ".join(OBJECTIVES) + "."),
    compare: bool = typer.Option(False, "--compare", help="Solve and list every policy."),
    output: Path = typer.Option(None, "--output", "-o", help="Write the plan (JSON) here; a placement PNG is "
                                "written beside it (default with --compare and without --json: "
                                "tessera-plan.json); missing folders are created."),
    prices: str = opt.PRICES,
    weights_dtype: str = opt.WEIGHTS_DTYPE,
    kv_dtype: str = opt.KV_DTYPE,
    skew: float = opt.ROUTING_SKEW,
    cache_ctx: int = typer.Option(None, "--ctx", help="Trace every phase with this KV-cache context (what "
                                  "`tessera run` uses: prompt + max tokens rounded up to 64), not the workload's."),
    expert_split: bool = typer.Option(_PLAN.split_experts, "--expert-split/--no-expert-split", help="Let Tessera "
                                      "split MoE expert GEMMs over devices (the runtime does not execute such plans "
                                      "yet)."),
    mix_min_gain: float = typer.Option(_PLAN.mix_min_gain, "--mix-min-gain", help="Adopt a route mix (engines "
                                       "of different placements sharing the cluster) only when it plans this much "
                                       "above the best single-engine plan (0.05 = 5%; 0: any gain)."),
    factors: Path = opt.FACTORS,
    engine: str = typer.Option("tessera", "--engine", help="tessera | vllm: with vllm, also simulate each plan "
                               "vLLM can run on vLLM engines (chunked prefill under a token budget, steps "
                               "predicted per device) and print what they serve."),
    as_json: bool = opt.JSON,
) -> None:
    """Plan a deployment: place every kernel on the device type that suits it (or solve a baseline policy)."""
    from tessera.cost.options import CostOptions
    from tessera.plan.context import PlanContext
    from tessera.plan.objective_steps import add_objective_steps
    from tessera.plan.planner import compare as compare_all
    from tessera.plan.planner import plan_policy
    from tessera.report.plan_figure import placement_figure

    try:
        if compare and output is None and not as_json:  # --json prints; it writes only what -o asks for
            output = Path("tessera-plan.json")
        check_output_file(output, "--output", "plan.json")
        if engine not in ("tessera", "vllm"):
            raise PlanConfigError(f"--engine must be tessera or vllm (got {engine!r})")
        config = PlanConfig(model, cluster, workload, policy, objective, device, max_batch, prices,
                            CostOptions(weights_dtype, kv_dtype, factors=opt.load_factors(factors)), skew, cache_ctx, expert_split,
                            AdmissionConfig(max_num_seqs, memory_utilization, block_size), mix_min_gain)
        ctx = PlanContext.from_config(config, progress=lambda s: _err.print(f"[dim]{s}[/]"))
        text, cl = ctx.workload_text, ctx.cluster
        _err.print(f"[dim]planning {model} on {cl.describe()} for {text}[/]")
        if compare:
            plans = compare_all(ctx, objective)
            chosen = plans[-1]
        else:
            chosen = plan_policy(ctx, policy, objective, device)
            plans = [chosen]
        other = "latency" if objective == "throughput" else "throughput"
        if chosen.applicable and chosen.feasible:
            add_objective_steps(ctx, chosen, other)
        on_vllm = _on_vllm(ctx, plans) if engine == "vllm" else {}
        figure = None
        if output is not None and chosen.applicable and chosen.steps:
            write_output(output, "--output", chosen.save, "plan.json")
            if "replicas" not in chosen.extra and "routes" not in chosen.extra:  # engines of their own: no one grid
                figure = write_output(output.with_suffix(".png"), "--output",
                                      lambda png: placement_figure(ctx, chosen, png), "plan.png")
    except TesseraError as e:
        _fail(e)
    if as_json:
        rows = [{**p.summary(), **({"vllm": on_vllm[i]} if i in on_vllm else {})} for i, p in enumerate(plans)]
        share = _headroom(plans)
        if share is not None:
            rows[-1]["headroom_share"] = share[0]
        print(json.dumps(rows, indent=2))
        return
    _table(plans, ctx, objective)
    _bound_line(plans, ctx)
    if chosen.applicable and chosen.feasible and chosen.extra.get(f"{other}_plan"):
        o = chosen.extra[f"{other}_plan"]
        _out.print(f"{other} step plans in the same residency (batch {o['batch']}): {o['throughput']:,.0f} "
                   f"{chosen.unit}, {_ms(o['latency_s'])} per {'image' if chosen.unit == 'images/s' else 'output token'}")
    _engines_lines(chosen)
    if engine == "vllm":
        _vllm_table(plans, on_vllm, ctx)
    if output is not None and chosen.steps:
        drawn = f"; placement figure: {figure}" if figure else " (several engines: no single kernel split to draw)"
        _out.print(f"plan ({chosen.policy}) written to {output}{drawn}")


def _table(plans, ctx, objective: str) -> None:
    """The comparison table (numbers only, so it fits a terminal), then each policy's memory and notes."""
    unit = plans[0].unit
    per = "token" if unit == "tokens/s" else "image"
    cost = "$/h" if ctx.price_scenario == "cloud_usd" else "cost/h"
    table = Table(title=f"{ctx.model} on {ctx.cluster.describe()}\n{ctx.workload_text}, objective {objective} "
                        "(predicted)")
    for col in ("policy", unit, "bound", cost, "per cost", f"latency/{per}", "TTFT" if per == "token" else "", "M"):
        if col:
            table.add_column(col, justify="left" if col == "policy" else "right")
    best = max((p.throughput for p in plans if p.applicable and p.feasible), default=0.0)
    notes = []
    for p in plans:
        name = p.policy + (f" ({p.device})" if p.device else "")
        if not p.applicable:
            table.add_row(name, "n/a", *[""] * (5 if per == "token" else 4), "")
            notes.append(f"{name}: not applicable: {p.reason}")
            continue
        decode = next((s for s in p.steps if s.objective == objective and s.repeats > 1), None)
        shown = "[bold]" if p.throughput == best and p.feasible else ""
        row = [name, f"{shown}{p.throughput:,.1f}" if p.feasible else "no fit",
               f"{p.bound:,.1f}" if p.bound is not None else "-", f"{p.cost_per_hour:.2f}",
               f"{p.throughput_per_cost:,.1f}" if p.feasible else "-", _ms(p.latency_s)]
        if per == "token":
            row.append(_ms(p.ttft_s))
        table.add_row(*row, str(decode.micro_batches) if decode else "-")
        mem = ", ".join(f"{t} {b / 1e9:.1f} GB" for t, b in zip(p.targets, p.memory_bytes, strict=False))
        extra = f"{p.replicas} replicas; " if p.replicas > 1 else ""
        admits = [(r.get("device"), r["admission"]) for r in p.extra.get("replicas", []) if r.get("admission")]
        if p.admission is not None:
            admits = [(None, p.admission.__dict__)]
        extra += "".join(f"{dev + ' ' if dev else ''}engines admit {a['max_seqs']} sequences ({a['limited_by']}); "
                         for dev, a in admits)
        notes.append(f"{name}: {extra}memory {mem}" + (f"; {p.reason}" if p.reason else ""))
    _out.print(table)
    for line in notes:
        _out.print(f"  {line}")
    tess = plans[-1]
    base = [p for p in plans[:-1] if p.applicable and p.feasible]
    if len(plans) > 1 and tess.policy == "tessera" and base and tess.feasible:
        top = max(base, key=lambda p: p.throughput)
        margin = tess.throughput / top.throughput - 1
        verdict = (f"ties {top.policy}" if margin < 1e-6 else f"+{margin:.1%} over {top.policy}")
        _out.print(f"tessera vs the best baseline: {verdict} (bottleneck: {tess.bottleneck})")
        if tess.extra.get("mix_declined"):
            _out.print(f"  not adopted: {tess.extra['mix_declined']}")


def _on_vllm(ctx, plans) -> dict[int, dict]:
    """Each plan vLLM can run, simulated on vLLM engines: its summary by the plan's index."""
    from tessera.sim.vllm_deployment import simulate_on_vllm

    predicted: dict = {}
    out = {}
    for i, p in enumerate(plans):
        if p.applicable and p.feasible and "vllm" in p.layout.runnable_on:
            result = simulate_on_vllm(ctx, p, progress=lambda s: _err.print(f"[dim]{s}[/]"), predicted=predicted)
            out[i] = result.summary()
    return out


def _vllm_table(plans, on_vllm: dict[int, dict], ctx) -> None:
    table = Table(title=f"on vLLM engines (simulated: vLLM's scheduling, steps predicted per device), "
                        f"{ctx.workload_text}")
    for col in ("policy", "tokens/s", "TTFT p50", "TPOT p50", "note"):
        table.add_column(col, justify="left" if col in ("policy", "note") else "right")
    for i, p in enumerate(plans):
        name = p.policy + (f" ({p.device})" if p.device else "")
        s = on_vllm.get(i)
        if s is None:
            why = "not applicable" if not p.applicable else "does not fit" if not p.feasible else \
                "splits kernels: --engine tessera only"
            table.add_row(name, "-", "-", "-", why)
        else:
            table.add_row(name, f"{s['throughput']:,.0f}", _ms(s["ttft_p50_s"]), _ms(s["tpot_p50_s"]), "")
    _out.print(table)


def _engines_lines(plan) -> None:
    """The engines and routes that serve the chosen plan, and which serving engines can run it."""
    layout = plan.layout
    if not layout.engines:
        return
    runs = " or ".join(f"--engine {e}" for e in layout.runnable_on) or "no engine yet"
    why = [] if "vllm" in layout.runnable_on else ["its steps split kernels over devices, which vLLM does not run"]
    if "tessera" not in layout.runnable_on:
        why.append("Tessera's own runtime runs one placement, not a mix of routes")
    _out.print(f"engines of the {plan.policy} plan (serve with {runs}{'; ' if why else ''}{'; '.join(why)}):")
    for e in layout.engines:
        kv = f", {e.kv_tokens:,} KV tokens" if e.kv_tokens is not None else ""
        _out.print(f"  {e.name}: {' + '.join(e.roles)} on {', '.join(e.devices)}; max_num_seqs {e.max_num_seqs}{kv}, "
                   f"{e.memory_fraction:.0%} of its memory")
    for r in layout.routes:
        _out.print(f"  route {r.name}: {r.share:.0%} of requests via {' -> '.join(r.hops)}")


def _headroom(plans) -> tuple[float | None, float] | None:
    """(Tessera's share of the headroom between the best baseline and the bound, or None for no headroom;
    the best baseline's throughput) when the plans are a comparison ending with a feasible Tessera plan."""
    from tessera.plan.bound import headroom_share

    tess = plans[-1]
    base = [p.throughput for p in plans[:-1] if p.applicable and p.feasible]
    if len(plans) < 2 or tess.policy != "tessera" or not tess.feasible or not base or tess.bound is None:
        return None
    return headroom_share(tess.throughput, max(base), tess.bound), max(base)


def _bound_line(plans, ctx) -> None:
    """The Tessera plan's upper bound, what limits it, and the share of the headroom Tessera takes."""
    from tessera.plan.bound import upper_bound

    tess = plans[-1]
    if tess.policy != "tessera" or tess.bound is None or not tess.feasible:
        return
    b = upper_bound(ctx)
    work = ", ".join(f"{t} {v:.0%}" for t, v in b.work_share.items())
    line = (f"upper bound: {tess.bound:,.1f} {tess.unit} (fractional kernels, least transfers; {b.limited_by}; "
            f"work {work}); tessera reaches {tess.throughput / tess.bound:.0%} of it")
    share = _headroom(plans)
    if share is not None:
        line += ("; no headroom over the best baseline" if share[0] is None else
                 f"; {share[0]:.0%} of the headroom over the best baseline ({share[1]:,.1f} {tess.unit})")
    _out.print(line)


def register(app: typer.Typer) -> None:
    """Add the plan command to the main CLI."""
    app.command()(plan)
