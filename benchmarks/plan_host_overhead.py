"""Which plan `tessera serve MODEL --cluster cpu:2` picks (its default policy, ``tessera``: the planner's best
from this host's measurements) with and without the host's overhead charged (the executor's dispatch per
kernel, weights read from memory: `tessera.cost.host_overhead`), beside the three policies of issue 32.

    PYTHONPATH=src .venv/bin/python benchmarks/plan_host_overhead.py [--slots 8] [--max-context 512]

The planning context is `tessera serve`'s own (`tessera.serve.launch.plan_assignments`): the runtime's graphs
at its slots and context, this host's profile at one thread per worker. Per plan: its policy and what the
``tessera`` policy chose, planned throughput and TPOT, each phase's kernels per worker.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

MODEL = "smollm2-135m"
POLICIES = ("tessera", "prefill-decode", "layer-pipeline", "request-dist")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=512)
    args = ap.parse_args()

    import torch

    from tessera.plan.planner import plan_policy
    from tessera.runtime.session import host_profile, runtime_context, runtime_graphs
    from tessera.serve.launch import PLAN_PROMPT

    torch.set_num_threads(1)
    say = lambda s: print(s, file=sys.stderr)  # noqa: E731
    base = runtime_graphs(MODEL, PLAN_PROMPT, args.max_context, args.slots)
    measured = host_profile(MODEL, base, 1, say)
    print(f"# {MODEL} on cpu:2, {args.slots} slots, context {args.max_context}; load average "
          f"{os.getloadavg()[0]:.2f}; host overhead: {measured.overhead.describe()}")
    print("| host overhead | policy | picked | tokens/s | TPOT (ms) | TTFT (ms) | kernels per worker (prefill; decode) |")
    print("|---|---|---|---|---|---|---|")
    for charged in (False, True):
        profile = copy.copy(measured)
        profile.overhead = measured.overhead if charged else None
        ctx = runtime_context(MODEL, 2, PLAN_PROMPT, 64, args.max_context, args.slots, 1, profile, say)
        for policy in POLICIES:
            plan = plan_policy(ctx, policy, "throughput")
            if not plan.applicable or not plan.feasible:
                print(f"| {'on' if charged else 'off'} | {policy} | - | not applicable: {plan.reason} |")
                continue
            picked = plan.extra.get("chosen") or plan.extra.get("picked") or plan.reason or "-"
            split = "; ".join(", ".join(f"{plan.targets[t]} {s.assignment.count(t)}" for t in sorted(set(s.assignment)))
                              for s in plan.steps if s.objective == "throughput")
            print(f"| {'on' if charged else 'off'} | {policy} | {str(picked)[:60]} | {plan.throughput:.1f} | "
                  f"{plan.latency_s * 1e3:.1f} | {plan.ttft_s * 1e3:.1f} | {split} |")


if __name__ == "__main__":
    main()
