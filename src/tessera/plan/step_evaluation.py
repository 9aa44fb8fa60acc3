"""The exact objective of one assignment of a placement problem, with its parts.

Every plan is re-verified here on the unfolded problem whatever produced it (folded MILP, baseline
search), so reported figures never depend on a solver's approximations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.plan.enumerate import busy_times, critical_paths, fits, link_loads, memory_use
from tessera.plan.problem import PlacementProblem


@dataclass(frozen=True)
class StepEvaluation:
    """One assignment's cost: per cycle of M micro-batches (seconds, bytes)."""

    cycle_s: float  # max(M x busiest device, M x busiest link, the better of the step run whole or streamed)
    critical_path_s: float  # one micro-batch's step as the devices run it (each device's kernels one after
    # another in program order, each waiting for its inputs' transfers), plus the transfers of cut loop edges
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
    evaluators, for one assignment; computed once per problem and assignment)."""
    a = np.asarray(assignment, dtype=np.int64)
    known = problem.evaluations
    key = a.tobytes()
    if key not in known:
        known[key] = _evaluate(problem, a)
    return known[key]


def _evaluate(problem: PlacementProblem, a: np.ndarray) -> StepEvaluation:
    one = a[None, :]
    m = problem.micro_batches
    busy = busy_times(problem, one)[0] * m
    link = link_loads(problem, one)[0] * m
    loops = sum(problem.transfer_time(nbytes, a[src], a[dst], count) for src, dst, nbytes, count in problem.loop_edges)
    sched = schedule(problem, a, loops)
    # one device runs its kernels one after another: a micro-batch also waits for the busiest device
    cp = float(max(critical_paths(problem, one)[0], busy.max(initial=0.0) / m + loops, sched.one_s + loops))
    cut = [(src, dst, nbytes) for src, dst, nbytes in problem.edges if a[src] != a[dst]]
    cut += [(src, dst, nbytes) for src, dst, nbytes, _ in problem.loop_edges if a[src] != a[dst]]
    use = memory_use(problem, one)
    resident = use[0]
    # M micro-batches run either as one step in segment order, or streamed with the next steps: the better
    streamed = max(cp, sched.stream_s)
    together = sched.all_s + loops
    cycle = float(max(busy.max(initial=0.0), link.max(initial=0.0), min(streamed, together)))
    return StepEvaluation(cycle, cp, tuple(busy.tolist()), tuple(tuple(r) for r in link.tolist()), len(cut),
                          m * sum(nbytes for *_, nbytes in cut), tuple(resident.tolist()),
                          bool(fits(problem, use)[0]))


@dataclass(frozen=True)
class Schedule:
    """A step as the runtime runs it (each device's kernels one after another, a kernel starting once its
    device is free and its inputs arrived): ``one_s`` for one micro-batch; ``all_s`` for M micro-batches
    in the runtime's step order (segment by segment, each for micro-batches 0..M-1); ``stream_s`` per step
    when steps stream back to back as the runtime streams them (every device takes jobs, one micro-batch of
    one step each, first come first served; a micro-batch's next step is ready once its step finished on
    every device, plus ``loops_s`` for the transfers of cut loop edges), once the pipeline is full."""

    one_s: float
    stream_s: float
    all_s: float


STREAM_STEPS = 4  # steps streamed to measure the steady-state period (plans and the simulator)


@dataclass(frozen=True)
class _Placed:
    """An assignment as the list schedules walk it: runs of consecutive kernels on one device (segments),
    each kernel's inputs from another device with their transfer seconds, and each kernel's time."""

    a: list[int]
    segments: list[list[int]]
    cut: dict[int, list[tuple[int, float]]]
    times: list[float]
    devices: int


def _placed(problem: PlacementProblem, a: list[int]) -> _Placed:
    cut: dict[int, list[tuple[int, float]]] = {}
    for (src, dst, nbytes), count in zip(problem.edges, problem.messages, strict=True):
        if a[src] != a[dst]:
            cut.setdefault(dst, []).append((src, problem.transfer_time(nbytes, a[src], a[dst], count)))
    segments: list[list[int]] = []
    for k in range(problem.kernels):
        if segments and a[segments[-1][-1]] == a[k]:
            segments[-1].append(k)
        else:
            segments.append([k])
    return _Placed(a, segments, cut, problem.times[np.arange(problem.kernels), a].tolist(), len(problem.devices))


def _run_job(p: _Placed, free: list[float], ready: float) -> float:
    """List-schedule one micro-batch of one step after what ``free`` (per device, updated) already holds,
    no kernel starting before ``ready``; when its last kernel finishes."""
    fin = [0.0] * len(p.times)
    end = ready
    for seg in p.segments:
        d = p.a[seg[0]]
        t = max(free[d], ready)
        for k in seg:
            for src, tt in p.cut.get(k, ()):
                t = max(t, fin[src] + tt)
            t += p.times[k]
            fin[k] = t
        free[d] = t
        end = max(end, t)
    return end


def _run_whole(p: _Placed, m: int) -> float:
    """M micro-batches run whole, segment by segment (each for micro-batches 0..M-1): the last finish."""
    finish = [[0.0] * len(p.times) for _ in range(m)]
    free = [0.0] * p.devices
    for seg in p.segments:
        d = p.a[seg[0]]
        for mb in range(m):
            fin = finish[mb]
            for k in seg:
                start = free[d]  # inputs from this device are ready: it ran their producers earlier
                for src, t in p.cut.get(k, ()):
                    start = max(start, fin[src] + t)
                fin[k] = start + p.times[k]
                free[d] = fin[k]
    return max(free, default=0.0)


def _stream_period(p: _Placed, m: int, loops_s: float, steps: int = STREAM_STEPS) -> float:
    """Seconds per step of ``steps`` steps streamed (see :class:`Schedule`) once the first has finished."""
    free = [0.0] * p.devices
    ready = [0.0] * m
    done = []
    for _ in range(steps):
        for mb in range(m):  # first come first served: micro-batch mb's next step is ready after the others'
            ready[mb] = _run_job(p, free, ready[mb]) + loops_s
        done.append(max(ready) - loops_s)
    return (done[-1] - done[0]) / (steps - 1) if steps > 1 else done[0]


def schedule(problem: PlacementProblem, assignment, loops_s: float = 0.0) -> Schedule:
    """The step of ``assignment`` list-scheduled as the runtime runs it (see :class:`Schedule`)."""
    p = _placed(problem, [int(x) for x in assignment])
    one = _run_job(p, [0.0] * p.devices, 0.0)
    m = problem.micro_batches
    if m == 1:  # each streamed step waits for the one before it: the step alone, then its loop transfers
        return Schedule(one, one + loops_s, one)
    return Schedule(one, _stream_period(p, m, loops_s), _run_whole(p, m))
