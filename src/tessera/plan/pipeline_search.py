"""The layer-pipeline baseline's search: every pipeline of contiguous layers over 2..D targets in a device
order, scored on the main phase, the best few kept.

Each candidate's exact score needs a list schedule of the step (:func:`tessera.plan.step_evaluation.evaluate`),
about a millisecond each; a cluster of eight workers has hundreds of thousands of candidates. The search
therefore (1) tries one order of each class of orders of interchangeable devices (:mod:`tessera.plan.symmetry`),
(2) computes for all candidates at once, vectorised, a lower bound on their score: the solver's objective
(:func:`tessera.plan.enumerate.cycle_times`, which the evaluated cycle never falls below) and, where
engines admit from memory, the sequences each one admits, and (3) scores exactly, in order of that bound,
only until the bound passes the ``keep``-th best score found. The kept candidates are those an exhaustive
scoring in enumeration order would keep, ties going to the earlier candidate.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from tessera.plan.admission import MemoryShape, admit, round_batch
from tessera.plan.enumerate import critical_paths, cycle_times, memory_use
from tessera.plan.step_evaluation import evaluate
from tessera.plan.symmetry import canonical
from tessera.plan.targets import usable_memory

MAX_PIPELINE_CANDIDATES = 200_000
CHUNK = 4096  # candidates per vectorised evaluation
BOUND_SLACK = 1e-9  # relative: rounding between a bound and the exact score computed in another order


def pipelines(layers: int, devices: int, classes: list[int] | None = None) -> Iterator[tuple[tuple[int, ...], list[int]]]:
    """(device order, cut positions) for every pipeline of 2..devices stages over ``layers`` layers (of the
    orders of interchangeable devices, ``classes`` as :func:`tessera.plan.symmetry.device_classes` gives
    them, only the first), at most ``MAX_PIPELINE_CANDIDATES``."""
    count = 0
    for stages in range(2, min(devices, layers) + 1):
        for order in itertools.permutations(range(devices), stages):
            if classes is not None and not canonical(order, classes):
                continue
            for cuts in itertools.combinations(range(1, layers), stages - 1):
                count += 1
                if count > MAX_PIPELINE_CANDIDATES:
                    return
                yield order, list(cuts)


def layer_devices(candidates: list[tuple[tuple[int, ...], list[int]]], layers: int) -> np.ndarray:
    """[N, layers]: each candidate's device of every layer."""
    out = np.zeros((len(candidates), layers), dtype=int)
    by_stages: dict[int, list[int]] = {}
    for i, (order, _) in enumerate(candidates):
        by_stages.setdefault(len(order), []).append(i)
    for rows in by_stages.values():  # a layer's stage: how many cuts lie at or before it
        cuts = np.array([candidates[i][1] for i in rows], dtype=int).reshape(len(rows), -1)
        orders = np.array([candidates[i][0] for i in rows], dtype=int)
        stage_of = (cuts[:, None, :] <= np.arange(layers)[None, :, None]).sum(axis=2)
        out[rows] = np.take_along_axis(orders, stage_of, axis=1)
    return out


@dataclass(frozen=True)
class Scorer:
    """A candidate's exact score (seconds per request, or None where it does not fit) and lower bounds on
    the scores of many candidates at once ([N], -inf where there is none)."""

    score: Callable[[tuple[int, ...]], float | None]
    bounds: Callable[[np.ndarray], np.ndarray]


def fixed_scorer(problem, repeats: float, rows: int, objective: str) -> Scorer:
    """Scores at the context's batch: the cycle per request (throughput) or the critical path (latency)."""
    def score(a):
        ev = evaluate(problem, a)
        if not ev.memory_ok:
            return None
        return ev.cycle_s * repeats / rows if objective == "throughput" else ev.critical_path_s

    def bounds(a):
        if objective == "throughput":
            return cycle_times(problem, a) * repeats / rows
        return critical_paths(problem, a)
    return Scorer(score, bounds)


def admitted_scorer(big, small, b0: int, b1: int, m: int, repeats: float, capacity: np.ndarray, reserve: float,
                    tokens_per_sequence: float, names: list[str], admission) -> Scorer:
    """Scores where each split admits what its memory holds: resident bytes and cycle interpolated between
    the batch ``b0`` (problem ``big``) and ``b1`` (``small``), at the batch the split admits."""
    def shape(r0, r1):
        per_seq = np.maximum(r0 - r1, 0.0) / (b0 - b1)
        return r0 - per_seq * b0 + reserve, per_seq

    def score(a):
        ev0, ev1 = evaluate(big, a), evaluate(small, a)
        fixed, per_seq = shape(np.array(ev0.resident_bytes), np.array(ev1.resident_bytes))
        n = admit(MemoryShape(names, capacity, fixed, per_seq, tokens_per_sequence), admission, b0, m).max_seqs
        if n < 1:
            return None
        cycle = ev1.cycle_s + (ev0.cycle_s - ev1.cycle_s) * (n - b1) / (b0 - b1)
        return cycle * repeats / n

    def bounds(a):
        fixed, per_seq = shape(memory_use(big, a), memory_use(small, a))
        n = admitted_counts(fixed, per_seq, usable_memory(capacity, admission.memory_utilization), b0, m)
        c0, c1 = cycle_times(big, a), cycle_times(small, a)
        t = (n - b1) / (b0 - b1)
        with np.errstate(divide="ignore", invalid="ignore"):
            out = (c1 * (1 - t) + c0 * t) * repeats / n
        out = np.where(n < 1, np.inf, out)  # no fit: never scored
        return np.where((n >= 1) & (n < b1), -np.inf, out)  # extrapolated below b1: no bound
    return Scorer(score, bounds)


def admitted_counts(fixed: np.ndarray, per_seq: np.ndarray, usable: np.ndarray, cap: int, m: int) -> np.ndarray:
    """[N] the sequences :func:`tessera.plan.admission.admit` admits for each row of ``fixed`` and
    ``per_seq`` [N, D] (0: no fit), vectorised."""
    free = usable[None, :] - fixed
    holding = per_seq > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        fits = np.where(holding, free / np.where(holding, per_seq, 1.0), np.inf)
    by_memory = np.floor(fits.min(axis=1) + 1e-9)
    n = np.where(holding.any(axis=1), np.minimum(by_memory, cap), cap)
    n = np.where((free < 0).any(axis=1) | (n < 1), 0, n).astype(int)
    step = np.where(n > 32, max(16, m), m)
    return np.where(n >= 1, (n // step) * step, 0)


def best_pipelines(candidates: list[tuple[tuple[int, ...], list[int]]], devices: np.ndarray, scorer: Scorer,
                   keep: int = 3) -> list[tuple[float, tuple[int, ...], tuple[int, ...], list[int]]]:
    """The ``keep`` best (score, per-layer devices, order, cuts) of ``candidates`` (their
    :func:`layer_devices` ``devices``), best first (ties: the earlier candidate), as scoring every candidate
    would find them."""
    if not candidates:
        return []
    bounds = np.concatenate([scorer.bounds(devices[i:i + CHUNK]) for i in range(0, len(devices), CHUNK)])
    top: list[tuple[float, int]] = []
    for i in np.lexsort((np.arange(len(candidates)), bounds)):
        if len(top) == keep and bounds[i] * (1 - BOUND_SLACK) > top[-1][0]:
            break  # this candidate's score, and every later one's, is above the kept ones'
        a = tuple(int(x) for x in devices[i])
        s = scorer.score(a)
        if s is None:
            continue
        bisect.insort(top, (s, int(i)))
        del top[keep:]
    return [(s, tuple(int(x) for x in devices[i]), *candidates[i]) for s, i in top]


__all__ = ["MAX_PIPELINE_CANDIDATES", "admitted_scorer", "best_pipelines", "fixed_scorer", "pipelines",
           "round_batch"]
