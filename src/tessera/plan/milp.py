"""Solve a placement problem with HiGHS (mixed-integer linear programming), to a proven gap.

The exact model is built in named steps, each adding its columns and rows:

* :func:`_assignment`: ``x[i, d]`` binary, kernel i runs on device d (one device each; pinned kernels
  fixed, ``together`` pairs equal, devices where a kernel cannot run closed).
* :func:`_pairs`: for each edge (and loop edge) ``y[n, d, e] >= 0``, the edge goes from device d to e.
  Its rows are the transportation constraints ``sum_e y[n, d, e] = x[src, d]`` and
  ``sum_d y[n, d, e] = x[dst, e]``: the convex hull of one edge's pair of one-hot assignments, so a
  fractional LP still pays for moving mass between devices.
* :func:`_busy`: cycle >= M x the kernel time on each device.
* :func:`_links`: cycle >= M x the transfer time of each directed link (edges and loop edges).
* :func:`_critical_path`: start times ``s[dst] >= s[src] + time(src) + transfer(edge)``; the critical
  path (the cycle's own column for throughput) is >= every sink's finish plus the transfers of cut
  loop edges.
* :func:`_memory`: ``r[w, d] >= x[i, d]`` for every reader i of item w; ``sum_w bytes[w] r[w, d] <=
  capacity[d]``.

Throughput minimises the cycle; latency minimises the critical path. Times are in microseconds (kernel
times span 1e-6..1e-1 s, which HiGHS scales poorly in seconds).

:func:`solve_placement` works in three stages. (1) The LP of a smaller relaxation
(:func:`_build_relaxation`: per pair only "leaves device d" variables, links bounded per device)
gives a proven lower bound and a fractional assignment in a fraction of the exact LP's time. (2) The
heuristics of :mod:`tessera.plan.heuristics` round that assignment and improve it, with pipelines
and the caller's start. (3) Only if the best placement is not within the gap of the bound does HiGHS
solve the exact MILP from it for the time left (skipped when that time cannot even cover the exact
model's root LP). Returned values are re-evaluated with :mod:`tessera.plan.enumerate`'s evaluators
and ``optimal`` is checked against the best bound here, so both are exact for the returned assignment.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import highspy
import numpy as np

from tessera.errors import TesseraError
from tessera.plan.problem import OBJECTIVES, Placement, PlacementProblem, PlacementProblemError

DEFAULT_GAP = 1e-4
UNIT_S = 1e-6  # the model counts microseconds
_NEGLIGIBLE = 1e-9  # coefficients below this (in microseconds) are dropped, as HiGHS would
DEFAULT_TIME_LIMIT_S = 60.0
SHORTFALL_TIME_LIMIT_S = 10.0  # for explaining why the items do not fit memory
HEURISTIC_SHARE = 0.8  # of the time left after the relaxation, at most, for the heuristics
HEURISTIC_LP_FACTOR = 8.0  # x the relaxation's LP time: problems whose LP is fast have a fast MILP
HEURISTIC_MIN_S = 0.05
MIN_MILP_S = 0.2
RELAXATION_SHARE = 0.7  # of the time limit, at most, for the relaxation's LP (else only simple_bound)
MILP_ROOT_FACTOR = 20.0  # the exact root (LP and a round of cuts) over the relaxation's LP time, about
_MARGIN_S = 0.05
_INF = highspy.kHighsInf
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
    h.setOptionValue("time_limit", max(time_limit_s, 1e-3))
    return h


def _us(seconds):
    return np.asarray(seconds, dtype=float) / UNIT_S


@dataclass
class _Model:
    """A MILP under construction: columns (bounds, integrality, cost) and sparse rows, passed to HiGHS at once."""

    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[int] = field(default_factory=list)
    cost: dict[int, float] = field(default_factory=dict)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    starts: list[int] = field(default_factory=lambda: [0])
    index: list[int] = field(default_factory=list)
    value: list[float] = field(default_factory=list)

    def columns(self, shape, lower=0.0, upper=_INF, integer: bool = False) -> np.ndarray:
        """New columns (their indices, in ``shape``) with the given bounds (scalars or arrays)."""
        n = int(np.prod(shape))
        first = len(self.lower)
        self.lower.extend(np.broadcast_to(np.asarray(lower, dtype=float), (n,)).tolist())
        self.upper.extend(np.broadcast_to(np.asarray(upper, dtype=float), (n,)).tolist())
        if integer:
            self.integer.extend(range(first, first + n))
        return np.arange(first, first + n).reshape(shape)

    def row(self, cols, coefs, lower: float = -_INF, upper: float = _INF) -> None:
        """``lower <= sum coefs * cols <= upper`` (negligible coefficients dropped)."""
        cols = np.asarray(cols, dtype=np.int64).ravel()
        coefs = np.broadcast_to(np.asarray(coefs, dtype=float), cols.shape)
        keep = np.abs(coefs) > _NEGLIGIBLE
        self.index.extend(cols[keep].tolist())
        self.value.extend(coefs[keep].tolist())
        self.starts.append(len(self.index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    def to_highs(self, h: highspy.Highs) -> None:
        """Load the columns, integrality, costs and rows into ``h``."""
        n = len(self.lower)
        h.addVars(n, np.array(self.lower), np.array(self.upper))
        if self.integer:
            h.changeColsIntegrality(len(self.integer), np.array(self.integer, dtype=np.int32),
                                    np.full(len(self.integer), highspy.HighsVarType.kInteger))
        if self.cost:
            cols = np.array(list(self.cost), dtype=np.int32)
            h.changeColsCost(len(cols), cols, np.array(list(self.cost.values())))
        nrows = len(self.row_lower)
        if nrows:
            starts, index, value = self._merged()
            status = h.addRows(nrows, np.array(self.row_lower), np.array(self.row_upper), len(index), starts,
                               index, value)
            if status == highspy.HighsStatus.kError:
                raise RuntimeError("HiGHS rejected the placement model's rows")

    def _merged(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows in CSR form with repeated columns of a row summed (HiGHS rejects repeats) and zeros dropped."""
        ncols = len(self.lower)
        counts = np.diff(self.starts)
        rows = np.repeat(np.arange(len(counts)), counts)
        keys, inverse = np.unique(rows * ncols + np.array(self.index, dtype=np.int64), return_inverse=True)
        value = np.bincount(inverse, weights=np.array(self.value), minlength=len(keys))
        keep = np.abs(value) > _NEGLIGIBLE
        keys, value = keys[keep], value[keep]
        starts = np.searchsorted(keys // ncols, np.arange(len(counts)))
        return starts.astype(np.int32), (keys % ncols).astype(np.int32), value


@dataclass
class _Vars:
    """Column indices of each family of variables (see the module docstring)."""

    x: np.ndarray  # [K, D]
    edge: np.ndarray  # [E, D, D] y of edges (-1: impossible pair)
    loop: np.ndarray  # [L, D, D] y of loop edges
    start: np.ndarray | None = None  # [K] start times (us)
    cp: int | None = None  # critical path (us); the cycle column itself for throughput (cycle >= it)
    loops: int | None = None  # transfers of the cut loop edges (us)
    cycle: int | None = None  # throughput cycle (us)
    resident: np.ndarray | None = None  # [W, D] item w resident on device d


def _pair_costs(problem: PlacementProblem) -> tuple[np.ndarray, np.ndarray]:
    """[E, D, D] and [L, D, D] microseconds to move each edge and loop edge between devices (0 if uncut)."""
    nd = len(problem.devices)
    edge = [_us(problem.transfer_matrix(b, c)) for (_, _, b), c in zip(problem.edges, problem.messages, strict=True)]
    loop = [_us(problem.transfer_matrix(b, c)) for _, _, b, c in problem.loop_edges]
    return np.array(edge).reshape(-1, nd, nd), np.array(loop).reshape(-1, nd, nd)


def _assignment(m: _Model, problem: PlacementProblem) -> np.ndarray:
    """x[i, d] binary: one device per kernel, pinned kernels fixed, together pairs equal."""
    k, nd = problem.times.shape
    upper = np.isfinite(problem.times).astype(float)
    lower = np.zeros((k, nd))
    for i, dev in problem.pinned.items():
        upper[i] = 0.0
        upper[i, dev] = lower[i, dev] = 1.0
    x = m.columns((k, nd), lower.ravel(), upper.ravel(), integer=True)
    for i in range(k):
        m.row(x[i], 1.0, 1.0, 1.0)
    for i, j in problem.together:
        for d in range(nd):
            m.row([x[i, d], x[j, d]], [1.0, -1.0], 0.0, 0.0)
    return x


def _pairs(m: _Model, problem: PlacementProblem, x: np.ndarray, pairs: list[tuple[int, int]]) -> np.ndarray:
    """y[n, d, e] >= 0: pair n's src on d and dst on e, with transportation rows tying y to x."""
    nd = len(problem.devices)
    finite = np.isfinite(problem.times)
    y = np.full((len(pairs), nd, nd), -1, dtype=np.int64)
    for n, (src, dst) in enumerate(pairs):
        ok = finite[src][:, None] & finite[dst][None, :]
        if src == dst:
            ok &= np.eye(nd, dtype=bool)
        y[n][ok] = m.columns(int(ok.sum()))
        for d in range(nd):
            if ok[d].any():
                m.row(np.append(y[n, d][ok[d]], x[src, d]), np.append(np.ones(ok[d].sum()), -1.0), 0.0, 0.0)
            if ok[:, d].any():
                m.row(np.append(y[n, :, d][ok[:, d]], x[dst, d]), np.append(np.ones(ok[:, d].sum()), -1.0), 0.0, 0.0)
    return y


def _cut_terms(y: np.ndarray, cost: np.ndarray, link: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Columns and coefficients of the transfer time of pairs ``y`` (all links, or only ``link``)."""
    mask = y >= 0
    if link is not None:
        only = np.zeros(mask.shape[1:], dtype=bool)
        only[link] = True
        mask &= only
    else:
        mask &= ~np.eye(y.shape[1], dtype=bool)
    return y[mask], cost[mask]


def _busy(m: _Model, problem: PlacementProblem, x: np.ndarray, cycle: int) -> None:
    """cycle >= M x (kernel time on d) for every device d."""
    times = _us(np.where(np.isfinite(problem.times), problem.times, 0.0))
    for d in range(len(problem.devices)):
        m.row(np.append(x[:, d], cycle), np.append(-problem.micro_batches * times[:, d], 1.0), 0.0)


def _links(m: _Model, problem: PlacementProblem, v: _Vars, edge_cost: np.ndarray, loop_cost: np.ndarray) -> None:
    """cycle >= M x (transfer time of edges and loop edges cut from d to e) for every directed link."""
    nd = len(problem.devices)
    for d in range(nd):
        for e in range(nd):
            if d == e:
                continue
            cols_e, cost_e = _cut_terms(v.edge, edge_cost, (d, e))
            cols_l, cost_l = _cut_terms(v.loop, loop_cost, (d, e))
            cols = np.concatenate([cols_e, cols_l])
            if len(cols):
                coefs = -problem.micro_batches * np.concatenate([cost_e, cost_l])
                m.row(np.append(cols, v.cycle), np.append(coefs, 1.0), 0.0)


def _critical_path(m: _Model, problem: PlacementProblem, v: _Vars, edge_terms, loop_terms) -> None:
    """Start times along edges; cp >= each sink's finish + the transfers of cut loop edges.

    ``edge_terms(n)`` and ``loop_terms()`` give (columns, coefficients) of edge n's transfer time and of
    all loop edges' transfers (exact with pair variables, a lower bound in the relaxation). The
    critical path's column is the cycle's when there is one (cycle >= critical path)."""
    k = problem.kernels
    times = _us(np.where(np.isfinite(problem.times), problem.times, 0.0))
    v.start = m.columns(k)
    v.cp = v.cycle if v.cycle is not None else int(m.columns(1)[0])
    has_succ = np.zeros(k, dtype=bool)
    for n, (src, dst, _) in enumerate(problem.edges):
        has_succ[src] = True
        cols, cost = edge_terms(n)
        m.row(np.concatenate([[v.start[dst], v.start[src]], v.x[src], cols]),
              np.concatenate([[1.0, -1.0], -times[src], -cost]), 0.0)
    loops: list[int] = []
    if problem.loop_edges:  # one column for the constant term: the transfers of all cut loop edges
        loops = [int(m.columns(1)[0])]
        v.loops = loops[0]
        cols, cost = loop_terms()
        m.row(np.append(cols, loops[0]), np.append(-cost, 1.0), 0.0, 0.0)
    for i in np.flatnonzero(~has_succ):
        m.row(np.concatenate([[v.cp, v.start[i]], v.x[i], loops]),
              np.concatenate([[1.0, -1.0], -times[i], -np.ones(len(loops))]), 0.0)


def _memory(m: _Model, problem: PlacementProblem, x: np.ndarray, overflow: np.ndarray | None = None) -> np.ndarray:
    """r[w, d] >= x[i, d] for readers i of item w; resident bytes <= capacity (rows in capacity units, or
    in GB with an ``overflow`` column per device when explaining a shortfall)."""
    mem = problem.memory
    nd = len(problem.devices)
    r = m.columns((len(mem.item_bytes), nd), 0.0, 1.0)
    for w, readers in mem.readers().items():
        for i in sorted(set(readers)):
            for d in range(nd):
                m.row([r[w, d], x[i, d]], [1.0, -1.0], 0.0)
    for d in range(nd):
        if overflow is None:
            if mem.capacity[d] > 0:
                m.row(r[:, d], mem.item_bytes / mem.capacity[d], upper=1.0)
            else:
                m.row(r[:, d], (mem.item_bytes > 0).astype(float), upper=0.0)
        else:
            m.row(np.append(r[:, d], overflow[d]), np.append(mem.item_bytes / 1e9, -1.0), upper=mem.capacity[d] / 1e9)
    return r


def _build(problem: PlacementProblem, objective: str) -> tuple[_Model, _Vars]:
    """The whole MILP of ``objective``: its columns, rows and the variable families."""
    m = _Model()
    x = _assignment(m, problem)
    edge = _pairs(m, problem, x, [(s, d) for s, d, _ in problem.edges])
    loop = _pairs(m, problem, x, [(s, d) for s, d, _, _ in problem.loop_edges])
    v = _Vars(x, edge, loop)
    edge_cost, loop_cost = _pair_costs(problem)
    if objective == "throughput":
        v.cycle = int(m.columns(1)[0])
        _busy(m, problem, x, v.cycle)
        _links(m, problem, v, edge_cost, loop_cost)
    _critical_path(m, problem, v, lambda n: _cut_terms(edge[n:n + 1], edge_cost[n:n + 1]),
                   lambda: _cut_terms(loop, loop_cost))
    m.cost[v.cp] = 1.0  # the cycle (throughput) or the critical path (latency)
    if problem.memory is not None:
        v.resident = _memory(m, problem, x)
    return m, v


def _leaves(m: _Model, x: np.ndarray, pairs: list[tuple[int, int]]) -> np.ndarray:
    """out[n, d] >= x[src, d] - x[dst, d]: pair n leaves device d (1 for an integral cut pair's source device)."""
    nd = x.shape[1]
    out = m.columns((len(pairs), nd))
    for n, (src, dst) in enumerate(pairs):
        for d in range(nd):
            m.row([out[n, d], x[src, d], x[dst, d]], [1.0, -1.0, 1.0], 0.0)
    return out


def _cheapest(cost: np.ndarray) -> np.ndarray:
    """[N, D] the cheapest transfer of each pair leaving each device (to any other)."""
    nd = cost.shape[1]
    if nd == 1:
        return np.zeros((len(cost), 1))
    return np.where(np.eye(nd, dtype=bool), np.inf, cost).min(axis=2)


def _relaxed_links(m: _Model, problem: PlacementProblem, cycle: int, leaves: list[np.ndarray],
                   cheapest: list[np.ndarray]) -> None:
    """(D - 1) x cycle >= M x the cheapest transfers (``cheapest``: [N, D] per family of pairs, from
    :func:`_cheapest`) leaving each device: the D - 1 links out of a device together carry at least that.
    (The same rows for arrivals would need a second family of columns: they tightened no bound measured by
    more than 0.02% and made the LP up to 5x slower.)"""
    nd = len(problem.devices)
    if nd < 2:
        return
    for d in range(nd):
        cols = np.concatenate([out[:, d] for out in leaves])
        coefs = np.concatenate([c[:, d] for c in cheapest])
        if len(cols):
            m.row(np.append(cols, cycle), np.append(-problem.micro_batches * coefs, nd - 1.0), 0.0)


def _build_relaxation(problem: PlacementProblem, objective: str) -> tuple[_Model, _Vars]:
    """A smaller model whose optimum is a lower bound of :func:`_build`'s: pairs are only known to be cut
    (leaving a device, at its cheapest transfer), links are bounded per device, not per direction. Exact
    for integral assignments when transfers are the same on every link; its LP is fast and tight."""
    m = _Model()
    x = _assignment(m, problem)
    edge_pairs = [(s, d) for s, d, _ in problem.edges]
    loop_pairs = [(s, d) for s, d, _, _ in problem.loop_edges]
    edge, loop = _leaves(m, x, edge_pairs), _leaves(m, x, loop_pairs)
    edge_cost, loop_cost = _pair_costs(problem)
    edge_out, loop_out = _cheapest(edge_cost), _cheapest(loop_cost)
    v = _Vars(x, np.empty((0, 0, 0), dtype=np.int64), np.empty((0, 0, 0), dtype=np.int64))
    if objective == "throughput":
        v.cycle = int(m.columns(1)[0])
        _busy(m, problem, x, v.cycle)
        _relaxed_links(m, problem, v.cycle, [edge, loop], [edge_out, loop_out])
    _critical_path(m, problem, v, lambda n: (edge[n], edge_out[n]), lambda: (loop.ravel(), loop_out.ravel()))
    m.cost[v.cp] = 1.0
    if problem.memory is not None:
        v.resident = _memory(m, problem, x)
    return m, v


def check_assignment(problem: PlacementProblem, assignment) -> None:
    """Raise :class:`PlacementProblemError` naming the first constraint ``assignment`` breaks."""
    from tessera.plan.enumerate import memory_fits

    k, nd = problem.times.shape
    if len(assignment) != k:
        raise PlacementProblemError(f"the start assignment has {len(assignment)} entries for {k} kernels")
    a = np.asarray(assignment, dtype=np.int64)
    if ((a < 0) | (a >= nd)).any():
        raise PlacementProblemError(f"the start assignment names devices outside 0..{nd - 1}")
    bad = np.flatnonzero(~np.isfinite(problem.times[np.arange(k), a]))
    if len(bad):
        raise PlacementProblemError(f"the start assignment puts kernel {bad[0]} on a device where it cannot run")
    for i, dev in problem.pinned.items():
        if a[i] != dev:
            raise PlacementProblemError(f"the start assignment moves kernel {i}, pinned to device {dev}")
    for i, j in problem.together:
        if a[i] != a[j]:
            raise PlacementProblemError(f"the start assignment separates kernels {i} and {j}, which run together")
    if not memory_fits(problem, a[None])[0]:
        raise PlacementProblemError("the start assignment's resident items exceed a device's memory")


def _start_values(problem: PlacementProblem, v: _Vars, a: np.ndarray, ncols: int) -> np.ndarray:
    """Every column's value for the assignment ``a`` (a complete feasible MILP solution)."""
    from tessera.plan.enumerate import critical_paths, cycle_times

    k = problem.kernels
    col = np.zeros(ncols)
    col[v.x[np.arange(k), a]] = 1.0
    for y, pairs in ((v.edge, problem.edges), (v.loop, problem.loop_edges)):
        for n, pair in enumerate(pairs):
            col[y[n, a[pair[0]], a[pair[1]]]] = 1.0
    t = problem.times[np.arange(k), a]
    begin = np.zeros(k)
    for (src, dst, nbytes), count in sorted(zip(problem.edges, problem.messages, strict=True), key=lambda e: e[0][1]):
        begin[dst] = max(begin[dst], begin[src] + t[src] + problem.transfer_time(nbytes, a[src], a[dst], count))
    col[v.start] = _us(begin)
    if v.loops is not None:
        loops = sum(problem.transfer_time(nbytes, a[src], a[dst], count) for src, dst, nbytes, count in problem.loop_edges)
        col[v.loops] = float(_us(loops))
    col[v.cp] = float(_us(critical_paths(problem, a[None])[0])) * (1 + 1e-9)
    if v.cycle is not None:  # the same column as the critical path's
        col[v.cycle] = float(_us(cycle_times(problem, a[None])[0])) * (1 + 1e-9)
    if v.resident is not None:
        for w, readers in problem.memory.readers().items():
            col[v.resident[w, a[sorted(set(readers))]]] = 1.0
    return col


def _set_start(h: highspy.Highs, problem: PlacementProblem, v: _Vars, start) -> None:
    """Give HiGHS the complete feasible solution of the assignment ``start``."""
    solution = highspy.HighsSolution()
    solution.col_value = _start_values(problem, v, np.asarray(start, dtype=np.int64), h.getNumCol()).tolist()
    solution.value_valid = True
    h.setSolution(solution)


def _fmt_bytes(n: float) -> str:
    """Bytes for people: 1.5 GB, 20 MB, 3 kB, 12 B."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _infeasible_reason(problem: PlacementProblem) -> str:
    """Why no placement exists: the constraints alone, or memory (the least shortfall, per device)."""
    plain = "no placement satisfies the pinned and together constraints (infeasible)"
    if problem.memory is None:
        return plain
    m = _Model()
    x = _assignment(m, problem)
    overflow = m.columns(len(problem.devices))
    _memory(m, problem, x, overflow)
    for col in overflow:
        m.cost[int(col)] = 1.0
    h = _new_highs(1e-6, SHORTFALL_TIME_LIMIT_S)
    m.to_highs(h)
    h.run()
    if h.getInfo().primal_solution_status == 0:
        return plain
    sol = np.array(h.getSolution().col_value)
    a = np.argmax(sol[x], axis=1)
    from tessera.plan.enumerate import memory_use

    use = memory_use(problem, a[None])[0]
    cap = problem.memory.capacity
    short = [f"{problem.devices[d]} lacks {_fmt_bytes(use[d] - cap[d])} (holds {_fmt_bytes(use[d])} of items, "
             f"capacity {_fmt_bytes(cap[d])})" for d in range(len(cap)) if use[d] > cap[d] * (1 + 1e-9)]
    if not short:
        return plain
    least = "least" if h.getModelStatus() == highspy.HighsModelStatus.kOptimal else "smallest found"
    return ("the resident items do not fit device memory; the placement with the " + least + " total shortfall: "
            + "; ".join(short) + ". Give the devices more capacity, add devices or shrink the items")


def simple_bound(problem: PlacementProblem, objective: str) -> float:
    """A lower bound without an LP: the longest path at every kernel's fastest time with free transfers,
    and (throughput) M x the fastest times spread evenly over the devices."""
    k, nd = problem.times.shape
    fastest = np.where(np.isfinite(problem.times), problem.times, np.inf).min(axis=1)
    finish = fastest.copy()
    for src, dst, _ in sorted(problem.edges, key=lambda e: e[1]):
        finish[dst] = max(finish[dst], finish[src] + fastest[dst])
    bound = float(finish.max()) if k else 0.0
    if objective == "throughput":
        bound = max(bound, problem.micro_batches * float(fastest.sum()) / nd)
    return bound


def balance_bound(problem: PlacementProblem, time_limit_s: float) -> float:
    """M x the busiest device when kernels may be split over devices and transfers are free (an LP of
    only the assignment and busy rows: fast where the relaxation's is not); 0 if not solved in time
    (``time_limit_s`` counts building the model too)."""
    t0 = time.perf_counter()
    m = _Model()
    x = _assignment(m, problem)
    cycle = int(m.columns(1)[0])
    _busy(m, problem, x, cycle)
    m.cost[cycle] = 1.0
    h = _new_highs(0.0, time_limit_s - (time.perf_counter() - t0))
    m.to_highs(h)
    h.setOptionValue("solve_relaxation", True)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return 0.0
    return float(h.getInfo().objective_function_value) * UNIT_S


@dataclass
class _Relaxation:
    """The relaxation's LP: a proven lower bound and its fractional assignment (None if not solved)."""

    bound: float | None
    split: np.ndarray | None
    infeasible: bool = False


def _relaxation_lp(problem: PlacementProblem, objective: str, time_limit_s: float) -> _Relaxation:
    """Solve the LP of :func:`_build_relaxation` (its value bounds every placement's objective from below)
    within ``time_limit_s`` seconds, building the model included."""
    t0 = time.perf_counter()
    model, v = _build_relaxation(problem, objective)
    h = _new_highs(0.0, time_limit_s - (time.perf_counter() - t0))
    model.to_highs(h)
    h.setOptionValue("solve_relaxation", True)
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return _Relaxation(None, None, infeasible=True)
    if status != highspy.HighsModelStatus.kOptimal:
        return _Relaxation(None, None)
    split = np.array(h.getSolution().col_value)[v.x]
    return _Relaxation(float(h.getInfo().objective_function_value) * UNIT_S, split)


def _solve_milp(problem: PlacementProblem, objective: str, gap: float, deadline: float,
                start) -> tuple[np.ndarray | None, float, bool]:
    """HiGHS on the exact model from the feasible assignment ``start`` (or None) until ``deadline``
    (perf_counter): (assignment or None, dual bound in seconds, infeasible)."""
    model, v = _build(problem, objective)
    if start is not None and deadline - time.perf_counter() < MIN_MILP_S:
        return None, 0.0, False  # no time left after building: the start stands
    h = _new_highs(gap, max(deadline - time.perf_counter(), MIN_MILP_S))
    model.to_highs(h)
    if start is not None:
        # HiGHS 1.16 can misread a start in its presolved space (it took the critical path for the cycle
        # and declared that optimal): with a start, the model is solved as built
        h.setOptionValue("presolve", "off")
        _set_start(h, problem, v, start)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    if status == highspy.HighsModelStatus.kInfeasible:
        return None, 0.0, True
    bound = float(info.mip_dual_bound) * UNIT_S if np.isfinite(info.mip_dual_bound) else 0.0
    if info.primal_solution_status == 0:
        return None, bound, False
    sol = np.array(h.getSolution().col_value)
    return np.argmax(sol[v.x], axis=1), bound, False


def solve_placement(problem: PlacementProblem, objective: str = "throughput", *, gap: float = DEFAULT_GAP,
                    time_limit_s: float = DEFAULT_TIME_LIMIT_S, start: tuple[int, ...] | None = None) -> Placement:
    """The placement minimising ``objective`` (throughput: cycle time; latency: critical path), within
    the relative ``gap`` of a proven lower bound when ``optimal``; at most about ``time_limit_s`` seconds.

    Three stages: the LP of a relaxation gives a lower bound and a fractional assignment; heuristics
    (:mod:`tessera.plan.heuristics`, seeded with ``start`` if given) find a good placement; if it is
    not within ``gap`` of the bound, HiGHS solves the exact MILP from it for the time left. ``start`` must be feasible; the result is never worse than it. ``bound`` is the best bound
    proven; ``optimal``: the value is within ``gap`` of it."""
    from tessera.plan import heuristics
    from tessera.plan.enumerate import objective_values

    if objective not in OBJECTIVES:
        raise PlacementProblemError(f"objective must be one of {', '.join(OBJECTIVES)} (got {objective!r})")
    t0 = time.perf_counter()
    if start is not None:
        check_assignment(problem, start)
    relaxation = _relaxation_lp(problem, objective, RELAXATION_SHARE * time_limit_s)
    if relaxation.infeasible:
        raise SolverError(_infeasible_reason(problem))
    lower = max(relaxation.bound or 0.0, simple_bound(problem, objective))
    if relaxation.bound is None and objective == "throughput":  # the LP ran out of time: balance alone
        lower = max(lower, balance_bound(problem, 0.1 * time_limit_s))
    lp_s = time.perf_counter() - t0

    left = time_limit_s - lp_s
    budget = min(HEURISTIC_SHARE * left, max(HEURISTIC_LP_FACTOR * lp_s, HEURISTIC_MIN_S))
    milp_useful = left - budget >= MILP_ROOT_FACTOR * lp_s  # time for at least the exact model's root LP
    found = heuristics.best_start(problem, objective, max(budget if milp_useful else left - _MARGIN_S, 0.0),
                                  relaxation.split, extra=[start] if start is not None else None,
                                  target=lower / (1 - gap) if 0 <= gap < 1 else np.inf)

    def result(assignment, value: float, bound: float) -> Placement:
        """The placement, its exact value and the best proven bound; ``optimal``: within ``gap`` of it
        (checked here, not taken from HiGHS's status)."""
        bound = min(bound, value)
        rel_gap = (value - bound) / value if value > 0 else 0.0
        return Placement(tuple(int(d) for d in assignment), objective, value, bound, rel_gap,
                         rel_gap <= gap * (1 + 1e-6) + 1e-9, time.perf_counter() - t0)

    if found is not None and found[0] - lower <= gap * found[0]:
        return result(found[1], found[0], lower)
    left = time_limit_s - (time.perf_counter() - t0)
    if found is not None and (left < MIN_MILP_S or not milp_useful):
        return result(found[1], found[0], lower)
    assignment, bound, infeasible = _solve_milp(problem, objective, gap, t0 + time_limit_s,
                                                None if found is None else found[1])
    if infeasible:
        raise SolverError(_infeasible_reason(problem))
    if assignment is None and found is None:
        raise SolverError(f"HiGHS found no placement within {time_limit_s:g} s")
    lower = max(lower, bound)
    if assignment is None:
        return result(found[1], found[0], lower)
    value = float(objective_values(problem, assignment[None], objective)[0])
    if found is not None and found[0] < value:
        return result(found[1], found[0], lower)
    return result(assignment, value, lower)
