"""What the evaluation suite found: each policy's run on a case (offline, online, network, two GPUs
against the pair) and the whole `SuiteResult` with the machine it ran on."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Any

from tessera.evaluation.config import SuiteConfig


@dataclass
class PolicyRun:
    """One policy's plan on one cluster, and what serving the workload with it achieved (simulated).

    ``status``: ok, n/a (the policy does not apply), no fit (does not fit the devices' memory), failed (the
    simulator could not serve it; ``reason`` says why) or skipped (time budget)."""

    policy: str
    device: str | None
    status: str
    reason: str = ""
    planned: float | None = None  # the planner's throughput estimate (cost model, no simulation)
    simulated: float | None = None  # the simulated throughput (outputs over the makespan)
    cost_per_hour: float | None = None
    replicas: int = 1
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p99_s: float | None = None
    norm_latency_s: float | None = None
    completed: int = 0
    rejected: int = 0
    per_cost_vs_expensive: float | None = None  # (simulated / cost) over the expensive GPU alone's; offline only

    @property
    def label(self) -> str:
        return f"{self.policy} ({self.device})" if self.device else self.policy

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def per_cost(self) -> float | None:
        if self.simulated is None or not self.cost_per_hour:
            return None
        return self.simulated / self.cost_per_hour


@dataclass
class Case:
    """Every policy on one (model, cluster, workload)."""

    model: str
    cluster: str  # as given (shorthand, or a pair such as A100+L40S)
    described: str  # the cluster's one-line description (links included)
    workload: str
    unit: str
    runs: list[PolicyRun]
    seconds: float = 0.0
    expensive: str | None = None  # the pair's pricier device type
    bound: float | None = None  # the planner's upper bound on throughput (tessera.plan.bound)

    def run(self, policy: str, device: str | None = None) -> PolicyRun | None:
        return next((r for r in self.runs if r.policy == policy and (device is None or r.device == device)), None)

    @property
    def tessera(self) -> PolicyRun | None:
        return self.run("tessera")

    def best(self, simulated: bool = True) -> PolicyRun | None:
        """The run with the highest simulated (or planned) throughput."""
        key = "simulated" if simulated else "planned"
        ok = [r for r in self.runs if r.ok and getattr(r, key) is not None]
        return max(ok, key=lambda r: getattr(r, key), default=None)


@dataclass
class OnlineRun:
    """One policy under Poisson arrivals: the highest rate it sustains within the latency target, the
    (rate, normalised latency) points the search simulated, and its tails at the fixed rate."""

    policy: str
    device: str | None
    status: str
    reason: str = ""
    planned: float | None = None
    sustained_rps: float | None = None  # highest rate simulated that met the target (None: not even the lowest)
    bracket: tuple[float | None, float | None] = (None, None)  # (highest rate met, lowest rate missed)
    samples: list[tuple[float, float]] = field(default_factory=list)  # (rate, mean normalised latency s)
    at_fixed: dict[str, Any] | None = None  # simulate().summary() at the fixed rate

    @property
    def label(self) -> str:
        return f"{self.policy} ({self.device})" if self.device else self.policy


@dataclass
class OnlineCase:
    model: str
    cluster: str
    described: str
    workload: str  # the planning workload (its rate is replaced by each simulated rate)
    runs: list[OnlineRun]
    fixed_rate: float | None = None
    fixed_rate_rule: str = ""
    mean_output: float = 0.0
    seconds: float = 0.0
    expensive: str | None = None
    status: str = "ok"  # failed: the simulator cannot serve this model's requests (``reason``); runs are empty
    reason: str = ""


@dataclass
class NetworkCase:
    """One model re-planned and simulated at each inter-node bandwidth (Gb/s -> every policy's run)."""

    model: str
    pair: str
    workload: str
    unit: str
    points: dict[float, list[PolicyRun]] = field(default_factory=dict)
    skipped: list[float] = field(default_factory=list)
    expensive: str | None = None


@dataclass
class PairVsTwo:
    """A heterogeneous pair against two of its expensive GPU (homogeneous: replicas or one sharded group)."""

    model: str
    gpus: str  # the pair, e.g. A100+L40S
    expensive: str
    unit: str
    two: PolicyRun | None  # homogeneous on expensive:2
    pair: PolicyRun | None  # Tessera's plan on the pair (the best simulated one when Tessera was not planned)
    best: PolicyRun | None  # the pair's best simulated policy
    status: str = "ok"
    reason: str = ""


@dataclass
class SuiteResult:
    config: SuiteConfig
    sections: tuple[str, ...]
    machine: dict[str, str]
    started: str
    offline: list[Case] = field(default_factory=list)
    online: list[OnlineCase] = field(default_factory=list)
    clusters: list[Case] = field(default_factory=list)
    network: list[NetworkCase] = field(default_factory=list)
    two_gpus: list[PairVsTwo] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # work per section (summed over jobs); "total": wall
    skipped: list[str] = field(default_factory=list)  # items left out for the time budget
    jobs: int = 1

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        for case in d["network"]:
            case["points"] = {f"{k:g}": v for k, v in case["points"].items()}
        return d


def machine_info() -> dict[str, str]:
    """This host, as the report's header states it (the planner's solver has a time limit, so results depend
    a little on the machine's speed)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo").read().splitlines():  # noqa: SIM115
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numpy
    import torch

    return {"cpu": cpu, "cores": str(os.cpu_count() or 1), "python": platform.python_version(),
            "torch": torch.__version__, "numpy": numpy.__version__, "os": f"{platform.system()} {platform.release()}"}
