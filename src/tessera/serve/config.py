"""What a served deployment asks for, checked: the model, ``cpu:N`` workers, slots and context, where
kernels run for each objective, and the monitor's settings; and the HTTP layer's limits (`HTTPLimits`, applied
by `tessera.serve.connections`). `tessera serve` only parses its options into
a `ServeConfig` and shows its defaults, so this module imports nothing heavy (the CLI reads it at
start-up); `tessera.serve.launch.start_engine` starts a deployment from it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.errors import TesseraError
from tessera.limits import BATCH_ROWS, REQUESTS, THREADS, TOKENS
from tessera.plan.config import LATENCY_BUCKET, check_policy

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any prompt of the contexts served, little for the event loop


class ServeOptionError(TesseraError):
    """A `tessera serve` option that cannot work."""


class HTTPLimitsError(TesseraError, ValueError):
    """An HTTP limit that cannot work (a timeout or a connection count that is not positive)."""


@dataclass(frozen=True)
class HTTPLimits:
    """How long a client may take and how many may be connected: ``header_timeout_s`` to send its request
    line and headers (from the connection's opening or its previous response), ``body_timeout_s`` to send
    a body whole (from its headers), ``max_connections`` open at once, ``keep_alive_s`` idle between
    requests."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024
    keep_alive_s: float = 5.0

    def check(self) -> None:
        """Raise `HTTPLimitsError`, naming the option, for a limit that is not positive."""
        for option, seconds in (("--header-timeout", self.header_timeout_s),
                                ("--body-timeout", self.body_timeout_s),
                                ("the keep-alive timeout (keep_alive_s)", self.keep_alive_s)):
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) \
                    or seconds <= 0:
                raise HTTPLimitsError(f"{option} must be a positive number of seconds (got {seconds!r})")
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            raise HTTPLimitsError(f"--max-connections must be a whole number, at least 1 "
                                  f"(got {self.max_connections!r})")


@dataclass
class ServeConfig:
    """What to serve and how: the model, ``cpu:N`` workers, slots (rows in flight), the longest context,
    where kernels run (a policy, optionally another for the latency plans, or a synthetic placement), the
    monitor's settings and whether steps are batch-invariant (off by default: slower)."""

    model: str
    cluster: str = "cpu:2"
    # 32: 32 requests arriving at once are prefilled in 4 steps of 8 instead of waiting in 4 waves (on the 2-core
    # VM TTFT p50 2.3 s against 7.0 s at 8 slots, and more tokens/s); it costs the KV of 32 rows (377 MB for
    # smollm2-135m at context 512) and two more decode graphs traced at start (benchmarks/README.md)
    slots: int = 32
    max_context: int = 512
    min_prompt_bucket: int = 16
    policy: str = "tessera"
    latency_policy: str | None = None  # default: the policy's own latency-objective step plans
    placement: str | None = None  # alternate | random: a synthetic placement for both objectives
    seed: int = 0
    threads: int | None = None
    latency_rows: int = LATENCY_BUCKET  # requests in flight while the latency plans are active
    beta: float = 1.5
    window_s: float = 0.3
    cooldown_s: float = 1.0
    local: bool = False  # run every step in this process (the single-process reference)
    batch_invariant: bool = False  # GEMMs row by row: a request's outputs do not depend on the batch it is in
    # a lost worker: re-plan onto the survivors and go on (replan), then also start it again and re-plan back
    # onto every worker (respawn), or exit non-zero (fail)
    on_failure: str = "replan"
    max_queue: int | None = 256  # requests waiting for a slot beyond which new ones get 429 (None: no bound)
    queue_timeout_s: float | None = None  # a request without a slot after this long fails with 503 (None: never)
    transfer_timeout_s: float = 30.0  # a worker waiting this long on a peer's transfer counts it lost
    # a plan file (`tessera plan -o`) to serve instead of planning ``policy``: its routes, on these workers (a
    # plan for GPUs: its target i on worker cpu:i); ``policy`` is then only what a lost worker re-plans
    plan_file: str | None = None
    shares: str = "auto"  # how a plan file's routes take requests (tessera.serve.dealing): auto | throughput | latency

    def check(self) -> None:
        """Raise `ServeOptionError` (or the policy's own error) for an option that cannot work."""
        from tessera.hardware.cluster import parse_cluster
        from tessera.program.placements import PLACEMENTS  # on use: it imports torch

        cluster = parse_cluster(self.cluster)
        if any(d.spec.id != "cpu" for d in cluster.devices):
            raise ServeOptionError(f"tessera serve starts local cpu workers (--cluster cpu:N); {cluster.describe()} "
                                   "has GPUs, which are planned and simulated (tessera plan / simulate), not run "
                                   "here")
        if self.slots < 1:
            raise ServeOptionError(f"--slots must be at least 1 (got {self.slots})")
        if not self.transfer_timeout_s > 0:
            raise ServeOptionError(f"--transfer-timeout must be positive (got {self.transfer_timeout_s})")
        BATCH_ROWS.check(self.slots, "--slots")
        if self.max_context < 2:
            raise ServeOptionError(f"--max-context must be at least 2 (got {self.max_context})")
        TOKENS.check(self.max_context, "--max-context")
        if self.threads is not None and self.threads < 1:
            raise ServeOptionError(f"--threads must be at least 1 (got {self.threads})")
        if self.threads is not None:
            THREADS.check(self.threads, "--threads")
        if self.placement is not None and self.placement not in PLACEMENTS:
            raise ServeOptionError(f"--placement must be one of {', '.join(PLACEMENTS)} (got {self.placement!r})")
        if not self.beta > 0:
            raise ServeOptionError(f"--beta must be positive (got {self.beta})")
        if not self.window_s > 0:
            raise ServeOptionError(f"--window-ms must be positive (got {self.window_s * 1000:g})")
        if self.cooldown_s < 0:
            raise ServeOptionError(f"--cooldown-s must be 0 or more (got {self.cooldown_s})")
        if self.max_queue is not None and self.max_queue < 0:
            raise ServeOptionError(f"--max-queue must be 0 or more (got {self.max_queue})")
        if self.max_queue is not None:
            REQUESTS.check(self.max_queue, "--max-queue")
        if self.queue_timeout_s is not None and not self.queue_timeout_s > 0:
            raise ServeOptionError(f"--queue-timeout must be a positive number of seconds (got {self.queue_timeout_s})")
        if self.on_failure not in ("replan", "respawn", "fail"):
            raise ServeOptionError(f"--on-failure must be replan, respawn or fail (got {self.on_failure!r})")
        check_policy(self.policy)
        if self.latency_policy is not None:
            check_policy(self.latency_policy)
        if self.local and self.placement is not None:
            raise ServeOptionError("--local runs every step in this process; --placement places kernels on "
                                   "workers: give one of them")
        from tessera.plan.shares import SHARE_MODES

        if self.shares not in SHARE_MODES:
            raise ServeOptionError(f"--shares must be one of {', '.join(SHARE_MODES)} (got {self.shares!r})")
        if self.plan_file is not None:
            self._check_plan(len(cluster.devices))
        elif self.shares != "auto":
            raise ServeOptionError("--shares deals requests among a plan file's routes: give --plan FILE (or serve "
                                   "with --engine vllm)")

    def _check_plan(self, workers: int) -> None:
        """The plan file served: options that would place kernels otherwise conflict with it, and the file
        must be a plan of this model whose targets fit the workers (read now: errors before serving)."""
        for option, given in (("--latency-policy", self.latency_policy), ("--placement", self.placement)):
            if given is not None:
                raise ServeOptionError(f"--plan serves the plan file's placements; {option} places kernels "
                                       "otherwise: give one of them")
        if self.local:
            raise ServeOptionError("--local runs every step in this process (the single-process reference); --plan "
                                   "places kernels on workers: give one of them")
        from tessera.serve.dealing import DealtRoute, RouteDealer
        from tessera.serve.plan_routes import load_served_plan, split_slots

        served = load_served_plan(self.plan_file, self.model, workers)
        slots = split_slots([r.share for r in served.routes], self.slots)
        RouteDealer([DealtRoute(r.share, r.latency_s, n) for r, n in zip(served.routes, slots, strict=True)],
                    self.shares)  # ShareSwitchError: a mode the plan's routes cannot take
