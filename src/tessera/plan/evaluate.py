"""The exact objective of one assignment of a placement problem, with its parts.

Every plan is re-verified here on the unfolded problem whatever produced it (folded MILP, baseline
search), so reported figures never depend on a solver's approximations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.plan.enumerate import busy_times, critical_paths, link_loads, memory_fits, memory_use
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
    """The throughput and latency objectives of ``assignment`` and what makes them up (the enumerator's
    evaluators, for one assignment)."""
    a = np.asarray(assignment, dtype=int)
    one = a[None, :]
    m = problem.micro_batches
    busy = busy_times(problem, one)[0] * m
    link = link_loads(problem, one)[0] * m
    loops = sum(problem.transfer_time(nbytes, a[src], a[dst], count) for src, dst, nbytes, count in problem.loop_edges)
    # one device runs its kernels one after another: a micro-batch also waits for the busiest device
    cp = float(max(critical_paths(problem, one)[0], busy.max(initial=0.0) / m + loops))
    cut = [(src, dst, nbytes) for src, dst, nbytes in problem.edges if a[src] != a[dst]]
    cut += [(src, dst, nbytes) for src, dst, nbytes, _ in problem.loop_edges if a[src] != a[dst]]
    resident = memory_use(problem, one)[0]
    cycle = float(max(busy.max(initial=0.0), link.max(initial=0.0), cp))
    return StepEvaluation(cycle, cp, tuple(busy.tolist()), tuple(tuple(r) for r in link.tolist()), len(cut),
                          m * sum(nbytes for *_, nbytes in cut), tuple(resident.tolist()),
                          bool(memory_fits(problem, one)[0]))
