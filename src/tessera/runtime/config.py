"""What a generation run asks for, checked: the model, ``cpu:N`` workers, new tokens, where kernels run,
sampling and what to do after a lost worker. `tessera run` only parses its options into a `RunConfig`
and shows its defaults, so this module imports nothing heavy (the CLI reads it at start-up);
`tessera.runtime.launch` starts a run from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.errors import TesseraError
from tessera.hardware.cluster import Cluster, parse_cluster
from tessera.limits import THREADS, TOKENS

if TYPE_CHECKING:
    from tessera.runtime.generate import Sampling


class RunSetupError(TesseraError):
    """A run that cannot be set up as asked (model, plan, placement, sampling)."""


ON_FAILURE = ("fail", "replan")


@dataclass
class RunConfig:
    """One generation run: the model, ``cpu:N`` workers, how many new tokens, where kernels run (at most one
    of a plan file, a policy and a synthetic placement; default the tessera policy; the policy planned for
    the workers or, with ``placement_for``, for a GPU cluster they stand in for), sampling, and what to do
    after a lost worker."""

    model: str
    cluster: str = "cpu:2"
    max_tokens: int = 32
    plan_file: Path | None = None
    policy: str | None = None  # default: tessera
    placement: str | None = None  # alternate | random
    seed: int = 0
    device: str | None = None  # homogeneous: which worker
    threads: int | None = None  # default: cores / workers
    profile_file: Path | None = None
    on_failure: str = "fail"
    backend: str = "gloo"
    temperature: float = 0.0
    top_p: float = 1.0
    interface: str | None = None  # torchrun: the network interface workers on several hosts meet on
    placement_for: str | None = None  # a (GPU) cluster whose plan for the run the workers stand in for

    def check(self) -> Cluster:
        """The run's cluster, after every option is checked (`RunSetupError`, or `TargetMapError` for
        ``placement_for``, names the one that cannot work)."""
        if sum(x is not None for x in (self.plan_file, self.policy, self.placement)) > 1:
            raise RunSetupError("give at most one of --plan, --policy and --placement")
        if self.placement_for is not None and (self.plan_file is not None or self.placement is not None):
            raise RunSetupError("--placement-for plans a policy (--policy, default tessera) for that cluster; it "
                                "does not combine with --plan or --placement")
        if self.placement_for is not None and self.profile_file is not None:
            raise RunSetupError("--profile gives kernel times for planning on the workers themselves; "
                                "--placement-for plans with the cost model of the cluster it names")
        if self.max_tokens < 1:
            raise RunSetupError(f"--max-tokens must be at least 1 (got {self.max_tokens})")
        TOKENS.check(self.max_tokens, "--max-tokens")
        if self.on_failure not in ON_FAILURE:
            raise RunSetupError(f"--on-failure must be fail or replan (got {self.on_failure!r})")
        if self.threads is not None and self.threads < 1:
            raise RunSetupError(f"--threads must be at least 1 (got {self.threads})")
        if self.threads is not None:
            THREADS.check(self.threads, "--threads")
        self.sampling()
        if self.interface is not None:
            from tessera.runtime.coordination import interface_address  # on use: imports torch.distributed

            interface_address(self.interface)
        cluster = parse_cluster(self.cluster)
        if any(d.spec.id != "cpu" for d in cluster.devices):
            raise RunSetupError(f"tessera run starts local cpu workers (--cluster cpu:N); {cluster.describe()} has "
                                "GPUs, which are planned and simulated, not run here")
        from tessera.runtime.pool import check_backend  # on use: torch.distributed is slow to import

        check_backend(self.backend, ["cpu"] * len(cluster.devices))
        if self.placement_for is not None:
            from tessera.runtime.target_map import target_map  # on use: imports the planner's targets

            target_map(self.placement_for, len(cluster.devices))
        return cluster

    def sampling(self) -> Sampling:
        """The run's sampling (checked)."""
        from tessera.runtime.generate import Sampling  # on use: torch is slow to import

        return Sampling(self.temperature, self.top_p, self.seed)
