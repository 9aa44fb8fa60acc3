"""Which candidates of Tessera's search cannot beat the best plan in hand, known before solving them.

A candidate is a replica count r, the main phase's micro-batch count M and the expert split; every plan it
can give serves each request through the main phase's step (``repeats`` steps of ``rows`` rows), so its
time per request is at least ``repeats / rows`` x that step's evaluated cycle
(`tessera.plan.context.PlanContext.assemble`: the busiest lane holds the main step), and its throughput at
most ``r x outputs per request x rows / (repeats x cycle)``. The cycle of any assignment is at least the
step problem's throughput objective (`tessera.plan.problem`, tested in ``tests/plan/test_objective_bound.py``),
which is at least both lower bounds the solver itself starts from: the longest dependency path at every
kernel's fastest time and M x the busiest device when kernels may be split over devices
(`tessera.plan.milp.simple_bound`, `balance_bound`). Those are taken on the unfolded step problem, the one
every plan is evaluated on, so the ceiling holds for whatever placement a solve would return.

Engines that admit from memory run the placement again at the batch its memory admits, at most the most one
engine may admit (`PlanContext.engine_cap`); the ceiling is taken at that largest batch, which bounds plans at
smaller batches as long as a step's time per row does not fall when its rows do: the same assumption the
case's upper bound rests on (`tessera.plan.bound`, checked there at every batch for three models).
"""

from __future__ import annotations

from dataclasses import replace

from tessera.plan.context import PhaseSpec, PlanContext
from tessera.plan.milp import balance_bound, simple_bound
from tessera.plan.step_evaluation import evaluate
from tessera.plan.targets import Target

BALANCE_LP_S = 2.0  # time limit of the balance LP (a few hundredths of a second on a 16-GPU step)
MARGIN = 1e-9  # a candidate is dropped only when its ceiling is below the plan in hand by more than this share


def cycle_floor(ctx: PlanContext, targets: list[Target], m: int, expert_parts: int) -> float:
    """Seconds: no assignment of the main phase's step at M = ``m`` over ``targets`` evaluates to a shorter
    cycle (cached per run)."""
    return _floor(ctx, ctx.main_phase, targets, m, expert_parts)


def _floor(ctx: PlanContext, phase: PhaseSpec, targets: list[Target], m: int, parts: int) -> float:
    """`cycle_floor` of any phase (cached per run)."""
    key = (phase, m, tuple(t.members for t in targets), parts)
    floors = ctx.cache.cycle_floors
    if key not in floors:
        problem = ctx.step_problem(phase, targets, m, parts).problem
        floors[key] = max(simple_bound(problem, "throughput"), balance_bound(problem, BALANCE_LP_S))
    return floors[key]


def _alone(ctx: PlanContext, phase: PhaseSpec, targets: list[Target], m: int, parts: int, target: int) -> float:
    """The evaluated cycle of the phase's step with every kernel on ``target`` (the one placement that uses it
    alone)."""
    problem = ctx.step_problem(phase, targets, m, parts).problem
    return evaluate(problem, [target] * problem.kernels).cycle_s


def _prompt_cycles(ctx: PlanContext, phase: PhaseSpec, cycle) -> float:
    """At most the cycle a plan reports for a prompt phase: the mean over the workload's representative prompt
    lengths (`PlanContext._over_prompts`) or the traced length's, whichever is smaller, of ``cycle(phase)``."""
    traced = cycle(phase)
    lengths = ctx.prompt_lengths if phase.phase == "prefill" and phase.seq is not None else []
    if not lengths:
        return traced
    return min(traced, sum(cycle(replace(phase, seq=n, ctx=n)) for n in lengths) / len(lengths))


def request_time_floor(ctx: PlanContext, targets: list[Target], m: int, expert_parts: int) -> float:
    """Seconds per request no plan over ``targets`` with the main phase at M = ``m`` beats. The main step's
    share of it (``repeats / rows`` x `cycle_floor`); where a prefill and the main phase run on two targets,
    also the lanes (`tessera.plan.deployment.lanes`): the two steps share a target and take turns (their floors
    add up) or each runs alone on its own target (each evaluated there exactly)."""
    main = ctx.main_phase
    per = main.repeats / main.rows
    alone_main = cycle_floor(ctx, targets, m, expert_parts) * per
    others = [p for p in ctx.phases if p is not main]
    if len(targets) != 2 or len(others) != 1 or others[0].phase != "prefill" or others[0].micro_batched:
        return alone_main
    prompt = others[0]
    per_prompt = prompt.repeats / prompt.rows
    shared = alone_main + per_prompt * _prompt_cycles(
        ctx, prompt, lambda ph: _floor(ctx, ph, targets, 1, expert_parts))
    apart = min(max(per * _alone(ctx, main, targets, m, expert_parts, t),
                    per_prompt * _prompt_cycles(ctx, prompt, lambda ph, o=1 - t: _alone(ctx, ph, targets, 1,
                                                                                         expert_parts, o)))
                for t in (0, 1))
    return min(shared, apart)


def throughput_ceiling(ctx: PlanContext, targets: list[Target], replicas: int, m: int, expert_parts: int) -> float:
    """The most throughput (in ``ctx.unit``) any plan of ``replicas`` engines over ``targets`` with the main phase
    at M = ``m`` can reach, engines at the largest batch one may admit (``ctx`` is that batch's context, as
    the search's first context per replica count)."""
    floor = request_time_floor(ctx, targets, m, expert_parts)
    if floor <= 0:
        return float("inf")
    return replicas * ctx.outputs_per_request / floor


def cannot_beat(ceiling: float, incumbent: float | None) -> bool:
    """Whether a candidate whose plans reach at most ``ceiling`` loses to a feasible plan of ``incumbent``
    throughput (None: no feasible plan yet) whatever it finds."""
    return incumbent is not None and ceiling < incumbent * (1 - MARGIN)
