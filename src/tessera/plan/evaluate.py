"""The exact objective of one assignment of a placement problem, with its parts.

Every plan is re-verified here on the unfolded problem whatever produced it (folded MILP, baseline
search), so reported figures never depend on a solver's approximations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.plan.problem import PlacementProblem


@dataclass(frozen=True)
class StepEvaluation:
    """One assignment's cost: per cycle of M micro-batches (seconds, bytes)."""

    cycle_s: float  # max(M x busiest device, M x busiest link, critical path)
    critical_path_s: float  # one micro-batch's step: the longest path (compute plus transfers) or the
    # busiest device's serial work, whichever is longer, plus the transfers of cut loop edges
    busy_s: tuple[float, ...]  # per device, per cycle (M micro-batches)
    link_s: tuple[tuple[float, ...], ...]  # per directed device pair, per cycle
    cut_edges: int  # per micro-batch
    cut_bytes: float  # per cycle
    resident_bytes: tuple[float, ...]  # items (weights, state) resident on each device
    memory_ok: bool

    @property
    def bottleneck(self) -> str:
        """What bounds the cycle: "compute", "link" or "dependencies" (the critical path)."""
        busy, link = max(self.busy_s), max((max(r) for r in self.link_s), default=0.0)
        top = max(busy, link, self.critical_path_s)
        return "compute" if top == busy else "link" if top == link else "dependencies"


def evaluate(problem: PlacementProblem, assignment: tuple[int, ...] | list[int]) -> StepEvaluation:
    """The throughput and latency objectives of ``assignment`` and what makes them up."""
    a = np.asarray(assignment, dtype=int)
    k, d = problem.times.shape
    m = problem.micro_batches
    t = problem.times[np.arange(k), a]
    busy = np.bincount(a, weights=t, minlength=d) * m
    link = np.zeros((d, d))
    finish = np.zeros(k)
    start = np.zeros(k)
    cut = 0
    cut_bytes = 0.0
    for (src, dst, nbytes), count in zip(problem.edges, problem.messages, strict=True):
        cost = problem.transfer_time(nbytes, a[src], a[dst], count)
        if a[src] != a[dst]:
            link[a[src], a[dst]] += cost * m
            cut += 1
            cut_bytes += nbytes * m
    preds: dict[int, list[tuple[int, float]]] = {}
    for (src, dst, nbytes), count in zip(problem.edges, problem.messages, strict=True):
        preds.setdefault(dst, []).append((src, problem.transfer_time(nbytes, a[src], a[dst], count)))
    for j in range(k):
        start[j] = max((finish[s] + c for s, c in preds.get(j, ())), default=0.0)
        finish[j] = start[j] + t[j]
    loops = 0.0
    for src, dst, nbytes, count in problem.loop_edges:
        if a[src] != a[dst]:
            cost = problem.transfer_time(nbytes, a[src], a[dst], count)
            link[a[src], a[dst]] += cost * m
            loops += cost
            cut += 1
            cut_bytes += nbytes * m
    # one device runs its kernels one after another: a micro-batch also waits for the busiest device
    cp = float(max(finish.max(initial=0.0), busy.max(initial=0.0) / m) + loops)
    resident = np.zeros(d)
    ok = True
    if problem.memory is not None:
        on = np.zeros((len(problem.memory.item_bytes), d), dtype=bool)
        for i, w in problem.memory.reads:
            on[w, a[i]] = True
        resident = (on * problem.memory.item_bytes[:, None]).sum(axis=0)
        ok = bool((resident <= problem.memory.capacity * (1 + 1e-9)).all())
    cycle = float(max(busy.max(initial=0.0), link.max(initial=0.0), cp))
    return StepEvaluation(cycle, cp, tuple(busy.tolist()), tuple(tuple(r) for r in link.tolist()), cut,
                          cut_bytes, tuple(resident.tolist()), ok)
