"""What a simulation request asks for, checked: a planning request (or a plan file made for the same
model), the longest context a request may have and the seed of the arrivals; and the deployment it
simulates. `tessera simulate` only parses its options into a `SimulationConfig` and shows its defaults."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.limits import TOKENS
from tessera.plan.config import PlanConfig, PlanConfigError
from tessera.sched.scheduler import DEFAULT_MAX_CONTEXT

if TYPE_CHECKING:
    from tessera.plan.context import PlanContext
    from tessera.plan.deployment import DeploymentPlan


@dataclass
class SimulationConfig:
    """Simulate ``plan_file`` if given, else the plan of ``plan.policy``, serving ``plan``'s workload."""

    plan: PlanConfig
    plan_file: Path | None = None
    max_context: int = DEFAULT_MAX_CONTEXT
    seed: int = 0

    def check(self) -> None:
        """Raise a `TesseraError` for an option that cannot work."""
        self.plan.check()
        if self.max_context < 1:
            raise PlanConfigError(f"--max-context must be at least 1 (got {self.max_context})")
        TOKENS.check(self.max_context, "--max-context")

    def deployment(self, progress: Callable[[str], None] | None = None) -> tuple[PlanContext, DeploymentPlan]:
        """The planning context and the deployment to simulate: the plan file's, or the policy planned now."""
        # on use: the CLI reads this module's defaults at start-up, before torch is imported
        from tessera.plan.context import PlanContext
        from tessera.plan.deployment import DeploymentPlan, PlanFileError
        from tessera.plan.planner import plan_policy

        self.check()
        ctx = PlanContext.from_config(self.plan, progress)
        if self.plan_file is not None:
            plan = DeploymentPlan.load(self.plan_file)
            if plan.model != self.plan.model:
                raise PlanFileError(f"plan file {self.plan_file} is for {plan.model}, not {self.plan.model}; plan "
                                    f"{self.plan.model} again")
            return ctx, plan
        if progress is not None:
            progress(f"planning {self.plan.policy} for {self.plan.model} on {ctx.cluster.describe()} "
                     f"({ctx.workload_text})")
        return ctx, plan_policy(ctx, self.plan.policy, "throughput", self.plan.device)
