"""What a planning request asks for, checked: the model, the cluster, the workload (the family's default
when none), the policy and objective, and the cost and pricing options; with the names and defaults the
planner accepts. `PlanContext.from_config` turns a request into the context it plans in.

`tessera plan` and `tessera simulate` only parse their options into a `PlanConfig`, and their help texts
show its defaults, so this module imports nothing heavy (the CLI reads it at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.cost.options import CostOptions
from tessera.errors import TesseraError
from tessera.limits import BATCH_ROWS, TOKENS
from tessera.plan.problem import OBJECTIVES
from tessera.workload import default_workload

POLICIES = ("homogeneous", "request-dist", "prefill-decode", "attention-ffn", "layer-pipeline", "tessera")
PRICE_SCENARIOS = ("relative", "cloud_usd")
DEFAULT_MAX_BATCH_LLM = 64  # sequences in flight per replica under a fixed batch (runtime plans)
DEFAULT_MAX_BATCH = {"diffusion": 4}  # images in flight per replica, by family where it differs
DEFAULT_MAX_NUM_SEQS = 256  # per engine, as vLLM's max_num_seqs
DEFAULT_MEMORY_UTILIZATION = 0.9  # of each device's memory, as vLLM's gpu_memory_utilization
DEFAULT_BLOCK_SIZE = 16  # tokens per paged KV block
LATENCY_BUCKET = 8  # sequences in flight under the latency objective's step plans
# A route mix is Tessera's plan only when it beats the best single-engine plan by this much: simulated against
# planned, mixes came out from 6.5 points below to 4.7 points above the single engines of the same case
# (benchmarks/README.md), so a smaller predicted gain does not tell them apart
DEFAULT_MIX_MIN_GAIN = 0.05


class PlanConfigError(TesseraError):
    """A planning option that cannot work (the message names the option and what it accepts)."""


class PolicyError(TesseraError, ValueError):
    """An unknown policy, or a device that the cluster does not have."""


@dataclass(frozen=True)
class AdmissionConfig:
    """How every engine of a deployment admits sequences without a fixed ``--max-batch``: while its devices'
    state memory lasts (paged KV in ``block_size``-token blocks, after weights and peak activations, at
    ``memory_utilization`` of each device), up to ``max_num_seqs`` per engine."""

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION
    block_size: int = DEFAULT_BLOCK_SIZE

    def check(self) -> None:
        """Raise `PlanConfigError` for a value that cannot work."""
        if self.max_num_seqs < 1:
            raise PlanConfigError(f"--max-num-seqs must be at least 1 (got {self.max_num_seqs})")
        BATCH_ROWS.check(self.max_num_seqs, "--max-num-seqs")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise PlanConfigError(f"--gpu-memory-utilization must be in (0, 1] (got {self.memory_utilization}); "
                                  "it is the share of each device's memory an engine may use")
        if self.block_size < 1:
            raise PlanConfigError(f"--block-size must be at least 1 token (got {self.block_size})")
        TOKENS.check(self.block_size, "--block-size")


def check_policy(policy: str) -> str:
    """The policy name, checked against the list."""
    if policy not in POLICIES:
        raise PolicyError(f"unknown policy {policy!r}; policies: {', '.join(POLICIES)}")
    return policy


@dataclass
class PlanConfig:
    """One planning request. ``workload`` None is the model family's default workload; ``cache_ctx`` traces
    every phase at that KV-cache context (the runtime's) instead of the workload's."""

    model: str
    cluster: str
    workload: str | None = None
    policy: str = "tessera"
    objective: str = "throughput"
    device: str | None = None  # homogeneous: the device type
    max_batch: int | None = None
    prices: str = "relative"
    cost: CostOptions = field(default_factory=CostOptions)
    routing_skew: float = 0.0
    cache_ctx: int | None = None
    split_experts: bool = True
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    mix_min_gain: float = DEFAULT_MIX_MIN_GAIN  # a route mix is adopted only past this gain over one engine

    def check(self) -> None:
        """Raise `PlanConfigError` (or `PolicyError`) for an option that cannot work."""
        check_policy(self.policy)
        if not 0.0 <= self.mix_min_gain <= 10.0:
            raise PlanConfigError(f"--mix-min-gain must be a fraction from 0 to 10 (got {self.mix_min_gain}); 0.05 "
                                  "adopts a route mix that plans at least 5% above the best single engine")
        self.admission.check()
        if self.objective not in OBJECTIVES:
            raise PlanConfigError(f"--objective must be one of {', '.join(OBJECTIVES)} (got {self.objective!r})")
        if self.prices not in PRICE_SCENARIOS:
            raise PlanConfigError(f"--prices must be relative or cloud_usd (got {self.prices!r})")
        if self.max_batch is not None and self.max_batch < 1:
            raise PlanConfigError(f"--max-batch must be at least 1 (got {self.max_batch})")
        if self.max_batch is not None:
            BATCH_ROWS.check(self.max_batch, "--max-batch")
        if self.cache_ctx is not None and self.cache_ctx < 1:
            raise PlanConfigError(f"--ctx must be at least 1 (got {self.cache_ctx})")
        if self.cache_ctx is not None:
            TOKENS.check(self.cache_ctx, "--ctx")

    def workload_text(self) -> str:
        """The workload asked for, or the model family's default."""
        from tessera.capture.models import resolve_model  # on use: the catalog reads every config

        return self.workload or default_workload(resolve_model(self.model).family)
