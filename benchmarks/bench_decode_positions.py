"""`tessera serve`'s default deployment measured by `tessera bench`, beside the simulator's prediction with its
engines switching objectives as the served engines' monitors do (each replica starting each workload on the
objective its served replica is on), with decode attention charged at each step's furthest cache position and no monitor, and
with the charge before it was (attention at the planned mean position in the profiled step only, other rows'
steps by the roofline).

    .venv/bin/python benchmarks/bench_decode_positions.py [--workloads fixed:in=64,out=32,requests=32;...]

The server runs smollm2-135m (real weights) on cpu:2 (one thread per worker) with serve's defaults (32 slots,
a context of 512, the policy `runtime_policy` chooses). The simulator serves the requests the server really
saw (greedy outputs may stop early at EOS), with the driver's round trip measured on a pool of its own and
the engine's work per step measured on a warm-up, and every served step's kernels profiled
(`runtime.prompt_profile.serving_profile`), as `bench_serve.py` does.
"""

from __future__ import annotations

import argparse
import copy
import sys

MODEL = "smollm2-135m"
WORKLOADS = "fixed:in=64,out=32,requests=32;fixed:in=16,out=16,requests=32;fixed:in=320,out=64,requests=16"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=WORKLOADS, help="tessera bench workloads, ';'-separated")
    args = parser.parse_args()
    import torch

    from bench_serve import _start_server  # uvicorn on a free port, in a thread
    from tessera.plan.objective_steps import add_objective_steps
    from tessera.plan.planner import plan_policy
    from tessera.runtime.contention_probe import host_contention
    from tessera.runtime.pair_costs import local_pair_costs
    from tessera.runtime.prompt_profile import serving_profile
    from tessera.runtime.session import planned_decode_position, runtime_context, runtime_graphs
    from tessera.runtime.step_excess_probe import with_step_excess
    from tessera.serve.bench import run_bench
    from tessera.serve.config import ServeConfig
    from tessera.serve.engine_probe import StepWork
    from tessera.serve.launch import PLAN_OUTPUT, PLAN_PROMPT, runtime_policy, start_engine
    from tessera.serve.replicas import ReplicatedEngine
    from tessera.sim.requests import simulate

    torch.set_num_threads(1)
    say = lambda s: print(s, file=sys.stderr)  # noqa: E731
    cfg = ServeConfig(MODEL, "cpu:2", threads=1)
    _, feedback_s = local_pair_costs(output_bytes=4 * 49152 * cfg.slots // 2)
    served = runtime_policy(cfg, 2, 1, say)
    base = runtime_graphs(MODEL, PLAN_PROMPT, cfg.max_context, cfg.slots)
    # every served prompt step and decode row bucket measured (as bench_serve.py simulates; the first run profiles
    # serve's 35 prompt buckets of 32 slots and a context of 512: minutes, cached)
    profile = serving_profile(MODEL, base, 1, cfg.slots, cfg.max_context, cfg.min_prompt_bucket, say,
                              planned_decode_position(PLAN_PROMPT, PLAN_OUTPUT, cfg.max_context))
    # and, as bench_serve.py charges them, the two workers' contention and a kernel's excess inside a real step
    profile.contention = host_contention(MODEL, 1, log=say)
    profile.overhead = with_step_excess(profile.overhead, MODEL, ctx=cfg.max_context, slots=cfg.slots, log=say)
    engine, how = start_engine(cfg, say)
    say(f"serving {MODEL} on cpu:2: {how}")
    ports: list[int] = []
    server = _start_server(engine, ports)
    url = f"http://127.0.0.1:{ports[0]}"
    work = StepWork()
    work.attach(engine)  # request-dist: every replica's engine
    run_bench(url, "fixed:in=32,out=8,requests=8", MODEL, seed=1)  # warm-up (not recorded)
    work.detach()
    profile.overhead = profile.overhead.with_engine_step(work.per_step_s(feedback_s), "median over the warm-up")
    before = copy.copy(profile)
    before.positions = None  # the charge before: the planned mean in the profiled step, the roofline elsewhere
    contexts = {name: runtime_context(MODEL, 2, PLAN_PROMPT, PLAN_OUTPUT, cfg.max_context, cfg.slots, 1, p, say)
                for name, p in (("position", profile), ("before", before))}
    plans = {name: plan_policy(c, served.policy, "throughput") for name, c in contexts.items()}
    add_objective_steps(contexts["position"], plans["position"], "latency")
    served_engines = engine.engines if isinstance(engine, ReplicatedEngine) else [engine]
    rows = []
    for wl in args.workloads.split(";"):
        say(f"bench {wl}")
        # each replica's objective, left from the workload before (idle windows keep it): the simulated replicas
        # start on them, each on its own
        at_start = [e.monitor.objective for e in served_engines]
        t0 = served_engines[0].clock()
        report = run_bench(url, wl, MODEL, seed=0)
        for i, e in enumerate(served_engines):  # when each served engine switched, from the workload's start
            say(f"engine {i} switches: " + (", ".join(f"{s.at_s - t0:+.2f} s {s.before} -> {s.after} ({s.ratio:.2f})"
                                                       for s in e.monitor.switches if s.at_s >= t0 - 2.0) or "none"))
        measured = report.summary()
        draws = [(o.planned.arrival_s, o.prompt_tokens or o.planned.input, max(1, o.output_tokens))
                 for o in report.outcomes if o.ok]
        predicted = {name: simulate(contexts[name], plans[name], max_context=cfg.max_context, feedback_s=feedback_s,
                                    min_prompt=cfg.min_prompt_bucket, draws=draws).summary() for name in contexts}
        predicted["monitor"] = simulate(
            contexts["position"], plans["position"], max_context=cfg.max_context, feedback_s=feedback_s,
            min_prompt=cfg.min_prompt_bucket, draws=draws, latency_rows=cfg.latency_rows,
            monitor=[e.monitor.fresh(o) for e, o in zip(served_engines, at_start, strict=True)]).summary()
        rows.append((wl, measured, predicted["monitor"], predicted["position"], predicted["before"], at_start))
    server.should_exit = True
    engine.stop()

    def f(v, scale=1.0, digits=2):
        return "-" if v is None else f"{v * scale:.{digits}f}"

    print(f"{MODEL} on cpu:2, serve's defaults ({served.policy}, {cfg.slots} slots, context {cfg.max_context}, 1 thread "
          f"per worker); measured by tessera bench | predicted with the monitor | by position without it | before")
    print("| workload | tokens/s | TTFT p50 (s) | TPOT p50 (ms) | TPOT p99 (ms) | switches predicted | objectives at "
          "start |")
    print("|---|---|---|---|---|---|---|")

    def cells(runs: tuple, key: str, scale: float = 1.0, digits: int = 2) -> str:
        return " \\| ".join(f(x[key], scale, digits) for x in runs)

    for wl, *runs, at_start in rows:
        print(f"| {wl} | {cells(runs, 'throughput', digits=1)} | {cells(runs, 'ttft_p50_s')} | "
              f"{cells(runs, 'tpot_p50_s', 1e3, 0)} | {cells(runs, 'tpot_p99_s', 1e3, 0)} | {runs[1]['switches']} | "
              f"{', '.join(at_start)} |")
    print("\npredicted with the monitor against measured (tokens/s, TTFT p50, TPOT p50):")
    for wl, m, p, *_ in rows:
        print(f"  {wl}: " + ", ".join(f"{(p[k] / m[k] - 1) * 100:+.1f}%" if m[k] and p[k] is not None else "-"
                                      for k in ("throughput", "ttft_p50_s", "tpot_p50_s")))


if __name__ == "__main__":
    main()
