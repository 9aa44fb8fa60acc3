"""What the simulator leaves out of a served step: each step `tessera serve`'s engine runs on cpu:2, measured,
beside the simulator's time for the same step (same plan, same bucket), the difference broken down.

    PYTHONPATH=src .venv/bin/python benchmarks/sim_gap.py [--policy prefill-decode] [--rate 1] [--requests 12]

The engine runs in this process (no HTTP) under ``--policy`` (its latency objective the same policy, as
bench_serve.py's ``--latency-policy P``), smollm2-135m on cpu:2 at one thread per worker, 8 slots, context
128, requests drawn as bench_serve.py draws them (Poisson at ``--rate``). Per step kind, averaged over the
steps of that kind:

- simulated: the step timer's step (``first_s``: the programs alone plus the driver's round trip; a decode step
  at its rows' furthest position), its kernel seconds per worker and kernel count per worker, from the profile
  bench_serve.py simulates with (`runtime.prompt_profile.serving_profile`: every served prompt step and decode
  row bucket measured), with the kernels' profiled times alone (as before the host overhead was modelled) and
  with this host's overhead charged (`tessera.cost.host_overhead`, the in-step excess included; the engine's
  per-step work, measured by bench_serve.py on a warm-up, is not charged here);
- measured: the engine's wall time of the step (inputs built and submitted until its tokens are taken), the
  driver's step time (submitted until every reply is in), each worker's wall seconds and compute seconds
  (its kernels as the executor runs them, on the host clock), and the engine's own work (building inputs,
  submitting, taking the result, sampling bookkeeping, detokenising, events), timed around those calls.

The breakdown: compute - profiled kernels (the executor's host time per kernel and kernels slower in a step
than alone), worker wall - compute (transfers and waiting for messages), driver step - worker wall (the
driver's round trip), engine wall - driver step (the engine's own work and waiting on another lane).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import threading
import time

import numpy as np

MODEL = "smollm2-135m"
LENGTHS = [[8, 8], [16, 16], [24, 12], [32, 24], [48, 16], [12, 20], [40, 8], [20, 24]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="prefill-decode")
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    from tessera.plan.planner import plan_policy
    from tessera.runtime.pair_costs import local_pair_costs
    from tessera.runtime.prompt_profile import serving_profile
    from tessera.runtime.session import planned_decode_position, runtime_context, runtime_graphs
    from tessera.runtime.step_excess_probe import with_step_excess
    from tessera.serve.config import ServeConfig
    from tessera.serve.engine import GenerationParams
    from tessera.serve.launch import PLAN_OUTPUT, PLAN_PROMPT, start_engine
    from tessera.sim.requests import engines_for
    from tessera.workload import draw_requests, parse_workload

    torch.set_num_threads(1)
    slots, max_context = 8, 128
    say = lambda s: print(s, file=sys.stderr)  # noqa: E731
    link, feedback_s = local_pair_costs(output_bytes=4 * 49152 * slots // 2)
    base = runtime_graphs(MODEL, PLAN_PROMPT, max_context, slots)
    # the profile bench_serve.py simulates with: every served step measured, decode at the planned position,
    # a kernel's excess inside a real step charged
    profile = serving_profile(MODEL, base, 1, slots, max_context, ServeConfig.min_prompt_bucket, say,
                              planned_decode_position(PLAN_PROMPT, PLAN_OUTPUT, max_context))
    profile.overhead = with_step_excess(profile.overhead, MODEL, ctx=max_context, slots=slots, log=say)
    pctx = runtime_context(MODEL, 2, PLAN_PROMPT, 64, max_context, slots, 1, profile, say)
    plan = plan_policy(pctx, args.policy, "throughput")
    cfg = ServeConfig(MODEL, "cpu:2", slots=slots, max_context=max_context, policy=args.policy, threads=1,
                      latency_policy=args.policy if args.policy != "request-dist" else None)
    engine, how = start_engine(cfg, say)
    say(f"serving: {how}")
    sims = engines_for(pctx, plan, "throughput", max_context, feedback_s, cfg.min_prompt_bucket, link)
    plain = copy.copy(profile)
    plain.overhead = None
    plain_ctx = runtime_context(MODEL, 2, PLAN_PROMPT, 64, max_context, slots, 1, plain, say)
    plain_timer = engines_for(plain_ctx, plan_policy(plain_ctx, args.policy, "throughput"), "throughput", max_context,
                              feedback_s, cfg.min_prompt_bucket, link)[0].timer

    records: list[dict] = []
    starts: dict[int, tuple[float, float]] = {}
    start_step, end_step = engine._start_step, engine._end_step

    def timed_start(step):
        # the furthest cache position a decode step's rows read, as the request simulator charges the step
        position = max(r.context for r in step.requests) - 1 if step.phase == "decode" and step.requests else None
        t0 = time.perf_counter()
        handle, context = start_step(step)
        starts[id(step)] = (t0, time.perf_counter() - t0, position)
        return handle, context

    def timed_end(step, handle, context):
        t0 = time.perf_counter()
        end_step(step, handle, context)
        t1 = time.perf_counter()
        began, start_s, position = starts.pop(id(step), (t0, 0.0, None))
        timings = list(getattr(handle, "timings", []) or [])
        records.append({"phase": step.phase, "rows": step.rows, "seq": step.seq, "ctx": step.ctx,
                        "requests": len(step.requests), "wall": t1 - began, "position": position,
                        "engine": start_s + t1 - t0,
                        "driver": sum(t.seconds for t in timings),
                        "worker": {d: w for t in timings for d, w in zip(t.workers, t.worker_seconds, strict=True)},
                        "compute": {d: c for t in timings for d, c in zip(t.workers, t.compute_s, strict=True)}})

    engine.lanes.start, engine.lanes.finish = timed_start, timed_end
    word = engine.tokenizer(" the", add_special_tokens=False).input_ids[-1]

    def serve(draws) -> None:
        done = threading.Semaphore(0)
        t0 = time.perf_counter()
        for t, n_in, n_out in draws:
            delay = t0 + t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            engine.submit([word] * n_in, GenerationParams(max_tokens=n_out),
                          lambda kind, payload: done.release() if kind in ("done", "error") else None)
        for _ in draws:
            done.acquire(timeout=600)

    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        lengths = Path(tmp) / "lengths.json"
        lengths.write_text(json.dumps(LENGTHS))
        wl = parse_workload(f"poisson:rate={args.rate},lengths={lengths},requests={args.requests}")
        draws = list(draw_requests(wl, args.seed))
        serve(draws[:4])  # warm-up, not recorded
        records.clear()
        load = os.getloadavg()[0]
        serve(draws)
    engine.stop()

    timer = sims[0].timer
    devices = [t.name for t in timer.targets]
    print(f"# {MODEL} on cpu:2, {args.policy} (served: {how}); {len(records)} steps; load average {load:.2f} -> "
          f"{os.getloadavg()[0]:.2f}; driver round trip {feedback_s * 1e3:.2f} ms; link {link.latency_s * 1e6:.0f} us")
    for kind in ("prefill", "decode"):
        mine = [r for r in records if r["phase"] == kind]
        if not mine:
            continue
        sim_first, sim_busy, kernels, plain_first, plain_busy = [], [], [], [], []
        for r in mine:
            t = timer.time(kind, r["rows"], r["seq"], r["ctx"], r["position"])  # as the request simulator times it
            sim_first.append(t.first_s)
            sim_busy.append(dict(zip(devices, t.busy_s, strict=True)))
            t0 = plain_timer.time(kind, r["rows"], r["seq"], r["ctx"], r["position"])
            plain_first.append(t0.first_s)
            plain_busy.append(dict(zip(devices, t0.busy_s, strict=True)))
            sp = timer.programs(kind, r["rows"], r["seq"], r["ctx"])
            kernels.append({devices[d]: sum(ins.kind == "run" for ins in p.instructions)
                            for d, p in enumerate(sp.programs)})
        used = sorted({d for b in sim_busy for d, v in b.items() if v > 0})
        mean = lambda xs: float(np.mean(xs)) * 1e3  # noqa: E731
        print(f"\n{kind}: {len(mine)} steps, rows {sorted({r['rows'] for r in mine})}, requests a step "
              f"{np.mean([r['requests'] for r in mine]):.1f}")
        print(f"  simulated step, profile alone   {mean(plain_first):8.2f} ms")
        print(f"  simulated step, host overhead   {mean(sim_first):8.2f} ms (engine step not charged here)")
        print(f"  measured engine wall            {mean([r['wall'] for r in mine]):8.2f} ms")
        print(f"  measured driver step            {mean([r['driver'] for r in mine]):8.2f} ms")
        print(f"  engine's own work (in/out)      {mean([r['engine'] for r in mine]):8.2f} ms")
        for d in used:
            k = np.mean([kk.get(d, 0) for kk in kernels])
            sb = mean([b.get(d, 0.0) for b in plain_busy])
            so = mean([b.get(d, 0.0) for b in sim_busy])
            cm = mean([r["compute"].get(d, 0.0) for r in mine])
            wk = mean([r["worker"].get(d, 0.0) for r in mine])
            print(f"  {d}: {k:.0f} kernels; simulated kernels {sb:7.2f} ms, with host overhead {so:7.2f} ms; "
                  f"measured compute {cm:7.2f} ms "
                  f"(+{(cm - sb) / max(k, 1) * 1e3:.1f} us a kernel); worker wall {wk:7.2f} ms")


if __name__ == "__main__":
    main()
