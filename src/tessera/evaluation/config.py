"""What the evaluation suite evaluates (`SuiteConfig`: models, GPU pairs, workloads, clusters, networks,
policies, time budget), checked, with its sections. `tessera evaluate` only parses its options into a
`SuiteConfig` and shows its defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.errors import TesseraError
from tessera.limits import REQUESTS
from tessera.workload import DEFAULT_IMAGE_WORKLOAD

SECTIONS = ("offline", "online", "clusters", "network", "two-gpus")
MODELS = ("llama-3.1-8b", "gpt-oss-20b", "mamba-codestral-7b", "qwen2.5-vl-7b", "sd3.5-medium")
PAIRS = ("A100+L40S", "H100+RTXPRO6000", "B200+H100")
LLM_WORKLOAD = None  # each text family's steady-state default (tessera.workload.default_workload)
IMAGE_WORKLOAD = DEFAULT_IMAGE_WORKLOAD  # 256 images: enough for every engine's steady state


class SuiteError(TesseraError, ValueError):
    """A suite request that cannot run: an unknown section, a bad pair or cluster, a bad setting."""


@dataclass(frozen=True)
class SuiteConfig:
    """What the suite evaluates. The defaults are the full evaluation; ``quick()`` is a tiny one for tests."""

    models: tuple[str, ...] = MODELS
    pairs: tuple[str, ...] = PAIRS
    llm_workload: str | None = LLM_WORKLOAD  # None: the family's default (Llama 1024 outputs, MoE 384, VLM/SSM 128)
    image_workload: str = IMAGE_WORKLOAD
    max_batch: int | None = None  # None: engines admit from memory, up to 256 sequences (4 images) in flight
    online_models: tuple[str, ...] = ("llama-3.1-8b", "gpt-oss-20b", "mamba-codestral-7b", "qwen2.5-vl-7b")
    online_pair: str = "A100+L40S"
    online_lengths: str = "azure-conv"
    online_requests: int = 200
    latency_target_s: float = 0.05  # mean normalised latency (seconds per output token) a sustained rate meets
    bisection_steps: int = 4  # after bracketing the sustained rate within a factor of 2
    clusters: tuple[tuple[str, str], ...] = (("gpt-oss-20b", "A100:2,L40S:1"), ("qwen3-235b-a22b", "B200:8,H100:8"))
    network_models: tuple[str, ...] = ("llama-3.1-8b", "gpt-oss-20b")
    network_pair: str = "A100+L40S"
    bandwidths_gbps: tuple[float, ...] = (25, 50, 100, 200, 400)
    two_gpu_models: tuple[str, ...] | None = None  # None: ``models``
    policies: tuple[str, ...] | None = None  # None: every policy (``tessera plan --compare``)
    prices: str = "relative"
    seed: int = 0
    budget_s: float = 720.0  # no item starts after this many seconds of the suite

    @classmethod
    def quick(cls, **kw: Any) -> SuiteConfig:
        """A tiny suite (smollm2-135m, or ``models``, in every section; one pair; small workloads; the policies
        without a MILP search) that checks the whole pipeline in a minute or two."""
        models = tuple(kw.pop("models", ("smollm2-135m",)))
        base = dict(models=models, pairs=("A100+L40S",), llm_workload="fixed:in=256,out=32,requests=16",
                    image_workload="images:steps=4,resolution=256,requests=4", max_batch=8,
                    online_models=models, online_requests=24, bisection_steps=2,
                    clusters=tuple((m, "A100:2,L40S:1") for m in models), network_models=models,
                    bandwidths_gbps=(25, 400),
                    policies=("homogeneous", "request-dist", "prefill-decode", "layer-pipeline"), budget_s=600.0)
        base.update(kw)
        return cls(**base)

    def check(self) -> None:
        """Clear errors for settings that cannot run (before any planning starts)."""
        from tessera.capture.models import resolve_model
        from tessera.hardware.cluster import parse_cluster
        from tessera.workload import load_lengths, parse_workload

        for model in {*self.models, *self.online_models, *self.network_models, *(m for m, _ in self.clusters),
                      *(self.two_gpu_models or ())}:
            resolve_model(model)
        for model in self.online_models:
            if resolve_model(model).family == "diffusion":
                raise SuiteError(f"online: {model} serves images, not tokens; the online section is for text "
                                 "models (its latency target is per output token)")
        for pair in {*self.pairs, self.online_pair, self.network_pair}:
            split_pair(pair)
        for _, spec in self.clusters:
            parse_cluster(spec)
        if self.llm_workload is not None:
            parse_workload(self.llm_workload)
        parse_workload(self.image_workload)
        load_lengths(self.online_lengths)
        if self.policies is not None:
            from tessera.plan.config import check_policy

            if not self.policies:
                raise SuiteError("give at least one policy")
            for p in self.policies:
                check_policy(p)
        if self.prices not in ("relative", "cloud_usd"):
            raise SuiteError(f"prices must be relative or cloud_usd (got {self.prices!r})")
        if self.online_requests < 1:
            raise SuiteError(f"online requests must be at least 1 (got {self.online_requests})")
        REQUESTS.check(self.online_requests, "--online-requests")
        if self.bisection_steps < 0:
            raise SuiteError(f"bisection steps must be at least 0 (got {self.bisection_steps})")
        if self.max_batch is not None and self.max_batch < 1:
            raise SuiteError(f"max batch must be at least 1 (got {self.max_batch})")
        if not self.latency_target_s > 0:
            raise SuiteError(f"the latency target must be positive (got {self.latency_target_s} s)")
        if not self.bandwidths_gbps or any(not b > 0 for b in self.bandwidths_gbps):
            raise SuiteError(f"bandwidths must be positive Gb/s (got {self.bandwidths_gbps})")
        if not self.budget_s > 0:
            raise SuiteError(f"the time budget must be positive (got {self.budget_s} s)")


def split_pair(pair: str) -> tuple[str, str]:
    """("A100", "L40S") from "A100+L40S" (canonical device ids)."""
    from tessera.hardware.catalog import UnknownDeviceError, canonical_id

    parts = [p.strip() for p in pair.split("+")]
    if len(parts) != 2 or not all(parts):
        raise SuiteError(f"GPU pair {pair!r}: expected TYPE+TYPE, e.g. A100+L40S")
    try:
        a, b = (canonical_id(p) for p in parts)
    except UnknownDeviceError as e:
        raise SuiteError(f"GPU pair {pair!r}: {e}") from None
    if a == b:
        raise SuiteError(f"GPU pair {pair!r}: the two devices must be of different types")
    return a, b


def check_sections(names: list[str] | None) -> tuple[str, ...]:
    """The sections to run, in suite order (all of them for None or an empty list)."""
    if not names:
        return SECTIONS
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SuiteError(f"unknown section {', '.join(map(repr, unknown))}; sections: {', '.join(SECTIONS)}")
    return tuple(s for s in SECTIONS if s in names)
