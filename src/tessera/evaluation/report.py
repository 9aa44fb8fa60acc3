"""The evaluation report of ``tessera evaluate``: a markdown page (README.md), the results as JSON and one
PNG per section, all in one folder. Every GPU figure is labelled as predicted."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.report.plots import PlotError, save_png

if TYPE_CHECKING:
    from tessera.evaluation.records import Case, PolicyRun, SuiteResult

POLICY_ORDER = ("request-dist", "prefill-decode", "attention-ffn", "layer-pipeline", "tessera")
COLOURS = {"expensive": "#7f7f7f", "cheaper": "#c7c7c7", "request-dist": "#1f77b4", "prefill-decode": "#ff7f0e",
           "attention-ffn": "#2ca02c", "layer-pipeline": "#9467bd", "tessera": "#d62728"}
PREDICTED = "predicted: cost model + simulator, no GPU measured"


class ReportError(PlotError):
    """A report that cannot be written (an unwritable folder)."""


def _num(x: float | None) -> str:
    """Whole numbers from 100 up, three significant digits below (images/s are small)."""
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _t(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _status(run: PolicyRun | None) -> str | None:
    """The cell text of a run that has no figure (n/a, no fit, failed, skipped), else None."""
    if run is None:
        return "-"
    return None if run.ok else run.status


def _role(run: PolicyRun, expensive: str | None) -> str:
    if run.policy == "homogeneous":
        return "expensive" if run.device == expensive else "cheaper"
    return run.policy


def _columns(case: Case) -> list[tuple[str, PolicyRun]]:
    """(column title, run) in the report's order: the expensive GPU alone, the other alone, then the policies."""
    homo = sorted([r for r in case.runs if r.policy == "homogeneous"], key=lambda r: r.device != case.expensive)
    rest = sorted([r for r in case.runs if r.policy != "homogeneous"],
                  key=lambda r: POLICY_ORDER.index(r.policy) if r.policy in POLICY_ORDER else 99)
    return [(f"{r.device} alone", r) for r in homo] + [(r.policy, r) for r in rest]


# ---------------------------------------------------------------------------------------------------------
# Markdown

def _header(result: SuiteResult, command: str) -> list[str]:
    m = result.machine
    secs = ", ".join(f"{name} {_duration(result.seconds[name])}" for name in result.sections if name in result.seconds)
    jobs = f"{result.jobs} worker processes" if result.jobs > 1 else "one process"
    return [
        "# Tessera evaluation (every GPU figure predicted)", "",
        "Regenerate this page, its plots and `results.json` with:", "", "```sh", command, "```", "",
        f"Generated {result.started} on {m['cpu']} ({m['cores']} cores; {m['os']}; Python {m['python']}, "
        f"torch {m['torch']}, numpy {m['numpy']}). The run took {_duration(result.seconds.get('total', 0.0))} "
        f"of wall time in {jobs} (work per section: {secs}). No GPU was used.", "",
        "**Every GPU figure on this page is a prediction, not a measurement.** Each policy's deployment is "
        "planned with Tessera's cost model (`tessera plan`), then served by the cluster simulator "
        "(`tessera simulate`: the serving scheduler's batching, every step's device programs timed by the "
        "cost model over the cluster's links). The simulated figure is the result; the planner's own estimate "
        "(its per-request throughput model, no simulation) is shown beside it in brackets where useful. "
        "The planner's solver has time limits, so a slower or busier machine may find slightly different "
        "Tessera plans.", "",
        "Policies: `homogeneous` (one device type alone, as replicas or one sharded group), `request-dist` "
        "(each type serves its own replicas), `prefill-decode` (prompt on one type, decode on the other, KV "
        "moved), `attention-ffn` (attention on one type, MLP/experts on the other), `layer-pipeline` "
        "(contiguous layers per type), `tessera` (kernel placement by the MILP, which contains every "
        "baseline). **n/a**: the policy does not apply to the model; **no fit**: the plan does not fit the "
        "GPUs' memory; **failed**: the simulator could not serve the plan (see the notes).", ""]


def _summary_md(result: SuiteResult) -> list[str]:
    """A few sentences drawn from the tables below (simulated figures)."""
    out = []
    cases = [c for c in result.offline if c.tessera and c.tessera.ok]
    if cases:
        ratios = []
        for c in cases:
            alone = c.run("homogeneous", c.expensive)
            if alone is not None and alone.ok and alone.simulated:
                ratios.append(c.tessera.simulated / alone.simulated)
        ties = sum(c.tessera.reason.startswith("ties") for c in cases)
        close = sum(c.tessera.simulated >= c.best().simulated * 0.98 for c in cases)
        line = (f"- **Offline**: Tessera's plan on one GPU of each type serves "
                f"{min(ratios):.2f}x to {max(ratios):.2f}x the simulated throughput of the pair's expensive GPU "
                f"alone" if ratios else "- **Offline**: ")
        out.append(line + f"; in {ties} of {len(cases)} cases its search found nothing better than a baseline "
                   f"(the plan is that baseline's), and in {close} of {len(cases)} it is within 2% of the best "
                   "simulated policy.")
        above = [c for c in result.offline
                 if any(r.ok and r.policy != "homogeneous" and (r.per_cost_vs_expensive or 0) >= 1 for r in c.runs)]
        cheap = [c for c in result.offline
                 if max((r for r in c.runs if r.ok and r.per_cost_vs_expensive is not None),
                        key=lambda r: r.per_cost_vs_expensive, default=None) is
                 next((r for r in c.runs if r.policy == "homogeneous" and r.device != c.expensive), None)]
        out.append(f"- **Per cost**: a policy using both GPUs matches or beats the expensive GPU alone per unit "
                   f"of cost in {len(above)} of {len(result.offline)} cases; the cheaper GPU alone is the "
                   f"cheapest way to a token (image) in {len(cheap)}.")
    for c in result.online:
        ok = [r for r in c.runs if r.sustained_rps]
        if c.status != "ok" or not ok:
            continue
        top = max(ok, key=lambda r: r.sustained_rps)
        tes = next((r for r in ok if r.policy == "tessera"), None)
        out.append(f"- **Online, {c.model}**: {top.label} sustains the highest rate ({_num(top.sustained_rps)} req/s "
                   f"at <= {result.config.latency_target_s * 1e3:g} ms per output token)"
                   + (f"; Tessera's plan {_num(tes.sustained_rps)} req/s." if tes and tes is not top else "."))
    failed = [c.model for c in result.online if c.status != "ok"]
    if failed:
        out.append(f"- **Online**: the simulator cannot serve {', '.join(failed)} under the trace's lengths yet "
                   "(see the online section).")
    two = [e for e in result.two_gpus if e.status == "ok"]
    if two:
        thr = [e.pair.simulated / e.two.simulated for e in two]
        per = [t / (e.pair.cost_per_hour / e.two.cost_per_hour) for t, e in zip(thr, two, strict=True)]
        out.append(f"- **Pair against two of the expensive GPU**: the pair reaches {min(thr):.2f}x to {max(thr):.2f}x "
                   f"the throughput of two expensive GPUs and beats them in {sum(t > 1 for t in thr)} of {len(two)} "
                   f"cases; per unit of cost it is ahead in {sum(p > 1 for p in per)} of {len(two)}.")
    for c in result.network:
        lo, hi = (min(c.points), max(c.points)) if c.points else (None, None)
        if lo is None or lo == hi:
            continue
        drops = []
        for r in c.points[hi]:
            r_lo = next((x for x in c.points[lo] if x.label == r.label), None)
            if r.ok and r_lo is not None and r_lo.ok and r.simulated:
                drops.append((1 - r_lo.simulated / r.simulated, r.label))
        if drops:
            worst = max(drops)
            tes = next((d for d, label in drops if label == "tessera"), None)
            out.append(f"- **Network, {c.model}**: from {hi:g} down to {lo:g} Gb/s the largest loss is "
                       f"{worst[1]}'s ({worst[0]:.0%})" + (f"; Tessera's plan loses {tes:.0%}." if tes is not None
                                                           else "."))
    return ["## Summary (predicted)", "", *out, ""] if out else []


def _offline_md(result: SuiteResult) -> list[str]:
    cfg = result.config
    lines = ["## Offline throughput (predicted)", "",
             "One GPU of each type, 200 Gb/s InfiniBand between them. Workloads: "
             + (f"`{cfg.llm_workload}` for the LLMs" if cfg.llm_workload else
                "each family's steady-state default (`offline:prompts=azure-conv,out=N,requests=1000`: Llama "
                "1024 outputs, GPT-oss 384, Qwen2.5-VL and Mamba 128)")
             + f" and `{cfg.image_workload}` for diffusion, all requests arriving at once; "
             + (f"at most {cfg.max_batch} in flight" if cfg.max_batch else
                "each engine admits the sequences its memory holds (paged KV, 0.9 of each GPU, at most 256; 4 "
                "images)")
             + ". Throughput is outputs over the makespan: tokens/s (images/s for diffusion models); each "
             "cell is the simulated figure (steps at the engine's own shapes), the planner's steady-state "
             "estimate in brackets.", "",
             "![Offline throughput relative to the expensive GPU alone](offline_throughput.png)", ""]
    return (lines + _pair_tables(result, lambda r: f"{_num(r.simulated)} ({_num(r.planned)})", with_unit=True)
            + _bound_md(result))


def _bound_md(result: SuiteResult) -> list[str]:
    """The planner's upper bound per offline case, the best baseline and Tessera against it (planned)."""
    from tessera.plan.bound import headroom_share

    cases = [c for c in result.offline if c.bound]
    if not cases:
        return []
    lines = ["### Upper bound and Tessera's share of the headroom (planned)", "",
             "The bound is the best throughput any placement could reach with every kernel's work split "
             "fractionally over the GPU types, the least transfers those fractions need charged to the links (no "
             "dependencies or message latencies), memory and admission counted "
             "(`tessera.plan.bound`). Headroom share: (Tessera - best baseline) / (bound - best baseline), "
             "on the planner's steady-state figures.", "",
             "| pair | model | best baseline | tessera | bound | bound over best baseline | headroom share |",
             "|---|---|---|---|---|---|---|"]
    for c in cases:
        base = [r for r in c.runs if r.policy != "tessera" and r.ok and r.planned]
        tess = c.tessera
        if not base or tess is None or not tess.ok or not tess.planned:
            continue
        top = max(base, key=lambda r: r.planned)
        over = c.bound / top.planned - 1
        taken = headroom_share(tess.planned, top.planned, c.bound)
        share = "no headroom" if taken is None else f"{taken:.0%}"
        lines.append(f"| {c.cluster} | {c.model} | {top.label} {_num(top.planned)} | {_num(tess.planned)} | "
                     f"{_num(c.bound)} | {over:+.1%} | {share} |")
    return lines + [""]


def _pair_tables(result: SuiteResult, cell, with_unit: bool) -> list[str]:
    """One table per GPU pair of the offline cases: a row per model, a column per policy, ``cell(r)`` in each
    (or the policy's status: n/a, no fit, failed)."""
    lines: list[str] = []
    for pair in result.config.pairs:
        cases = [c for c in result.offline if c.cluster == pair]
        if not cases:
            continue
        cols = [title for title, _ in _columns(cases[0])]
        first = ["model", "unit"] if with_unit else ["model"]
        lines += [f"### {pair.replace('+', ' + ')}", "", "| " + " | ".join(first + cols) + " |",
                  "|---" * (len(cols) + len(first)) + "|"]
        for c in cases:
            cells = [_status(r) or cell(r) for _, r in _columns(c)]
            lead = [c.model, c.unit] if with_unit else [c.model]
            lines.append("| " + " | ".join(lead + cells) + " |")
        lines.append("")
    return lines


def _per_cost_md(result: SuiteResult) -> list[str]:
    cfg = result.config
    lines = ["## Throughput per cost, normalised to the expensive GPU alone (predicted)", "",
             f"Simulated throughput per {'relative price' if cfg.prices == 'relative' else 'US dollar'}-hour "
             f"({_price_text(result)}; a plan pays for the GPUs it uses), divided by the same figure of the "
             "pair's expensive GPU serving alone: above 1 the policy gives more throughput per unit of "
             "money than the expensive GPU alone.", "",
             "![Throughput per cost relative to the expensive GPU alone](per_cost.png)", ""]
    return lines + _pair_tables(result, lambda r: "-" if r.per_cost_vs_expensive is None
                                else f"{r.per_cost_vs_expensive:.2f}", with_unit=False)


def _online_md(result: SuiteResult) -> list[str]:
    cfg = result.config
    if not result.online:
        return []
    first = result.online[0]
    lines = ["## Online serving (predicted)", "",
             f"Poisson arrivals on {first.described}, request lengths drawn from the `{cfg.online_lengths}` "
             f"trace (mean output {first.mean_output:.0f} tokens), {cfg.online_requests} requests per "
             f"simulation (seed {cfg.seed}); every policy planned for the trace's median lengths. "
             f"{_rejected_text(result)}**Sustained rate**: the highest Poisson rate at which the mean "
             f"normalised latency (end-to-end latency / output tokens) stays at most "
             f"{cfg.latency_target_s * 1e3:g} ms per output token, found by bisection on the rate: bracketed "
             f"within a factor of 2 starting from the planner's estimate, then {cfg.bisection_steps} halvings "
             "of the bracket in log space (the highest rate that met the target; the lowest that missed it in "
             "brackets). A rate above the plan's capacity (its planned tokens/s over the mean output) misses "
             f"without a simulation: {cfg.online_requests} requests can fit one engine's slots at once, and such a "
             "burst may meet the target although the deployment cannot keep up with the rate. "
             "The same seed at every rate scales one arrival pattern. Diffusion (sd3.5-medium) is "
             "not in the online section: its outputs are images, not tokens, so the per-token latency target "
             "does not apply.", "",
             "![Normalised latency against the Poisson rate](online_latency.png)", ""]
    cols = list(dict.fromkeys(r.label for c in result.online for r in c.runs))
    lines += ["### Sustained rate (requests/s) at <= "
              f"{cfg.latency_target_s * 1e3:g} ms per output token", "",
              "| model | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    def sustained(r) -> str:
        if r.sustained_rps is None:
            return f"< {_num(min(x for x, _ in r.samples))}" if r.samples else "-"
        hi = r.bracket[1]
        return f"{_num(r.sustained_rps)} ({'no miss found' if hi is None else _num(hi)})"

    lines += _online_rows(result, cols, sustained)
    lines.append("")
    lines += ["### Tails at a fixed rate: P99 TTFT / P99 TPOT", "",
              "Each model at one fixed rate for every policy (the rate in the second column: "
              + (first.fixed_rate_rule or "-") + "). TPOT is a request's time per output token after its "
              "first.", "",
              "| model | rate (req/s) | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    lines += _online_rows(result, cols, lambda r: "-" if r.at_fixed is None else
                          f"{_t(r.at_fixed['ttft_p99_s'])} / {_t(r.at_fixed['tpot_p99_s'])}",
                          lead=lambda c: c.fixed_rate if c.fixed_rate else "-")
    lines.append("")
    for c in result.online:
        if c.status != "ok":
            lines += [f"**{c.model} failed**: the simulator cannot serve these requests with {c.expensive} alone "
                      f"(tried at a low rate before planning the other policies): {c.reason}", ""]
    return lines


def _online_rows(result: SuiteResult, cols: list[str], cell, lead=None) -> list[str]:
    """A table row per model of the online section: ``lead(case)`` first (if given), then a cell per policy
    column: "-" where the policy has no run, the run's status where it failed, else ``cell(run)``; a model
    whose simulations failed says so in every policy column."""
    rows = []
    for c in result.online:
        first = f"| {c.model} | " + ("" if lead is None else f"{lead(c) if c.status == 'ok' else '-'} | ")
        if c.status != "ok":
            rows.append(first + " | ".join(["failed"] * len(cols)) + " |")
            continue
        cells = ["-" if r is None else r.status if r.status != "ok" else cell(r) for r in _by_label(c.runs, cols)]
        rows.append(first + " | ".join(cells) + " |")
    return rows


def _by_label(runs, labels: list[str]) -> list:
    """The run of each label (None where a case has none)."""
    return [next((r for r in runs if r.label == label), None) for label in labels]


def _rejected_text(result: SuiteResult) -> str:
    """How many requests the context limit rejects (the same ones at every rate)."""
    counts = {r.at_fixed["rejected"] for c in result.online for r in c.runs if r.at_fixed}
    if not counts or counts == {0}:
        return ""
    n = max(counts)
    return (f"{n} of the {result.config.online_requests} requests need a longer context than the deployments' "
            "8192 tokens; they are rejected at every rate and left out of the latencies. ")


def _cluster_table(case: Case) -> list[str]:
    cost = "cost/h"
    lines = [f"| policy | simulated {case.unit} | planner {case.unit} | {cost} | simulated per cost | replicas | "
             "TTFT p99 | TPOT p99 |", "|---" * 8 + "|"]
    for r in case.runs:
        s = _status(r)
        if s:
            lines.append(f"| {r.label} | {s} | {_num(r.planned)} | {_num(r.cost_per_hour)} | - | - | - | - |")
            continue
        lines.append(f"| {r.label} | {_num(r.simulated)} | {_num(r.planned)} | {r.cost_per_hour:.3g} | "
                     f"{_num(r.per_cost)} | {r.replicas} | {_t(r.ttft_p99_s)} | {_t(r.tpot_p99_s)} |")
    return lines


def _clusters_md(result: SuiteResult) -> list[str]:
    if not result.clusters:
        return []
    lines = ["## Clusters (predicted)", "",
             "Several GPUs per type: every policy planned over the whole cluster (each type on its own node, "
             "NVLink inside a node, 200 Gb/s InfiniBand between nodes), then simulated. Workload as in the "
             "offline section; P99 TTFT is dominated by the queueing of requests that all arrive at once.", "",
             "![Clusters](clusters.png)", ""]
    for c in result.clusters:
        lines += [f"### {c.model} on {c.described}", "", *_cluster_table(c), ""]
    return lines


def _network_md(result: SuiteResult) -> list[str]:
    if not result.network:
        return []
    cfg = result.config
    lines = ["## Network sensitivity (predicted)", "",
             f"One GPU of each type of {cfg.network_pair.replace('+', ' + ')} with the inter-node link at each "
             "bandwidth (InfiniBand latency unchanged); every policy re-planned and simulated at each point "
             "(simulated throughput; planner's estimate in brackets). Homogeneous and request-dist plans "
             "do not use the link.", "",
             "![Network sensitivity](network.png)", ""]
    for c in result.network:
        points = sorted(c.points)
        if not points:
            continue
        lines += [f"### {c.model} ({c.workload}, {c.unit})", "",
                  "| policy | " + " | ".join(f"{g:g} Gb/s" for g in points) + " |", "|---" * (len(points) + 1) + "|"]
        labels = [r.label for r in c.points[points[0]]]
        for label in labels:
            cells = []
            for g in points:
                r = next((x for x in c.points[g] if x.label == label), None)
                s = _status(r)
                cells.append(s if s else f"{_num(r.simulated)} ({_num(r.planned)})")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if c.skipped:
            lines.append(f"\nSkipped for the time budget: {', '.join(f'{g:g}' for g in c.skipped)} Gb/s.")
        lines.append("")
    return lines


def _two_md(result: SuiteResult) -> list[str]:
    if not result.two_gpus:
        return []
    lines = ["## The heterogeneous pair against two of its expensive GPU (predicted)", "",
             "Per model: Tessera's plan on one GPU of each type of the pair, against the best homogeneous plan "
             "on two of the pair's expensive GPU (two replicas or one tensor/expert-parallel group over NVLink), "
             "with the same workload and the same number of sequences in flight. Throughput is simulated; "
             "cost is the price per hour of the GPUs a plan uses; the ratios are pair / two. The pair's best "
             "simulated policy is given too: it is not always Tessera's plan, since Tessera maximises the "
             "planner's estimate.", "",
             "![Pair against two of the expensive GPU](pair_vs_two.png)", "",
             "| pair | model | two of the expensive GPU | cost/h | pair: plan | simulated | cost/h | "
             "throughput ratio | cost ratio | per-cost ratio | pair's best simulated | verdict |", "|---" * 12 + "|"]
    for e in result.two_gpus:
        two, mine = e.two, e.pair
        if e.status != "ok":
            lines.append(f"| {e.gpus} | {e.model} | {_status(two) or _num(two.simulated)} | - | "
                         f"{mine.label if mine else '-'} | {_status(mine) or _num(mine.simulated)} | - | - | - | - | "
                         f"- | {e.reason} |")
            continue
        thr = mine.simulated / two.simulated
        cost = mine.cost_per_hour / two.cost_per_hour
        best = e.best
        verdict = (f"{'beats' if thr > 1 else 'loses to'} {e.expensive}:2: {thr - 1:+.0%} throughput at "
                   f"{cost - 1:+.0%} cost")
        lines.append(f"| {e.gpus} | {e.model} | {_num(two.simulated)} {e.unit} | {two.cost_per_hour:.3g} | "
                     f"{mine.label} | {_num(mine.simulated)} | {mine.cost_per_hour:.3g} | {thr:.2f} | {cost:.2f} | "
                     f"{thr / cost:.2f} | {best.label if best else '-'}: {_num(best.simulated if best else None)} | "
                     f"{verdict} |")
    lines.append("")
    return lines


def _notes_md(result: SuiteResult) -> list[str]:
    """Where the simulator and the planner disagree most, failures and skipped items."""
    lines = ["## Notes", ""]
    gaps = []
    for c in [*result.offline, *result.clusters]:
        for r in c.runs:
            if r.ok and r.planned and r.simulated:
                gaps.append((r.simulated / r.planned, c, r))
    if gaps:
        gaps.sort(key=lambda g: g[0])
        low = [g for g in gaps if g[0] < 0.75]
        lines.append(f"- Simulated over planned throughput: median {sorted(g[0] for g in gaps)[len(gaps) // 2]:.2f} "
                     f"over {len(gaps)} plans; {len(low)} plans simulate below 75% of the planner's estimate.")
        for ratio, c, r in low[:8]:
            lines.append(f"  - {c.model} on {c.cluster}, {r.label}: {ratio:.2f} ({_num(r.simulated)} vs "
                         f"{_num(r.planned)} {c.unit})")
        worse = [c for c in [*result.offline, *result.clusters]
                 if c.tessera and c.tessera.ok and c.best() and c.best() is not c.tessera
                 and c.best().simulated > c.tessera.simulated * 1.02]
        if worse:
            lines.append(f"- In {len(worse)} of {len(result.offline) + len(result.clusters)} cases another policy "
                         "simulates more than 2% faster than Tessera's plan (Tessera's search maximises the "
                         "planner's estimate, which the simulator does not always confirm):")
            for c in worse:
                b = c.best()
                lines.append(f"  - {c.model} on {c.cluster}: {b.label} {_num(b.simulated)} vs tessera "
                             f"{_num(c.tessera.simulated)} {c.unit}")
    failed: dict[str, list[str]] = {}
    for section, cases in (("offline", result.offline), ("clusters", result.clusters), ("online", result.online)):
        for c in cases:
            for r in c.runs:
                if r.status == "failed":
                    failed.setdefault(r.reason, []).append(f"{section} {c.model} on {c.cluster} {r.label}")
    for c in result.network:
        for g, runs in c.points.items():
            for r in runs:
                if r.status == "failed":
                    failed.setdefault(r.reason, []).append(f"network {c.model} at {g:g} Gb/s {r.label}")
    for reason, where in failed.items():
        lines.append(f"- the simulator failed on {len(where)} plan{'s' if len(where) > 1 else ''} ("
                     + "; ".join(where[:4]) + ("; ..." if len(where) > 4 else "") + f"): {reason}")
    nofit = [(c, r) for c in result.offline for r in c.runs if r.status == "no fit"]
    for c, r in nofit:
        lines.append(f"- no fit: {c.model} on {c.cluster}, {r.label}: {r.reason}")
    for item in result.skipped:
        lines.append(f"- skipped for the time budget: {item}")
    lines.append("")
    return lines if len(lines) > 3 else []


def _price_text(result: SuiteResult) -> str:
    from tessera.hardware.devices import resolve_device

    types = []
    for pair in result.config.pairs:
        for d in pair.split("+"):
            if resolve_device(d).id not in types:
                types.append(resolve_device(d).id)
    return ", ".join(f"{d} {resolve_device(d).price(result.config.prices):g}" for d in types)


def markdown(result: SuiteResult, command: str, plots: dict[str, str]) -> str:
    """The report page (plots: section -> PNG file name; a section without its plot shows none)."""
    parts = _header(result, command) + _summary_md(result)
    for fn, png in ((_offline_md, "offline_throughput.png"), (_per_cost_md, "per_cost.png"),
                    (_online_md, "online_latency.png"), (_clusters_md, "clusters.png"), (_network_md, "network.png"),
                    (_two_md, "pair_vs_two.png")):
        block = fn(result)
        if png not in plots:  # nothing to draw: no image line
            block = [line for line in block if f"({png})" not in line]
        parts += block
    parts += _notes_md(result)
    return "\n".join(parts).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------------------
# Plots

def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _relative_bars(result: SuiteResult, path: Path, value, ylabel: str, title: str) -> Path | None:
    """One panel per pair: per model, a bar per policy of ``value(case, run)`` (relative to the expensive GPU
    alone: a line at 1); n/a and no-fit marked on the axis."""
    from matplotlib.patches import Patch

    pairs = [p for p in result.config.pairs if any(c.cluster == p for c in result.offline)]
    if not pairs:
        return None
    roles = ["cheaper", *POLICY_ORDER]
    fig = _figure(13, 3.6 * len(pairs) + 1.2)
    axes = fig.subplots(len(pairs), 1, squeeze=False)[:, 0]
    width = 0.8 / len(roles)
    top = 1.0
    for ax, pair in zip(axes, pairs, strict=True):
        cases = [c for c in result.offline if c.cluster == pair]
        for i, c in enumerate(cases):
            for j, role in enumerate(roles):
                r = next((r for r in c.runs if _role(r, c.expensive) == role), None)
                x = i - 0.4 + width * (j + 0.5)
                v = value(c, r) if r is not None and r.ok else None
                if v is None:
                    mark = "n/a" if r is not None and r.status == "n/a" else ("no fit" if r is not None and
                                                                              r.status == "no fit" else "-")
                    ax.text(x, 0.02, mark, rotation=90, ha="center", va="bottom", fontsize=7, color="#555555",
                            transform=ax.get_xaxis_transform())
                    continue
                top = max(top, v)
                ax.bar(x, v, width * 0.92, color=COLOURS[role])
                if role == "tessera":
                    ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(cases)), [c.model for c in cases])
        ax.set_xlim(-0.5, len(cases) - 0.5)
        a, b = pair.split("+")
        exp = cases[0].expensive
        cheap = b if exp == a else a
        ax.set_title(f"{a} + {b}: relative to {exp} alone (= 1, dashed); 'cheaper' = {cheap} alone", fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.25)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    for ax in axes:
        ax.set_ylim(0, top * 1.12)
    handles = [Patch(color=COLOURS[r], label="cheaper GPU alone" if r == "cheaper" else r) for r in roles]
    fig.suptitle(f"{title}, one GPU of each type ({PREDICTED})", fontsize=11)
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0.035, 1, 0.98))
    return save_png(fig, path, ReportError, "a report plot", "give -o a writable folder")


def _online_plot(result: SuiteResult, path: Path) -> Path | None:
    cases = [c for c in result.online if any(r.samples for r in c.runs)]
    if not cases:
        return None
    cols = 2 if len(cases) > 1 else 1
    rows = math.ceil(len(cases) / cols)
    fig = _figure(6.5 * cols, 4.2 * rows + 1.0)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    target = result.config.latency_target_s * 1e3
    handles = {}
    for ax, c in zip(axes, cases, strict=False):
        for r in c.runs:
            if not r.samples:
                continue
            role = _role(r, c.expensive)
            xs = [x for x, _ in r.samples]
            ys = [y * 1e3 for _, y in r.samples]
            handles[r.label] = _line(ax, xs, ys, role)
        ax.axhline(target, color="black", linestyle=":", linewidth=1)
        ax.text(0.01, target, f" {target:g} ms target", transform=ax.get_yaxis_transform(), va="bottom",
                fontsize=8)
        if c.fixed_rate:
            ax.axvline(c.fixed_rate, color="#555555", linestyle="-.", linewidth=0.8)
            ax.text(c.fixed_rate, 0.98, " fixed rate", transform=ax.get_xaxis_transform(), va="top", fontsize=8,
                    color="#555555")
        ax.set_yscale("log")
        ax.set_xscale("log")
        _plain_log_ticks(ax.xaxis)
        _plain_log_ticks(ax.yaxis)
        ax.set_title(c.model, fontsize=10)
        ax.set_xlabel("Poisson rate (requests/s, log scale)")
        ax.set_ylabel("mean latency per output token (ms)")
        ax.grid(True, which="both", alpha=0.2)
    for ax in axes[len(cases):]:
        ax.set_visible(False)
    if not handles:
        return None
    fig.suptitle(f"Online: mean latency per output token against the Poisson rate on {cases[0].described}\n"
                 f"({PREDICTED}; the wide red line is Tessera's plan)", fontsize=11)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(4, len(handles)),
               frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0.1 if rows == 1 else 0.06, 1, 1))
    return save_png(fig, path, ReportError, "a report plot", "give -o a writable folder")


def _line(ax, xs, ys, role: str):
    """A policy's curve; Tessera's is drawn wide and pale underneath, so a baseline it ties stays visible."""
    if role == "tessera":
        return ax.plot(xs, ys, marker="o", markersize=7, linewidth=5, color=COLOURS[role], alpha=0.45,
                       zorder=1)[0]
    return ax.plot(xs, ys, marker="o", markersize=3.5, linewidth=1.4, color=COLOURS[role], zorder=2,
                   linestyle="--" if role in ("expensive", "cheaper") else "-")[0]


def _plain_log_ticks(axis) -> None:
    """Log-axis labels as plain numbers (2, 5, 10, 20) instead of powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_minor_locator(LogLocator(base=10, subs=(3.0, 4.0, 6.0, 7.0, 8.0, 9.0)))
    axis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda x, _: ""))


def _clusters_plot(result: SuiteResult, path: Path) -> Path | None:
    cases = [c for c in result.clusters if c.runs]
    if not cases:
        return None
    fig = _figure(7.0 * len(cases), 4.8)
    axes = fig.subplots(1, len(cases), squeeze=False)[0]
    for ax, c in zip(axes, cases, strict=True):
        runs = c.runs
        y = list(range(len(runs)))[::-1]
        for yi, r in zip(y, runs, strict=True):
            role = "tessera" if r.policy == "tessera" else ("expensive" if r.policy == "homogeneous" else r.policy)
            colour = COLOURS.get(role, "#7f7f7f")
            right = max(r.simulated or 0.0, r.planned or 0.0)
            if r.ok and r.simulated is not None:
                ax.barh(yi, r.simulated, 0.6, color=colour)
                ax.text(right, yi, f"  {_num(r.simulated)}", va="center", fontsize=8)
            else:
                ax.text(0, yi, f" {r.status}", va="center", fontsize=8, color="#555555")
            if r.planned:
                ax.plot([r.planned], [yi], marker="|", markersize=16, markeredgewidth=2, color="black")
        ax.set_yticks(y, [r.label for r in runs], fontsize=8)
        ax.set_xlabel(f"{c.unit} (bars: simulated; black tick: planner's estimate)")
        ax.set_title(f"{c.model} on {c.described}", fontsize=10)
        ax.grid(True, axis="x", alpha=0.25)
        xmax = max([r.simulated or 0 for r in runs] + [r.planned or 0 for r in runs]) or 1
        ax.set_xlim(0, xmax * 1.18)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.suptitle(f"Clusters: every policy ({PREDICTED})", fontsize=11)
    fig.tight_layout()
    return save_png(fig, path, ReportError, "a report plot", "give -o a writable folder")


def _network_plot(result: SuiteResult, path: Path) -> Path | None:
    cases = [c for c in result.network if len(c.points) > 0]
    if not cases:
        return None
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    fig = _figure(6.8 * len(cases), 5.0)
    axes = fig.subplots(1, len(cases), squeeze=False)[0]
    handles = {}
    for ax, c in zip(axes, cases, strict=True):
        points = sorted(c.points)
        labels = [r.label for r in c.points[points[0]]]
        for label in labels:
            xs, ys = [], []
            role = None
            for g in points:
                r = next((x for x in c.points[g] if x.label == label), None)
                if r is not None and r.ok and r.simulated is not None:
                    xs.append(g)
                    ys.append(r.simulated)
                    role = _role(r, c.expensive)
            if not xs:
                continue
            handles[label if role not in ("expensive", "cheaper") else f"{role} GPU alone"] = _line(ax, xs, ys, role)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(points))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("inter-node bandwidth (Gb/s, log scale)")
        ax.set_ylabel(f"simulated {c.unit}")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{c.model} on {c.pair.replace('+', ' + ')}", fontsize=10)
        ax.grid(True, alpha=0.25)
    if not handles:
        return None
    fig.suptitle(f"Network sensitivity: every policy re-planned at each bandwidth\n({PREDICTED}; the wide red "
                 "line is Tessera's plan)", fontsize=11)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(7, len(handles)),
               frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return save_png(fig, path, ReportError, "a report plot", "give -o a writable folder")


def _two_plot(result: SuiteResult, path: Path) -> Path | None:
    entries = [e for e in result.two_gpus if e.status == "ok"]
    if not entries:
        return None
    from matplotlib.patches import Patch

    pairs = list(dict.fromkeys(e.gpus for e in entries))
    fig = _figure(5.2 * len(pairs), 4.6)
    axes = fig.subplots(1, len(pairs), squeeze=False, sharey=True)[0]
    top = 1.0
    for ax, pair in zip(axes, pairs, strict=True):
        es = [e for e in entries if e.gpus == pair]
        for i, e in enumerate(es):
            thr = e.pair.simulated / e.two.simulated
            per = thr / (e.pair.cost_per_hour / e.two.cost_per_hour)
            top = max(top, thr, per)
            ax.bar(i - 0.18, thr, 0.34, color=COLOURS["tessera"])
            ax.bar(i + 0.18, per, 0.34, color="#f4a582")
            ax.text(i - 0.18, thr, f"{thr:.2f}", ha="center", va="bottom", fontsize=7)
            ax.text(i + 0.18, per, f"{per:.2f}", ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(es)), [e.model for e in es], rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{pair.replace('+', ' + ')} vs {es[0].expensive}:2", fontsize=10)
        ax.grid(True, axis="y", alpha=0.25)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[0].set_ylabel("pair (Tessera's plan) / two of the expensive GPU")
    for ax in axes:
        ax.set_ylim(0, top * 1.15)
    fig.suptitle(f"Heterogeneous pair (Tessera's plan) against two of its expensive GPU ({PREDICTED})",
                 fontsize=11)
    fig.legend(handles=[Patch(color=COLOURS["tessera"], label="throughput ratio"),
                        Patch(color="#f4a582", label="throughput-per-cost ratio")],
               loc="lower center", ncol=2, frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return save_png(fig, path, ReportError, "a report plot", "give -o a writable folder")


def write_report(result: SuiteResult, folder: str | Path, command: str) -> dict[str, Path]:
    """Write README.md, results.json and the plots into ``folder``; returns what was written by name."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"cannot create the report folder {folder}: {e.strerror}; give -o a writable folder") from e
    written: dict[str, Path] = {}
    makers = {
        "offline_throughput.png": lambda p: _relative_bars(
            result, p, lambda c, r: _ratio(r.simulated, c.run("homogeneous", c.expensive)),
            "simulated throughput / expensive GPU alone", "Offline throughput"),
        "per_cost.png": lambda p: _relative_bars(
            result, p, lambda c, r: r.per_cost_vs_expensive, "throughput per cost / expensive GPU alone's",
            "Offline throughput per cost"),
        "online_latency.png": lambda p: _online_plot(result, p),
        "clusters.png": lambda p: _clusters_plot(result, p),
        "network.png": lambda p: _network_plot(result, p),
        "pair_vs_two.png": lambda p: _two_plot(result, p),
    }
    plots = {}
    for name, make in makers.items():
        target = folder / name
        if target.exists():
            target.unlink()  # a stale plot of an earlier run must not be mistaken for this one's
        drawn = make(target)
        if drawn is not None:
            written[name] = drawn
            plots[name] = name
    try:
        (folder / "results.json").write_text(json.dumps(result.to_dict(), indent=1, default=_json_default) + "\n")
        (folder / "README.md").write_text(markdown(result, command, plots))
    except OSError as e:
        raise ReportError(f"cannot write the report into {folder}: {e.strerror}; give -o a writable folder") from e
    written["results.json"] = folder / "results.json"
    written["README.md"] = folder / "README.md"
    return written


def _ratio(value: float | None, base: PolicyRun | None) -> float | None:
    if value is None or base is None or not base.ok or not base.simulated:
        return None
    return value / base.simulated


def _json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")
