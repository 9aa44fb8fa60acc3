"""Check the upper bound's one assumption on a case: no batch below B beats the candidate batches.

`tessera.plan.bound` lets the repeated phase run at the candidate batches B // M (M = 1, 2, 4, 8). A plan
could run its engines at any batch up to B; this solves the bound's LP with the repeated phase at each
single batch 1..B in turn (the other phases as the bound has them) and reports the largest throughput
any of them reaches as a share of the bound (at most 1 when the assumption holds), and every batch that
exceeds it. It traces one graph per batch (about 0.3 s each for an 8B model).

    PYTHONPATH=src python tools/bound_batches.py llama-3.1-8b A100:1,L40S:1 fixed:in=1024,out=1024,requests=192
"""

from __future__ import annotations

import argparse

from tessera.hardware.cluster import parse_cluster
from tessera.plan import bound
from tessera.plan.context import PlanContext
from tessera.workload import parse_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("cluster")
    parser.add_argument("workload")
    args = parser.parse_args()
    ctx = PlanContext(args.model, parse_cluster(args.cluster), parse_workload(args.workload), args.workload)
    ub = bound.upper_bound(ctx)
    names, counts, singles = bound.single_targets(ctx)
    others = [[bound.phase_costs(ctx, ph, singles, counts, names)] for ph in ctx.phases if ph is not ctx.main_phase]
    links = bound.outbound_bandwidth(ctx, names)
    worst, over = (0.0, 0), []
    for b in range(1, ub.batch + 1):
        child = ctx.for_batch(b)
        mode = bound.phase_costs(child, child.main_phase, singles, counts, names)
        t = bound.fractional_request_time([*others, [mode]], counts, links).request_time_s
        share = ctx.outputs_per_request / t / ub.throughput
        worst = max(worst, (share, b))
        if share > 1 + 1e-9:
            over.append((b, share))
        if b not in ub.candidates:  # keep memory flat: only the candidates' graphs stay cached
            ctx.graphs.pop(next(k for k in ctx.graphs if k[0] == child.main_phase.phase and k[1] == b), None)
    print(f"{args.model} on {args.cluster}, {args.workload}: bound {ub.throughput:,.1f} {ub.unit} at B = {ub.batch} "
          f"(candidates {', '.join(map(str, ub.candidates))}); the best single batch reaches {worst[0]:.6f} of it "
          f"(batch {worst[1]}); batches above it: {over if over else 'none'}")


if __name__ == "__main__":
    main()
