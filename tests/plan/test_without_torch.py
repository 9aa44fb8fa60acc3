"""`tessera plan` from cached graphs and measurements never imports torch: importing the planner's modules
does not, and a whole plan run in a fresh process from a cache this test fills gives the same plan as the
run that filled it, with torch never loaded (each checked in a subprocess, in its ``sys.modules``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tessera.plan.config import PlanConfig
from tessera.plan.context import PlanContext
from tessera.plan.planner import plan_policy

_PLANNER_MODULES = ("tessera.cli.main", "tessera.cli.plan", "tessera.plan.planner", "tessera.plan.context",
                    "tessera.plan.bound", "tessera.plan.policies", "tessera.cost.features", "tessera.cost.profile",
                    "tessera.capture.trace_cache", "tessera.capture.trace_facts", "tessera.hardware.devices")

_PLAN = """
import json, sys
from tessera.plan.config import PlanConfig
from tessera.plan.context import PlanContext
from tessera.plan.planner import plan_policy
plan = plan_policy(PlanContext.from_config(PlanConfig(**json.loads(sys.argv[1]))))
print(json.dumps({"throughput": plan.throughput, "reason": plan.reason, "torch": "torch" in sys.modules}))
"""

CASE = dict(model="smollm2-135m", cluster="A100:1,L40S:1", workload="fixed:in=16,out=8,requests=4")


def _python(code: str, *args: str, env: dict | None = None) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_importing_the_planner_does_not_import_torch():
    code = f"import importlib, sys\nfor m in {_PLANNER_MODULES!r}: importlib.import_module(m)\n" \
           "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    assert _python(code).strip() == "[]"


def test_a_plan_from_the_cache_runs_without_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    first = plan_policy(PlanContext.from_config(PlanConfig(**CASE)))  # traces the graphs into the cache
    again = json.loads(_python(_PLAN, json.dumps(CASE), env={"TESSERA_CACHE": str(tmp_path)}))
    assert again == {"throughput": first.throughput, "reason": first.reason, "torch": False}
