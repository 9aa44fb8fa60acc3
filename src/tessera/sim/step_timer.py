"""Kernel level of the cluster simulator: a deployment's step at a static shape bucket, timed by running
the runtime's own programs (:mod:`tessera.program.program`) through the discrete-event engine of
:mod:`tessera.sim.programs` with the cost model's kernel times and the cluster's links.

A step plan places the kernels of its phase's graph; at another bucket (fewer rows, a longer context)
the graph has the same kernels at other shapes, so the same placement applies (where the count differs,
as for an SSM prefill whose chunked scan repeats per chunk, each kernel takes the target of the planned
kernel of the same module and op, :func:`transfer_assignment`): the graph is traced at
the bucket, every kernel is timed on its target, the programs are built (exact bytes per transfer) and
run, once alone and streamed back to back (the steady-state period is the better of the two: the
engine streams a bucket only where streaming pays). Results are cached per (phase, bucket, M).

On this host's CPU workers, with a host profile fitted at a few decode positions (`tessera.cost.positions`), a
decode step given its furthest cache position charges the kernels whose time follows it (decode attention) at
that position: the step is timed with them at the two profiled positions around it (the nearest two beyond
them) and interpolated linearly between (exact on one device, where a step's time is the sum of its kernels';
an estimate where a split's critical path bends). Without a position, or on GPUs, the step is timed as traced.

MoE expert splits (a grouped expert GEMM spread over targets) have no program form yet (the runtime
does not run them): the kernel runs on its combine's target, taking the slowest part's time plus the
combine, as the parts run in parallel; the parts' token transfers are not in the programs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from tessera.cost.model import CostModel
from tessera.cost.positions import segment
from tessera.errors import TesseraError
from tessera.hardware.cluster import Link
from tessera.plan.build import transfer_assignment
from tessera.plan.context import PhaseSpec, PlanContext
from tessera.plan.deployment import StepPlan
from tessera.plan.step_evaluation import STREAM_STEPS
from tessera.plan.targets import Target, link_between
from tessera.program.program import PlacementError, StepPrograms, build_programs
from tessera.sim.programs import simulate_programs, simulate_stream


class StepTimingError(TesseraError):
    """A step plan that cannot be applied to a bucket's graph."""


@dataclass(frozen=True)
class StepTime:
    """A step at one bucket: ``first_s`` alone (every micro-batch, fill and drain), ``period_s`` per step
    when steps of this bucket stream back to back, kernel seconds per target, bytes cut per step."""

    phase: str
    rows: int
    seq: int | None
    ctx: int | None
    micro_batches: int
    first_s: float
    period_s: float
    busy_s: tuple[float, ...]
    cut_bytes: int
    targets: tuple[int, ...]  # the targets the step's kernels run on


class StepTimer:
    """Times one deployment's steps at any bucket (cached). ``targets`` are the replica's targets the step
    plans index; ``feedback_s`` is the driver's round trip between a step's outputs and the next inputs;
    ``link`` (optional) replaces the cluster's link between every pair of targets (a measured one). On this
    host's CPU workers, with a host profile carrying its overhead, kernels cost what the cost model charges
    them inside a step (the executor's dispatch, weights read from memory) and each step the engine's own
    work (:meth:`engine_step_s`)."""

    def __init__(self, ctx: PlanContext, steps: list[StepPlan], targets: list[Target], feedback_s: float = 0.0,
                 link: Link | None = None):
        self.ctx = ctx
        self.steps = {s.phase: s for s in steps}
        self.targets = targets
        self.feedback_s = feedback_s
        self.link_override = link
        self._cache: dict[tuple, StepTime] = {}
        self._programs: dict[tuple, StepPrograms] = {}
        self._positional: dict[tuple, list[int]] = {}
        profile = ctx.profile
        positions = profile.positions if profile is not None else None
        # the targets on the device the profile measured, which charge decode kernels by their cache position
        self._host = ([t for t, target in enumerate(targets) if target.spec.id == positions.device]
                      if positions is not None else [])
        self._host_model = (CostModel(targets[self._host[0]].spec, ctx.options, profile) if self._host else None)

    def engine_step_s(self, used: tuple[int, ...]) -> float:
        """The serving engine's own seconds per step (between a step's outputs and the next step's inputs,
        beyond the driver's round trip) for a step on targets ``used``: the host profile's measured figure
        where one of them is the host that profile measured (Tessera's engine on CPU workers), else none
        (a GPU's engine is costed by its launches and graphs, not by a host probe)."""
        profile = self.ctx.profile
        overhead = profile.overhead if profile is not None else None
        if overhead is None or not any(self.targets[t].spec.id == profile.device for t in used):
            return 0.0
        return overhead.engine_step_s

    def phase_spec(self, phase: str, rows: int, seq: int | None, ctx: int | None) -> PhaseSpec:
        base = next((p for p in self.ctx.phases if p.phase == phase), None)
        if base is None:
            raise StepTimingError(f"{self.ctx.model} has no phase {phase!r} (phases: "
                                  f"{', '.join(p.phase for p in self.ctx.phases)})")
        seq = seq if seq is not None else base.seq
        if ctx is None:  # no context buckets (an SSM's state does not grow): the traced cache holds the prompt
            ctx = max(base.ctx, seq) if base.ctx is not None and seq is not None else base.ctx
        slots = base.slots
        if slots is not None and phase in self.steps and rows // self.micro_batches(phase, rows) > slots:
            slots = None  # a prefill of batched prompts holds more rows than a micro-batch's state: one per row
        return replace(base, batch=rows, seq=seq, ctx=ctx, slots=slots)

    def micro_batches(self, phase: str, rows: int) -> int:
        """The step plan's M, or the largest count below it that splits ``rows`` evenly."""
        m = self.steps[phase].micro_batches
        while m > 1 and rows % m:
            m //= 2
        return max(1, min(m, rows))

    def link(self, a: int, b: int) -> Link:
        if self.link_override is not None:
            return self.link_override
        return link_between(self.ctx.cluster, self.targets[a], self.targets[b])

    def programs(self, phase: str, rows: int, seq: int | None = None, ctx: int | None = None) -> StepPrograms:
        """The runtime's programs of the step at this bucket (cached)."""
        key = (phase, rows, seq, ctx)
        if key not in self._programs:
            plan = self.steps.get(phase)
            if plan is None:
                raise StepTimingError(f"the deployment has no step plan for phase {phase!r}")
            spec = self.phase_spec(phase, rows, seq, ctx)
            m = self.micro_batches(phase, rows)
            graph = self.ctx.graph(spec, m)
            assignment = list(plan.assignment)
            if len(graph.kernels) != len(assignment):  # e.g. a chunked SSM scan: more chunks for a longer prompt
                base = next(p for p in self.ctx.phases if p.phase == phase)
                assignment = transfer_assignment(self.ctx.graph(base, plan.micro_batches), graph, assignment)
            try:
                self._programs[key] = build_programs(graph, assignment, [t.name for t in self.targets], m)
            except PlacementError as e:
                raise StepTimingError(f"{phase} at {rows} rows (prompt {seq}, context {ctx}): the step plan's "
                                      f"placement does not carry over to this bucket's graph: {e}") from None
        return self._programs[key]

    def kernel_times(self, phase: str, rows: int, seq: int | None, ctx: int | None) -> np.ndarray:
        """[K, targets] seconds of each graph kernel per micro-batch (split expert GEMMs: slowest part +
        combine on the combine's target)."""
        plan = self.steps[phase]
        spec = self.phase_spec(phase, rows, seq, ctx)
        m = self.micro_batches(phase, rows)
        parts = {int(k): v for k, v in plan.expert_parts.items()}
        n_parts = max((len(v) for v in parts.values()), default=1)
        sp = self.ctx.step_problem(spec, self.targets, m, n_parts)
        own = sp.problem_kernels()
        times = sp.problem.times
        out = np.empty((len(own), len(self.targets)))
        for k, ks in enumerate(own):
            if len(ks) == 1:
                out[k] = times[ks[0]]
            else:
                where = parts.get(k, [plan.assignment[k]] * (len(ks) - 1))
                slowest = max(times[p, t] for p, t in zip(ks[:-1], where, strict=True))
                out[k] = slowest + times[ks[-1]]
        return out

    def interpolated(self, phase: str, rows: int, seq: int | None = None, ctx: int | None = None,
                     min_seq: int = 1) -> StepTime:
        """The step at any shape, as an engine runs it without padding: multilinear between the shapes of
        the grid around it (powers of two and their midpoints, in rows, prompt and context; a prefill's cache
        follows its prompt), each traced and timed once. Kernel times are linear in rows and tokens between
        grid points up to tile and wave effects, and the quadratic part of prefill attention makes the
        estimate slightly high."""
        dims = [_bracket(rows, 1), _bracket(seq, min_seq), None if phase == "prefill" else _bracket(ctx, 1)]
        corners = [((r, 1.0),) if r is None else r for r in dims]
        first = period = 0.0
        busy = None
        nearest = None
        for (r, wr), (q, wq), (c, wc) in itertools.product(*corners):
            w = wr * wq * wc
            if w <= 0:
                continue
            t = self.time(phase, r, q, q if phase == "prefill" and ctx is not None else c)
            first += w * t.first_s
            period += w * t.period_s
            b = np.array(t.busy_s) * w
            busy = b if busy is None else busy + b
            nearest = (w, t) if nearest is None or w > nearest[0] else nearest
        _, base = nearest
        return StepTime(phase, rows, seq, ctx, base.micro_batches, first, min(period, first),
                        tuple(float(x) for x in busy), base.cut_bytes, base.targets)

    def time(self, phase: str, rows: int, seq: int | None = None, ctx: int | None = None,
             position: int | None = None) -> StepTime:
        """The step of ``phase`` at ``rows`` rows (and prompt / context buckets), timed (cached); ``position``:
        the furthest cache position its rows read (a decode step), charged to the kernels whose time follows it
        where the host profile has them fitted (see the module docstring).

        Raises:
            StepTimingError: ``position`` outside the step's cache (0 .. context - 1).
        """
        if position is not None:
            spec = self.phase_spec(phase, rows, seq, ctx)
            if spec.ctx is None or not 0 <= position < spec.ctx:
                raise StepTimingError(f"{phase} at {rows} rows: position {position} is outside the step's cache of "
                                      f"{spec.ctx} positions (0 .. {(spec.ctx or 0) - 1})")
            if self._positional_kernels(phase, rows, seq, ctx):
                profiled = self._host_model.positions.positions
                i = segment(profiled, position)
                lo, hi = profiled[i], profiled[i + 1]
                short, long = (self._timed(phase, rows, seq, ctx, p) for p in (lo, hi))
                w = (position - lo) / (hi - lo)
                first = (1 - w) * short.first_s + w * long.first_s
                period = (1 - w) * short.period_s + w * long.period_s
                busy = tuple((1 - w) * a + w * b for a, b in zip(short.busy_s, long.busy_s, strict=True))
                return replace(short, first_s=first, period_s=min(period, first), busy_s=busy)
        return self._timed(phase, rows, seq, ctx, None)

    def _positional_kernels(self, phase: str, rows: int, seq: int | None, ctx: int | None) -> list[int]:
        """The kernels of the step's graph whose time the host profile charges by cache position (cached)."""
        key = (phase, rows, seq, ctx)
        if key not in self._positional:
            found = []
            if self._host_model is not None:
                graph = self.ctx.graph(self.phase_spec(phase, rows, seq, ctx), self.micro_batches(phase, rows))
                found = [k.index for k in graph.kernels if self._host_model.positional_s(k, 0) is not None]
            self._positional[key] = found
        return self._positional[key]

    def kernel_times_at(self, phase: str, rows: int, seq: int | None, ctx: int | None, position: int) -> np.ndarray:
        """:meth:`kernel_times` with the kernels whose time follows the cache position charged at ``position``
        on the targets of the host profile's device."""
        times = self.kernel_times(phase, rows, seq, ctx).copy()
        graph = self.ctx.graph(self.phase_spec(phase, rows, seq, ctx), self.micro_batches(phase, rows))
        for k in self._positional_kernels(phase, rows, seq, ctx):
            times[k, self._host] = self._host_model.positional_s(graph.kernels[k], position)
        return times

    def _timed(self, phase: str, rows: int, seq: int | None, ctx: int | None, position: int | None) -> StepTime:
        """The step timed by its programs, positional kernels at ``position`` (None: as traced) (cached)."""
        key = (phase, rows, seq, ctx, position)
        if key not in self._cache:
            sp = self.programs(phase, rows, seq, ctx)
            times = (self.kernel_times(phase, rows, seq, ctx) if position is None else
                     self.kernel_times_at(phase, rows, seq, ctx, position))

            def kernel_time(d: int, k: int, _m: int) -> float:
                return float(times[k, d])

            alone = simulate_programs(sp, kernel_time, self.link)
            stream = simulate_stream(sp, kernel_time, self.link, STREAM_STEPS, self.feedback_s)
            used = tuple(sorted(set(sp.placement)))
            engine = self.engine_step_s(used)
            first = alone.makespan_s + self.feedback_s + engine
            # the engine streams a bucket's steps only where that beats running them one at a time (a
            # ping-pong split keeps both devices busy inside one step, not across streamed micro-batch jobs)
            self._cache[key] = StepTime(phase, rows, seq, ctx, sp.micro_batches, first,
                                        min(stream.period_s + engine, first), tuple(alone.busy_s), sp.cut_bytes, used)
        return self._cache[key]


def _grid_below(value: int) -> int:
    """The largest point of the interpolation grid (powers of two and their midpoints 3 x 2^k) at most
    ``value`` (>= 1)."""
    p = 1 << (value.bit_length() - 1)
    return p + p // 2 if p >= 2 and p + p // 2 <= value else p


def _grid_above(value: int) -> int:
    """The smallest grid point at least ``value`` (>= 1)."""
    p = 1 << (value - 1).bit_length()
    return 3 * p // 4 if p >= 4 and 3 * p // 4 >= value else p


def _bracket(value: int | None, lowest: int) -> tuple[tuple[int | None, float], ...]:
    """The grid points (powers of two and their midpoints) around ``value`` (at least ``lowest``) with
    their linear weights: kernel times bend between powers of two (tiles, waves, expert counts), so the
    midpoints keep the linear estimate within a few percent."""
    if value is None:
        return ((None, 1.0),)
    value = int(value)
    lo = max(lowest, _grid_below(max(value, 1)))
    if lo >= value:
        return ((value, 1.0),)
    hi = _grid_above(value)
    t = (value - lo) / (hi - lo)
    return ((lo, 1.0 - t), (hi, t))
