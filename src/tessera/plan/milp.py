"""Solve a placement problem exactly with HiGHS (mixed-integer linear programming).

Variables: ``x[i, d]`` (kernel i on device d, binary) and, for each edge and ordered device pair
(d, e), ``z >= x[src, d] + x[dst, e] - 1`` (the edge is cut from d to e). Throughput: minimise the cycle
time C >= each device's busy time and >= each directed link's transfer time. Latency: minimise the
critical path T over start times s, with s[dst] >= s[src] + time(src) + transfer(edge) along every edge.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import highspy
import numpy as np

from tessera.errors import TesseraError
from tessera.plan.problem import OBJECTIVES, Placement, PlacementProblem, PlacementProblemError

DEFAULT_GAP = 1e-4
UNIT_S = 1e-6  # the model counts microseconds: kernel times are 1e-6..1e-1 s, which HiGHS scales poorly
_NEGLIGIBLE = 1e-9  # coefficients below this (in microseconds) are dropped, as HiGHS would
DEFAULT_TIME_LIMIT_S = 60.0
_banner_shown = False


class SolverError(TesseraError):
    """HiGHS found no placement (infeasible constraints, or no solution within the time limit)."""


@contextmanager
def _quiet_stdout():
    """HiGHS prints a banner on stdout the first time a solver is made in a process; keep stdout clean."""
    global _banner_shown
    if _banner_shown:
        yield
        return
    fd = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(fd, 1)
        os.close(fd)
        _banner_shown = True


def _new_highs(gap: float, time_limit_s: float) -> highspy.Highs:
    with _quiet_stdout():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", gap)
    h.setOptionValue("time_limit", time_limit_s)
    return h


def _set_start(h, problem: PlacementProblem, objective: str, start: tuple[int, ...], x, cut, target,
               start_vars) -> None:
    """Give HiGHS a complete feasible solution for the assignment ``start`` (every column set)."""
    from tessera.plan.enumerate import critical_paths, cycle_times

    k = problem.kernels
    if len(start) != k:
        raise PlacementProblemError(f"the start assignment has {len(start)} entries for {k} kernels")
    a = np.array([start])
    values: dict[int, float] = {}
    for i in range(k):
        for d, var in enumerate(x[i]):
            values[var.index] = 1.0 if d == start[i] else 0.0
    for n, (src, dst, _) in enumerate(problem.edges):
        for (d, e), z in cut[n].items():
            values[z.index] = 1.0 if (start[src], start[dst]) == (d, e) else 0.0
    if objective == "throughput":
        values[target.index] = _us(float(cycle_times(problem, a)[0])) * (1 + 1e-9)
    else:
        t = problem.times[np.arange(k), list(start)]
        begin = np.zeros(k)
        for src, dst, nbytes in sorted(problem.edges, key=lambda e: e[1]):
            begin[dst] = max(begin[dst], begin[src] + t[src] + problem.transfer_time(nbytes, start[src], start[dst]))
        for i, var in enumerate(start_vars):
            values[var.index] = _us(float(begin[i]))
        values[target.index] = _us(float(critical_paths(problem, a)[0])) * (1 + 1e-9)
    solution = highspy.HighsSolution()
    solution.col_value = [values.get(c, 0.0) for c in range(h.getNumCol())]
    solution.value_valid = True
    h.setSolution(solution)


def _us(seconds: float) -> float:
    return seconds / UNIT_S


def solve_placement(problem: PlacementProblem, objective: str = "throughput", *, gap: float = DEFAULT_GAP,
                    time_limit_s: float = DEFAULT_TIME_LIMIT_S, start: tuple[int, ...] | None = None) -> Placement:
    """The placement minimising ``objective`` (throughput: cycle time; latency: critical path).

    ``start`` is a known assignment to begin from (e.g. every kernel on its best single device): the
    solver then always has that placement to return, and prunes with it."""
    if objective not in OBJECTIVES:
        raise PlacementProblemError(f"objective must be one of {', '.join(OBJECTIVES)} (got {objective!r})")
    k, nd = problem.times.shape
    h = _new_highs(gap, time_limit_s)
    finite = np.isfinite(problem.times)
    x = [[h.addVariable(lb=0, ub=1 if finite[i, d] else 0, type=highspy.HighsVarType.kInteger) for d in range(nd)]
         for i in range(k)]
    for i in range(k):
        h.addConstr(sum(x[i]) == 1)
    for i, dev in problem.pinned.items():
        h.addConstr(x[i][dev] == 1)
    for i, j in problem.together:
        for d in range(nd):
            h.addConstr(x[i][d] - x[j][d] == 0)
    times = np.where(finite, problem.times, 0.0) / UNIT_S
    time_of = [sum(float(times[i, d]) * x[i][d] for d in range(nd) if times[i, d] > _NEGLIGIBLE) for i in range(k)]
    cut: list[dict[tuple[int, int], object]] = []
    for src, dst, _ in problem.edges:
        pairs = {}
        for d in range(nd):
            for e in range(nd):
                if d != e and finite[src, d] and finite[dst, e]:
                    z = h.addVariable(lb=0, ub=1)
                    h.addConstr(z - x[src][d] - x[dst][e] >= -1)
                    pairs[(d, e)] = z
        cut.append(pairs)
    if objective == "throughput":
        target = h.addVariable(lb=0)
        for d in range(nd):
            h.addConstr(target - sum(float(times[i, d]) * x[i][d] for i in range(k) if times[i, d] > _NEGLIGIBLE) >= 0)
        for d in range(nd):
            for e in range(nd):
                load = [_us(problem.transfer_time(nbytes, d, e)) * cut[n][(d, e)]
                        for n, (_, _, nbytes) in enumerate(problem.edges)
                        if (d, e) in cut[n] and _us(problem.transfer_time(nbytes, d, e)) > _NEGLIGIBLE]
                if load:
                    h.addConstr(target - sum(load) >= 0)
    else:
        target = h.addVariable(lb=0)
        start_vars = [h.addVariable(lb=0) for _ in range(k)]
        for n, (src, dst, nbytes) in enumerate(problem.edges):
            transfer = sum(_us(problem.transfer_time(nbytes, d, e)) * z for (d, e), z in cut[n].items()
                           if _us(problem.transfer_time(nbytes, d, e)) > _NEGLIGIBLE)
            h.addConstr(start_vars[dst] - start_vars[src] - time_of[src] - transfer >= 0)
        for i in range(k):
            h.addConstr(target - start_vars[i] - time_of[i] >= 0)
    h.changeColCost(target.index, 1.0)  # minimise the target (set before the start: changing costs drops it)
    if start is not None:
        _set_start(h, problem, objective, start, x, cut, target, None if objective == "throughput" else start_vars)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    if status == highspy.HighsModelStatus.kInfeasible:
        raise SolverError("no placement satisfies the pinned and together constraints (infeasible)")
    if info.primal_solution_status == 0:
        raise SolverError(f"HiGHS found no placement within {time_limit_s:g} s ({h.modelStatusToString(status)})")
    sol = h.getSolution().col_value
    assignment = tuple(int(np.argmax([sol[x[i][d].index] for d in range(nd)])) for i in range(k))
    value = float(info.objective_function_value) * UNIT_S
    bound = float(info.mip_dual_bound) * UNIT_S
    return Placement(assignment, objective, value, bound, float(info.mip_gap),
                     status == highspy.HighsModelStatus.kOptimal)
