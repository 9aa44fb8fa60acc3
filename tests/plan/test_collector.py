"""The cyclic collector is paused while planning and runs again afterwards, also after an error and when
the pauses nest; the planner's entry points plan with it paused."""

from __future__ import annotations

import gc

import pytest

from tessera.plan import planner
from tessera.plan.collector import collector_paused, without_collector


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_paused_within_and_running_after_also_on_error_and_nested():
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block leaves it as the outer one set it
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("planning failed")
    assert gc.isenabled()


def test_a_collector_off_before_stays_off():
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_the_wrapped_function_runs_paused_and_returns_its_value():
    seen = []

    @without_collector
    def work(x):
        seen.append(gc.isenabled())
        return x + 1

    assert work(1) == 2 and seen == [False] and gc.isenabled()


def test_the_planner_plans_with_the_collector_paused(monkeypatch):
    seen = []

    def policy(ctx, objective, device=None):
        seen.append(gc.isenabled())
        raise RuntimeError("stop here")

    monkeypatch.setattr(planner, "homogeneous", policy)

    class Ctx:
        class cluster:  # noqa: N801
            @staticmethod
            def placement_types():
                return ["A100"]

        @staticmethod
        def say(_text):
            pass

    for entry in (lambda: planner.baselines(Ctx()), lambda: planner.plan_policy(Ctx(), "homogeneous")):
        with pytest.raises(RuntimeError, match="stop here"):
            entry()
    assert seen == [False, False] and gc.isenabled()
