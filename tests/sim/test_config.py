"""Simulation requests: bad options and a plan file made for another model are refused with their messages."""

from __future__ import annotations

import json
import re

import pytest

from tessera.plan.config import PlanConfig, PlanConfigError
from tessera.plan.deployment import PlanFileError
from tessera.sim.config import SimulationConfig


def test_max_context_must_be_positive():
    with pytest.raises(PlanConfigError, match=re.escape("--max-context must be at least 1 (got 0)")):
        SimulationConfig(PlanConfig("smollm2-135m", "A100:1,L40S:1"), max_context=0).check()


def test_the_planning_request_is_checked_too():
    with pytest.raises(PlanConfigError, match=re.escape("--prices must be relative or cloud_usd (got 'x')")):
        SimulationConfig(PlanConfig("smollm2-135m", "A100:1,L40S:1", prices="x")).check()


def test_a_plan_file_for_another_model(tmp_path):
    ctx_config = PlanConfig("smollm2-135m", "A100:1,L40S:1", "fixed:in=32,out=8,requests=2", "homogeneous",
                            device="A100", max_batch=2)
    ctx, plan = SimulationConfig(ctx_config).deployment()
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    data["model"] = "llama-3.1-8b"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="is for llama-3.1-8b, not smollm2-135m"):
        SimulationConfig(ctx_config, plan_file=path).deployment()
