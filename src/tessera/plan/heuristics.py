"""Good feasible placements found fast, for the MILP to start from (and to prune with).

Three sources of starting assignments, each repaired to respect allowed devices, pinned kernels and
``together`` groups, and kept only if its items fit memory:

* :func:`single_device_assignments`: every kernel on one device.
* :func:`pipeline_assignments`: contiguous stages in program order, one per device, for each order of
  devices, with stage boundaries from a bisection on the busiest stage (a pipeline).
* :func:`lp_rounding`: the LP relaxation's fractional assignment rounded segment by segment (a run of
  kernels with the same fractional split is one segment), each segment to the device whose busy time
  lags its LP share the most, minus the transfers the choice would cut.

:func:`improve` then runs a local search over *window moves* (a run of consecutive kernels moved to one
device) whose effect on every term of the objective is computed exactly and incrementally by
:class:`Evaluator`; moves are ranked by a soft maximum of the terms (the busiest device, link and the
critical path) whose sharpness grows, then random perturbations (more moves the longer none helps) are
tried until the deadline. Windows that touch no term near the maximum, and moves whose exact busy-time
change already outweighs the most the other terms could drop, are skipped without evaluating their paths;
after a full pass, passes try only windows near the moves just applied. :func:`best_start` restarts the
search from the best placement while restarts help and budget is left.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import time
from dataclasses import dataclass

import numpy as np

from tessera.plan.problem import PlacementProblem

WINDOW_LENGTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40)
SHARPNESS = (40.0, 80.0, 160.0)  # soft-max sharpness schedule of the local search
_REACH = 2 * max(WINDOW_LENGTHS)  # edges spanning more kernels than this are "long" (see Evaluator)
FIXED_SHARE = 0.2  # of the heuristic budget, at most, for improving the best fixed start (before the LP's)
_MAX_ORDERS = 120  # device orders tried by the pipeline heuristic
_SEGMENT_CHANGE = 0.1  # L1 change of the LP split that starts a new rounding segment
_EPS = 1e-12
_ALL_SINGLES = 300  # up to this many kernels, every kernel is tried alone
_WORSE = 1.1  # a move may raise the objective by this factor if it lowers the soft maximum
_NEAR = max(WINDOW_LENGTHS)  # kernels around an applied move whose windows the next pass tries again
_KICK, _KICK_GROWTH = 3, 5  # random window moves per perturbation, one more per this many without progress
_RESTART_MIN = 0.1  # share of the heuristics' budget, at least, left for a restart
_HOT = 7.0  # terms below ref x (1 - _HOT / sharpness) weigh under exp(-7) ~ 0.1% in the soft maximum


def _groups(problem: PlacementProblem) -> list[list[int]]:
    """Kernels that must share a device (``together``), as sorted groups (singletons omitted)."""
    parent = list(range(problem.kernels))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in problem.together:
        parent[find(i)] = find(j)
    members: dict[int, list[int]] = {}
    for i in range(problem.kernels):
        members.setdefault(find(i), []).append(i)
    return [sorted(g) for g in members.values() if len(g) > 1]


def allowed_matrix(problem: PlacementProblem) -> np.ndarray:
    """[K, D] whether kernel i may run on device d (finite time, pinned, and allowed for its whole group)."""
    ok = np.isfinite(problem.times)
    for i, dev in problem.pinned.items():
        ok[i] = False
        ok[i, dev] = True
    for g in _groups(problem):
        ok[g] = ok[g].all(axis=0)
    return ok


def repair(problem: PlacementProblem, a: np.ndarray, ok: np.ndarray | None = None,
           groups: list[list[int]] | None = None) -> np.ndarray | None:
    """``a`` moved onto allowed devices with each together group on one device (None if impossible);
    ``ok`` and ``groups``: the problem's :func:`allowed_matrix` and together groups, if already known."""
    if groups is None:
        groups = _groups(problem)
    if ok is None:
        ok = allowed_matrix(problem)
    if not ok.any(axis=1).all():
        return None
    a = np.array(a, dtype=np.int64)
    t = np.where(ok, problem.times, np.inf)
    for g in groups:
        votes = np.bincount(a[g], weights=None, minlength=len(problem.devices)).astype(float)
        votes[~ok[g[0]]] = -1
        a[g] = int(np.argmax(votes - 1e-9 * t[g].sum(axis=0)))  # the majority device, the fastest on ties
    bad = ~ok[np.arange(problem.kernels), a]
    a[bad] = np.argmin(t[bad], axis=1)
    return a


def single_device_assignments(problem: PlacementProblem) -> list[np.ndarray]:
    """Every kernel on device d, for each device (repaired where a kernel cannot run there)."""
    out = []
    for d in range(len(problem.devices)):
        a = repair(problem, np.full(problem.kernels, d))
        if a is not None:
            out.append(a)
    return out


def _device_orders(nd: int, times: np.ndarray) -> list[tuple[int, ...]]:
    """Orders (and subsets) of devices for pipeline stages: all of them for a few devices, else a sample."""
    if sum(math.perm(nd, s) for s in range(1, nd + 1)) <= _MAX_ORDERS:
        return [p for s in range(1, nd + 1) for p in itertools.permutations(range(nd), s)]
    fastest = tuple(int(d) for d in np.argsort(times.sum(axis=0)))
    rng = random.Random(0)
    orders = {fastest[:s] for s in range(1, nd + 1)}
    while len(orders) < _MAX_ORDERS:
        orders.add(tuple(rng.sample(range(nd), rng.randint(2, nd))))
    return sorted(orders)


def pipeline_assignments(problem: PlacementProblem) -> list[np.ndarray]:
    """Contiguous pipelines: for each device order, stages cut where the busiest stage is smallest."""
    k, nd = problem.times.shape
    ok, groups = allowed_matrix(problem), _groups(problem)
    finite = np.where(ok, problem.times, 0.0)
    big = 10.0 * float(finite.sum()) + 1.0  # a stage never takes a kernel it cannot run (unless it must)
    prefix = np.vstack([np.zeros(nd), np.cumsum(np.where(ok, problem.times, big), axis=0)])
    columns = [prefix[:, d].tolist() for d in range(nd)]  # bisect on lists: searchsorted's answer, 10x sooner
    out = []
    for order in _device_orders(nd, finite):
        def split(cap: float, order=order) -> list[int] | None:
            bounds, b = [0], 0
            for d in order:
                column = columns[d]
                b = bisect.bisect_right(column, column[b] + cap) - 1
                bounds.append(b)
                if b >= k:
                    return bounds
            return None

        lo, hi = 0.0, max(float(prefix[k, d]) for d in order)
        for _ in range(50):
            mid = (lo + hi) / 2
            if split(mid) is not None:
                hi = mid
            else:
                lo = mid
        bounds = split(hi)
        a = np.empty(k, dtype=np.int64)
        for d, (lo_, hi_) in zip(order, itertools.pairwise(bounds), strict=False):
            a[lo_:min(hi_, k)] = d
        fixed = repair(problem, a, ok, groups)
        if fixed is not None:
            out.append(fixed)
    return out


def lp_rounding(problem: PlacementProblem, split: np.ndarray) -> np.ndarray | None:
    """Round the LP's fractional assignment ``split[K, D]`` segment by segment (see the module docstring)."""
    k, nd = problem.times.shape
    ok = allowed_matrix(problem)
    t = np.where(ok, problem.times, 0.0)
    split = np.clip(split, 0.0, 1.0) * ok
    preds: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(k)]
    for (src, dst, nbytes), count in zip(problem.edges, problem.messages, strict=True):
        preds[dst].append((src, problem.transfer_matrix(nbytes, count)))
    starts, ref = [0], split[0]
    for i in range(1, k):
        if np.abs(split[i] - ref).sum() > _SEGMENT_CHANGE:
            starts.append(i)
            ref = split[i]
    starts.append(k)
    target, actual = np.zeros(nd), np.zeros(nd)
    a = np.zeros(k, dtype=np.int64)
    for s, e in itertools.pairwise(starts):
        share, work = split[s], t[s:e].sum(axis=0)
        target += share * work
        cut = np.zeros(nd)
        for u in range(s, e):
            for src, cost in preds[u]:
                if src < s:
                    cut += cost[a[src]]
        feasible = ok[s:e].all(axis=0)
        support = np.flatnonzero((share > 1e-6) & feasible)
        if len(support) == 0:
            support = np.flatnonzero(feasible) if feasible.any() else np.arange(nd)
        score = (target - actual - work - problem.micro_batches * cut)[support]
        d = int(support[np.argmax(score)])
        actual[d] += work[d]
        a[s:e] = d
    return repair(problem, a)


@dataclass
class Move:
    """A window move ``kernels[i:j] -> device`` with its exact effect (see :meth:`Evaluator.window_move`)."""

    i: int
    j: int
    device: int
    value: float  # the objective after the move
    potential: float  # change of the soft maximum of the terms
    busy: list[float]  # per-device busy change
    links: dict[tuple[int, int], float]  # per-link load change
    loops: float  # change of the loop-edge constant of the critical path
    memory: dict[int, float] | None  # per-device resident bytes change


class Evaluator:
    """One assignment's busy times, link loads, critical path and memory, with exact window moves.

    A window is a run of consecutive kernels (program order). Paths through it enter once and leave once
    (edges run forward), so the longest path through the moved window is computed exactly from the
    finish times before it and the tails after it; the longest path avoiding it is the longest of the
    paths ending before it, starting after it, or jumping over it on one edge."""

    def __init__(self, problem: PlacementProblem, objective: str, a) -> None:
        k, nd = problem.times.shape
        self.k, self.nd, self.m = k, nd, problem.micro_batches
        self.throughput = objective == "throughput"
        ok = allowed_matrix(problem)
        self.ok = ok.tolist()
        self.times = np.where(np.isfinite(problem.times), problem.times, 0.0)
        self.t = self.times.tolist()
        self.all_prefix = np.vstack([np.zeros(nd), np.cumsum(self.times, axis=0)]).tolist()  # [K + 1][D]
        self.src = [s for s, _, _ in problem.edges]
        self.dst = [d for _, d, _ in problem.edges]
        self.cost = [problem.transfer_matrix(b, c).tolist()
                     for (_, _, b), c in zip(problem.edges, problem.messages, strict=True)]
        self.ins: list[list[int]] = [[] for _ in range(k)]
        self.outs: list[list[int]] = [[] for _ in range(k)]
        for n, (s, d) in enumerate(zip(self.src, self.dst, strict=True)):
            self.ins[d].append(n)
            self.outs[s].append(n)
        self.preds = [[(self.src[n], self.cost[n]) for n in self.ins[u]] for u in range(k)]
        self.succs = [[(self.dst[n], self.cost[n]) for n in self.outs[u]] for u in range(k)]
        self.long = sorted((self.src[n], self.dst[n], n) for n in range(len(self.src))
                           if self.dst[n] - self.src[n] > _REACH)
        self.loop = [(s, d, problem.transfer_matrix(b, c).tolist()) for s, d, b, c in problem.loop_edges]
        self.loops_of: list[list[int]] = [[] for _ in range(k)]
        for n, (s, d, _) in enumerate(self.loop):
            self.loops_of[s].append(n)
            if d != s:
                self.loops_of[d].append(n)
        self.group_lo = list(range(k))
        self.group_hi = list(range(k))
        for g in _groups(problem):
            for u in g:
                self.group_lo[u], self.group_hi[u] = g[0], g[-1]
        mem = problem.memory
        self.reads: list[list[int]] = [[] for _ in range(k)]
        if mem is not None:
            for i, w in sorted(set(mem.reads)):
                self.reads[i].append(w)
            self.item_bytes = mem.item_bytes.tolist()
            self.capacity = (mem.capacity * (1 + 1e-9)).tolist()
        self.memory = mem is not None
        self.singles = range(k) if k <= _ALL_SINGLES else range(0)
        self.load(a)

    # ---- state -------------------------------------------------------------------------------
    def load(self, a) -> None:
        """Make ``a`` the current assignment and compute every term from scratch."""
        self.a = [int(d) for d in a]
        nd = self.nd
        self.busy = [0.0] * nd
        for i, d in enumerate(self.a):
            self.busy[d] += self.t[i][d]
        self.link = [[0.0] * nd for _ in range(nd)]
        for n, (s, d) in enumerate(zip(self.src, self.dst, strict=True)):
            if self.a[s] != self.a[d]:
                self.link[self.a[s]][self.a[d]] += self.cost[n][self.a[s]][self.a[d]]
        self.loopconst = 0.0
        for s, d, c in self.loop:
            if self.a[s] != self.a[d]:
                self.link[self.a[s]][self.a[d]] += c[self.a[s]][self.a[d]]
                self.loopconst += c[self.a[s]][self.a[d]]
        if self.memory:
            self.count: list[dict[int, int]] = [{} for _ in range(nd)]
            self.use = [0.0] * nd
            for i, d in enumerate(self.a):
                for w in self.reads[i]:
                    c = self.count[d].get(w, 0)
                    if c == 0:
                        self.use[d] += self.item_bytes[w]
                    self.count[d][w] = c + 1
        self._own_prefix()
        self._paths()

    def _own_prefix(self) -> None:
        """own_prefix[u][d]: the time of kernels before u that run on d (window busy changes in O(D))."""
        own = np.zeros_like(self.times)
        rows = np.arange(self.k)
        a = np.array(self.a, dtype=np.int64)
        own[rows, a] = self.times[rows, a]
        self.own_prefix = np.vstack([np.zeros(self.nd), np.cumsum(own, axis=0)]).tolist()

    def _paths(self, lo: int = 0, hi: int | None = None) -> None:
        """Finish times, tails, the critical path and its prefix/suffix maxima; after a move of kernels[lo:hi]
        only finish times from ``lo`` on and tails before ``hi`` can change (edges run forward)."""
        k, a, t, src, dst, cost = self.k, self.a, self.t, self.src, self.dst, self.cost
        hi = k if hi is None else hi
        if lo == 0:
            fin, tail, hi = [0.0] * k, [0.0] * k, k
        else:
            fin, tail = self.fin, self.tail
        for j in range(lo, k):
            start, aj = 0.0, a[j]
            for n in self.ins[j]:
                p = src[n]
                v = fin[p] + cost[n][a[p]][aj]
                if v > start:
                    start = v
            fin[j] = start + t[j][aj]
        for i in range(hi - 1, -1, -1):
            best, ai = 0.0, a[i]
            for n in self.outs[i]:
                q = dst[n]
                v = cost[n][ai][a[q]] + tail[q]
                if v > best:
                    best = v
            tail[i] = best + t[i][ai]
        self.fin, self.tail = fin, tail
        if lo == 0:
            self.before = [0.0] * (k + 1)  # longest path ending before kernel i
            self.after = [0.0] * (k + 1)  # longest path starting at or after kernel j
        before, after = self.before, self.after
        for i in range(lo, k):
            before[i + 1] = before[i] if before[i] > fin[i] else fin[i]
        for j in range(hi - 1, -1, -1):
            after[j] = after[j + 1] if after[j + 1] > tail[j] else tail[j]
        self.cp = before[k]
        limit = self.cp * (1 - 1e-12)
        self.critical = [fin[u] - t[u][a[u]] + tail[u] >= limit for u in range(k)]

    def terms(self) -> list[float]:
        """The objective's terms: M x busy per device, M x load per directed link, the critical path."""
        cp = self.cp + self.loopconst
        if not self.throughput:
            return [cp]
        m, nd = self.m, self.nd
        return [m * b for b in self.busy] + [m * self.link[d][e] for d in range(nd) for e in range(nd) if d != e] + [cp]

    def value(self) -> float:
        """The objective of the current assignment (cycle time or critical path, seconds)."""
        return max(self.terms())

    # ---- moves -------------------------------------------------------------------------------
    def _jump(self, i: int, j: int) -> float:
        """Longest path using one edge from before kernel i to kernel j or later."""
        a, cost, src, fin, tail = self.a, self.cost, self.src, self.fin, self.tail
        best = 0.0
        for q in range(j, min(self.k, i + _REACH)):
            for n in self.ins[q]:
                p = src[n]
                if p < i:
                    v = fin[p] + cost[n][a[p]][a[q]] + tail[q]
                    if v > best:
                        best = v
        for p, q, n in self.long:
            if p >= i:
                break
            if q >= i + _REACH:
                v = fin[p] + cost[n][a[p]][a[q]] + tail[q]
                if v > best:
                    best = v
        return best

    def window_move(self, i: int, j: int, e: int, ref: float, sharpness: float, prune: bool = False) -> Move | None:
        """The exact effect of moving kernels[i:j] to device e (None if not allowed, a no-op, or it
        overflows memory); ``potential`` is the change of sum(exp(sharpness * (term - ref) / ref)).
        ``prune``: also None when the move cannot lower the potential."""
        a, t, ok = self.a, self.t, self.ok
        nd = self.nd
        moved = False
        for u in range(i, j):
            if not ok[u][e] or self.group_lo[u] < i or self.group_hi[u] >= j:
                return None
            moved |= a[u] != e
        if not moved:
            return None
        if prune and self.throughput and self._cannot_lower(i, j, e, ref, sharpness / ref):
            return None
        db = [0.0] * nd
        dl = [0.0] * (nd * nd)  # link load changes, d * nd + f
        finish = [0.0] * (j - i)
        fin, tail, critical = self.fin, self.tail, self.critical
        through = 0.0
        crosses_critical = False
        for u in range(i, j):
            au = a[u]
            tu = t[u]
            crosses_critical |= critical[u]
            db[au] -= tu[au]
            db[e] += tu[e]
            start = 0.0
            for p, c in self.preds[u]:
                ap = a[p]
                if ap != au:
                    dl[ap * nd + au] -= c[ap][au]
                if p >= i:
                    v = finish[p - i]
                else:
                    if ap != e:
                        dl[ap * nd + e] += c[ap][e]
                    v = fin[p] + c[ap][e]
                if v > start:
                    start = v
            f = start + tu[e]
            finish[u - i] = f
            if f > through:
                through = f
            for q, c in self.succs[u]:
                if q >= j:
                    aq = a[q]
                    if au != aq:
                        dl[au * nd + aq] -= c[au][aq]
                    if e != aq:
                        dl[e * nd + aq] += c[e][aq]
                    v = f + c[e][aq] + tail[q]
                    if v > through:
                        through = v
        dloops = 0.0
        if self.loop:
            seen = set()
            for u in range(i, j):
                for n in self.loops_of[u]:
                    if n in seen:
                        continue
                    seen.add(n)
                    ls, ld, c = self.loop[n]
                    old_s, old_d = a[ls], a[ld]
                    new_s = e if i <= ls < j else old_s
                    new_d = e if i <= ld < j else old_d
                    if old_s != old_d:
                        dl[old_s * nd + old_d] -= c[old_s][old_d]
                        dloops -= c[old_s][old_d]
                    if new_s != new_d:
                        dl[new_s * nd + new_d] += c[new_s][new_d]
                        dloops += c[new_s][new_d]
        memory = None
        if self.memory:
            memory = self._memory_change(i, j, e)
            if memory is None:
                return None
        ex = math.exp
        scale = sharpness / ref
        rest, value = 0.0, 0.0  # the potential change and maximum of the terms other than the critical path
        if self.throughput:
            m = self.m
            for d in range(nd):
                new = m * (self.busy[d] + db[d])
                value = max(value, new)
                if db[d] != 0.0:
                    rest += ex(min((new - ref) * scale, 50.0)) - ex(min((m * self.busy[d] - ref) * scale, 50.0))
            link = self.link
            for d in range(nd):
                row = link[d]
                for f in range(nd):
                    delta = dl[d * nd + f]
                    if delta != 0.0 and d != f:
                        new = m * (row[f] + delta)
                        value = max(value, new)
                        rest += ex(min((new - ref) * scale, 50.0)) - ex(min((m * row[f] - ref) * scale, 50.0))
            value = max(value, self.link_max_unchanged(dl))
        old_cp = self.cp + self.loopconst
        old_term = ex(min((old_cp - ref) * scale, 50.0))
        if crosses_critical:  # the longest path avoiding the window: at least the paths before or after it
            avoid = max(self.before[i], self.after[j])
            if avoid < self.cp and through < self.cp:
                optimistic = max(avoid, through) + self.loopconst + dloops
                if prune and rest + ex(min((optimistic - ref) * scale, 50.0)) - old_term >= -1e-12:
                    return None  # not an improvement even if no path jumps over the window
                avoid = max(avoid, self._jump(i, j))
        else:
            avoid = self.cp
        cp = max(avoid, through) + self.loopconst + dloops
        potential = rest + ex(min((cp - ref) * scale, 50.0)) - old_term
        if prune and potential >= -1e-12:
            return None
        value = max(value, cp)
        links = {(d // nd, d % nd): delta for d, delta in enumerate(dl) if delta != 0.0}
        return Move(i, j, e, value, potential, db, links, dloops, memory)

    def _cannot_lower(self, i: int, j: int, e: int, ref: float, scale: float) -> bool:
        """Whether moving kernels[i:j] to e surely leaves the potential no lower: the busy terms' change
        (exact, from prefix sums) outweighs the most the link and critical-path terms could drop."""
        ex, m, busy = math.exp, self.m, self.busy
        own, every = self.own_prefix, self.all_prefix
        change = 0.0
        for d in range(self.nd):
            delta = own[i][d] - own[j][d]
            if d == e:
                delta += every[j][e] - every[i][e]
            if delta != 0.0:
                change += ex(min((m * (busy[d] + delta) - ref) * scale, 50.0)) - ex(min((m * busy[d] - ref) * scale, 50.0))
        if change <= 0.0:
            return False
        # the paths wholly before or after the window stay (loop edges may change the constant: then none)
        low = max(self.before[i], self.after[j]) + self.loopconst if not self.loop else 0.0
        drop = ex(min((self.cp + self.loopconst - ref) * scale, 50.0)) - ex(min((low - ref) * scale, 50.0))
        for row in self.link:
            for load in row:
                if load > 0.0:
                    drop += ex(min((m * load - ref) * scale, 50.0))
        return change - drop >= 1e-9

    def hot_counts(self, ref: float, sharpness: float) -> list[int]:
        """Prefix counts of *hot* kernels: those a term within ``_HOT / sharpness`` of ``ref`` depends on
        (on a device whose busy time is such a term, on a path that long, or with a cut edge on such a
        link). A window without one changes only terms whose share of the soft maximum is negligible."""
        k, a, t, nd, m = self.k, self.a, self.t, self.nd, self.m
        limit = ref * (1 - _HOT / sharpness)
        hot = [False] * k
        if self.cp + self.loopconst >= limit:
            through = limit - self.loopconst
            fin, tail = self.fin, self.tail
            hot = [fin[u] - t[u][a[u]] + tail[u] >= through for u in range(k)]
            for s, d, _ in self.loop:
                hot[s] = hot[d] = True
        if self.throughput:
            devices = {d for d in range(nd) if m * self.busy[d] >= limit}
            links = {(d, f) for d in range(nd) for f in range(nd) if d != f and m * self.link[d][f] >= limit}
            if devices:
                hot = [h or a[u] in devices for u, h in enumerate(hot)]
            if links:
                for s, d in zip(self.src, self.dst, strict=True):
                    if (a[s], a[d]) in links:
                        hot[s] = hot[d] = True
                for s, d, _ in self.loop:
                    if (a[s], a[d]) in links:
                        hot[s] = hot[d] = True
        counts = [0] * (k + 1)
        for u in range(k):
            counts[u + 1] = counts[u] + hot[u]
        return counts

    def link_max_unchanged(self, dl: list[float]) -> float:
        """M x the busiest directed link among those ``dl`` leaves unchanged."""
        nd, best = self.nd, 0.0
        for d in range(nd):
            row = self.link[d]
            for f in range(nd):
                if d != f and dl[d * nd + f] == 0.0 and row[f] > best:
                    best = row[f]
        return self.m * best

    def _memory_change(self, i: int, j: int, e: int) -> dict[int, float] | None:
        """Per-device change of resident bytes if kernels[i:j] move to e (None if a device overflows)."""
        delta_count: dict[tuple[int, int], int] = {}
        for u in range(i, j):
            if self.a[u] == e:
                continue
            for w in self.reads[u]:
                delta_count[(self.a[u], w)] = delta_count.get((self.a[u], w), 0) - 1
                delta_count[(e, w)] = delta_count.get((e, w), 0) + 1
        change: dict[int, float] = {}
        for (d, w), dc in delta_count.items():
            before = self.count[d].get(w, 0)
            after = before + dc
            if before == 0 and after > 0:
                change[d] = change.get(d, 0.0) + self.item_bytes[w]
            elif before > 0 and after == 0:
                change[d] = change.get(d, 0.0) - self.item_bytes[w]
        for d, c in change.items():
            if c > 0 and self.use[d] + c > self.capacity[d]:
                return None
        return change

    def apply(self, move: Move) -> None:
        """Make ``move`` (from :meth:`window_move` on the current state) part of the assignment."""
        e = move.device
        if self.memory:
            for u in range(move.i, move.j):
                d = self.a[u]
                if d == e:
                    continue
                for w in self.reads[u]:
                    self.count[d][w] -= 1
                    if self.count[d][w] == 0:
                        del self.count[d][w]
                    self.count[e][w] = self.count[e].get(w, 0) + 1
            for d, c in move.memory.items():
                self.use[d] += c
        for u in range(move.i, move.j):
            self.a[u] = e
        for d in range(self.nd):
            self.busy[d] += move.busy[d]
        for (d, f), delta in move.links.items():
            self.link[d][f] += delta
        self.loopconst += move.loops
        self._own_prefix()
        self._paths(move.i, move.j)


def _candidates(ev: Evaluator) -> list[tuple[int, int]]:
    """Windows to try: windows ending or starting at a device change, whole runs of kernels on one device
    and pairs of them, and in small problems every single kernel (in large ones, moving one kernel away
    from its neighbours rarely pays two transfers)."""
    k = ev.k
    cands = {(i, i + 1) for i in ev.singles}
    bounds = [0]
    for b in range(1, k):
        if ev.a[b] != ev.a[b - 1]:
            bounds.append(b)
            for length in WINDOW_LENGTHS:
                if b + length <= k:
                    cands.add((b, b + length))
                if b - length >= 0:
                    cands.add((b - length, b))
    bounds.append(k)
    for span in (1, 2):  # whole segments and pairs of them, of any length (together groups can span many kernels)
        cands.update((bounds[n], bounds[n + span]) for n in range(len(bounds) - span))
    return sorted(cands)


def _descend(ev: Evaluator, sharpness: float, deadline: float, rng: random.Random,
             best: tuple[float, list[int]], target: float = 0.0) -> tuple[float, list[int]]:
    """Apply improving window moves until none is left, the deadline, or an objective <= ``target``;
    return the best seen. After a pass, the next one tries only windows near the moves it applied; the
    descent ends when a pass over every window finds none."""
    near: list[int] | None = None  # prefix counts of kernels near the last pass's moves (None: every window)
    while time.perf_counter() < deadline and best[0] > target:
        ref = max(ev.value(), _EPS)
        cands = _candidates(ev)
        rng.shuffle(cands)
        hot = ev.hot_counts(ref, sharpness)
        moved, applied = [0] * (ev.k + 1), 0
        for i, j in cands:
            if hot[j] == hot[i] or (near is not None and near[j] == near[i]):
                continue
            choice = None
            for e in range(ev.nd):
                mv = ev.window_move(i, j, e, ref, sharpness, prune=True)
                if mv is not None and mv.potential < -1e-12 and mv.value <= ref * _WORSE and (
                        choice is None or mv.potential < choice.potential):
                    choice = mv
            if choice is not None:
                ev.apply(choice)
                applied += 1
                moved[max(0, i - _NEAR)] += 1
                moved[min(ev.k, j + _NEAR)] -= 1
                v = ev.value()
                if v < best[0]:
                    best = (v, list(ev.a))
                    if v <= target:
                        break
            if time.perf_counter() >= deadline:
                break
        if not applied:
            if near is None:
                break
            near = None
            continue
        near = [0] * (ev.k + 1)  # kernel u is near a move when the running sum of ``moved`` is positive
        depth = 0
        for u in range(ev.k):
            depth += moved[u]
            near[u + 1] = near[u] + (depth > 0)
    return best


def improve(problem: PlacementProblem, objective: str, a, deadline: float, seed: int = 0,
            patience: int = 30, target: float = 0.0) -> tuple[float, np.ndarray]:
    """Local search from the feasible assignment ``a`` until ``deadline`` (a ``time.perf_counter()``
    value), ``patience`` perturbations without progress or an objective <= ``target``; returns
    (objective, assignment) of the best."""
    ev = Evaluator(problem, objective, a)
    rng = random.Random(seed)
    best = (ev.value(), list(ev.a))
    for sharpness in SHARPNESS:
        ev.load(best[1])
        best = _descend(ev, sharpness, deadline, rng, best, target)
    stale = 0
    while time.perf_counter() < deadline and stale < patience and best[0] > target:  # perturb the best, then descend
        ev.load(best[1])
        bounds = [b for b in range(1, ev.k) if ev.a[b] != ev.a[b - 1]] or [0]
        for _ in range(_KICK + stale // _KICK_GROWTH):  # stronger kicks the longer none helps
            b = rng.choice(bounds)
            length = rng.choice(WINDOW_LENGTHS)
            i, j = (b, min(ev.k, b + length)) if rng.random() < 0.5 else (max(0, b - length), b)
            mv = ev.window_move(i, j, rng.randrange(ev.nd), max(ev.value(), _EPS), SHARPNESS[-1])
            if mv is not None:
                ev.apply(mv)
        before = best[0]
        best = _descend(ev, SHARPNESS[-1], deadline, rng, best, target)
        stale = 0 if best[0] < before * (1 - 1e-9) else stale + 1
    return best[0], np.array(best[1], dtype=np.int64)


def best_start(problem: PlacementProblem, objective: str, budget_s: float, split: np.ndarray | None = None,
               extra: list | None = None, target: float = 0.0) -> tuple[float, np.ndarray] | None:
    """The best placement the heuristics find within about ``budget_s`` seconds (or as soon as one is
    <= ``target``): single devices, pipelines, the rounded LP ``split`` (if given) and ``extra``
    assignments; the best of them and the rounded LP are improved by local search. None if none of
    them fits memory."""
    from tessera.plan.enumerate import memory_fits, objective_values

    t0 = time.perf_counter()
    starts = [("fixed", a) for a in single_device_assignments(problem) + pipeline_assignments(problem)]
    if split is not None:
        rounded = lp_rounding(problem, split)
        if rounded is not None:
            starts.append(("lp", rounded))
    starts += [("extra", np.asarray(a, dtype=np.int64)) for a in extra or []]
    if not starts:
        return None
    a = np.array([s for _, s in starts])
    fits = memory_fits(problem, a)
    labels = [label for (label, _), f in zip(starts, fits, strict=True) if f]
    a = a[fits]
    if len(a) == 0:
        return None
    values = objective_values(problem, a, objective)
    best = (float(values.min()), a[int(np.argmin(values))])
    seeds = [(int(np.argmin(values)), 1.0)]
    lp = [n for n, label in enumerate(labels) if label == "lp"]
    if lp and lp[0] != seeds[0][0]:  # the fixed start converges fast; the rounded LP gets the rest
        seeds = [(seeds[0][0], FIXED_SHARE), (lp[0], 1.0)]
    for n, (s, share) in enumerate(seeds):
        if best[0] <= target:
            break
        left = budget_s - (time.perf_counter() - t0)
        v, found = improve(problem, objective, a[s], time.perf_counter() + share * left, seed=n, target=target)
        if v < best[0]:
            best = (v, found)
    restart = len(seeds)
    while best[0] > target and time.perf_counter() - t0 < budget_s * (1 - _RESTART_MIN):
        # the search stalled before the budget: again from the best with other kicks, while that helps
        v, found = improve(problem, objective, best[1], t0 + budget_s, seed=restart, target=target)
        restart += 1
        if v >= best[0] * (1 - 1e-9):
            break
        best = (v, found)
    return best
