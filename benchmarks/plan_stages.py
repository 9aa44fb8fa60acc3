"""Wall time of one `tessera plan` command by stage (benchmarks/README.md, "Plan wall time").

Runs the CLI in this process with the functions that do each stage wrapped, and prints exclusive seconds per
stage (a stage excludes the stages nested in it): tracing (`capture.trace_cache.trace_model_cached`: reading the cache, tracing on a miss), costing (graph facts,
kernel times per target, step problems, expert splits), folding (`fold_groups`, `merge`, `layer_structure`),
solving (`milp.solve_placement`, its heuristics included, and every other HiGHS run: the mixes' and
the bound's LPs), evaluating
(`step_evaluation.evaluate`) and other (the rest: assembling plans, the searches' own work, imports, the CLI).

    PYTHONPATH=src .venv/bin/python benchmarks/plan_stages.py qwen3-235b-a22b --cluster B200:8,H100:8
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
import time

_T0 = time.perf_counter()
_stack: list[list] = []  # [stage, started, nested seconds]
_totals: dict[str, float] = {}


def _wrap(fn, stage: str):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        _stack.append([stage, time.perf_counter(), 0.0])
        try:
            return fn(*args, **kwargs)
        finally:
            name, began, nested = _stack.pop()
            spent = time.perf_counter() - began
            _totals[name] = _totals.get(name, 0.0) + spent - nested
            if _stack:
                _stack[-1][2] += spent
    timed.__wrapped_stage__ = stage
    return timed


def _patch(module_name: str, attr: str, stage: str) -> None:
    """Replace ``module.attr`` everywhere a tessera module holds that same object."""
    import importlib

    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    timed = _wrap(original, stage)
    for name, mod in list(sys.modules.items()):
        if (name.startswith("tessera") or mod is module) and getattr(mod, attr, None) is original:
            setattr(mod, attr, timed)


def _install() -> None:
    import highspy

    import tessera.cli.main  # noqa: F401  (imports the CLI's modules so that their names can be patched)
    import tessera.plan.bound  # noqa: F401
    import tessera.plan.build as build
    import tessera.plan.context  # noqa: F401
    import tessera.plan.mixes  # noqa: F401
    import tessera.plan.planner  # noqa: F401
    import tessera.plan.policies  # noqa: F401

    # reading the trace cache and tracing on a miss count as tracing (not `capture.api.trace_model` itself: importing
    # it imports torch, which a plan from cached graphs never loads)
    _patch("tessera.capture.trace_cache", "trace_model_cached", "tracing")
    for attr in ("target_times", "build_step_problem", "_split_experts"):
        _patch("tessera.plan.build", attr, "costing")
    of = build.GraphFacts.of.__func__
    build.GraphFacts.of = classmethod(_wrap(of, "costing"))
    _patch("tessera.plan.bound", "phase_costs", "costing")
    for attr in ("fold_groups", "merge"):
        _patch("tessera.plan.fold", attr, "folding")
    _patch("tessera.graph.layers", "layer_structure", "folding")
    _patch("tessera.plan.step_evaluation", "evaluate", "evaluating")
    _patch("tessera.plan.milp", "solve_placement", "solving")
    highspy.Highs.run = _wrap(highspy.Highs.run, "solving")


def main(argv: list[str]) -> None:
    """Plan with the given `tessera plan` arguments; print the stages' seconds to stderr."""
    _install()
    from tessera.cli.main import main as cli

    began = time.perf_counter()
    out = io.StringIO()
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out):
        sys.argv = ["tessera", "plan", *argv]
        cli()
    wall = time.perf_counter() - _T0
    rest = wall - sum(_totals.values())
    print(out.getvalue(), end="")
    parts = sorted({**_totals, "other": rest}.items(), key=lambda kv: -kv[1])
    print(f"wall {wall:.1f} s (plan {time.perf_counter() - began:.1f} s, cpu {time.process_time():.1f} s"
          f"{', torch loaded' if 'torch' in sys.modules else ''}): " + ", ".join(f"{k} {v:.1f}" for k, v in parts),
          file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
