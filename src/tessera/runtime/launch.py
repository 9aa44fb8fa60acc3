"""Starting a generation run on local (or torchrun) cpu workers from a checked `RunConfig`: the prompt's
tokens, the run's graphs, where their kernels go (a plan file, a policy planned with this host's measured
kernel times, or a synthetic placement), the worker pool and the `DistributedRunner`; and the check of a
finished run against a single-process eager one. `tessera run` only parses its options into a `RunConfig`.

Under torchrun rank 0 drives (`attach_torchrun`) and ranks 1..N serve as workers (`serve_torchrun_worker`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tessera.capture.models import resolve_model
from tessera.capture.pretrained import load_tokenizer
from tessera.cost.profile import Profile
from tessera.graph.ir import KernelGraph
from tessera.runtime.config import RunConfig, RunSetupError
from tessera.runtime.coordination import torchrun_plane
from tessera.runtime.distributed import DistributedRunner
from tessera.runtime.generate import generate
from tessera.runtime.pool import RuntimeSetupError, WorkerPool
from tessera.runtime.session import (
    RunPlacement,
    cache_context,
    distributed_runner_fn,
    host_profile,
    placement_for,
    plan_file_placement,
    planned_decode_position,
    policy_placement,
    runtime_graphs,
    synthetic,
    weight_files,
)


@dataclass
class Run:
    """A started run: its tokenizer and prompt ids, cache context, graphs, placement and runner (close the
    pool when done)."""

    config: RunConfig
    tokenizer: Any
    ids: list[int]
    ctx: int
    threads: int
    graphs: dict[str, KernelGraph]
    placement: RunPlacement
    pool: WorkerPool
    runner: DistributedRunner

    @property
    def workers(self) -> int:
        return len(self.pool.devices)

    def generate(self, emit: Callable[[int], None] | None = None) -> list[int]:
        """Generate up to ``max_tokens`` new tokens on the workers (``emit`` is called with each)."""
        return generate(distributed_runner_fn(self.runner), self.ids, self.config.max_tokens,
                        self.tokenizer.eos_token_id, self.config.sampling(), emit)


def _decode_position(graphs: dict[str, KernelGraph], max_tokens: int) -> int:
    """The run's mean decode position (0 for a model without a prompt and a decode step)."""
    prefill, decode = graphs.get("prefill"), graphs.get("decode")
    if prefill is None or decode is None or not prefill.meta.get("seq") or not decode.meta.get("ctx"):
        return 0
    return planned_decode_position(prefill.meta["seq"], max_tokens, decode.meta["ctx"])


def _placement(config: RunConfig, graphs: dict[str, KernelGraph], workers: int, threads: int,
               say: Callable[[str], None]) -> RunPlacement:
    if config.placement is not None:
        return synthetic(graphs, workers, config.placement, config.seed)
    profile = None
    if config.profile_file is not None:
        profile = Profile.load(config.profile_file)
    elif ((config.plan_file is None and config.placement_for is None and config.policy != "homogeneous")
          or ((config.plan_file is not None or config.placement_for is not None) and config.on_failure == "replan")):
        profile = host_profile(config.model, graphs, threads, say,  # to plan for the workers (or re-plan)
                               _decode_position(graphs, config.max_tokens))
    if config.placement_for is not None:
        return placement_for(config.model, graphs, workers, config.placement_for, config.policy or "tessera",
                             config.max_tokens, config.device, profile, say)
    if config.plan_file is not None:
        return plan_file_placement(config.plan_file, graphs, workers, config.model, config.max_tokens, profile, say)
    return policy_placement(config.model, graphs, workers, config.policy or "tessera", config.max_tokens, profile,
                            config.device, say)


def start_run(config: RunConfig, prompt: str, say: Callable[[str], None], log: Callable[[str], None],
              torchrun_driver: bool = False) -> Run:
    """Check ``config``, tokenise ``prompt``, trace and place the run's graphs, start the workers (local
    processes, or attach to torchrun's ranks) and their runner. ``say`` gets progress lines, ``log`` the
    runner's own (lost workers, re-plans)."""
    cluster = config.check()
    if config.interface is not None and not torchrun_driver:
        raise RunSetupError("--interface applies under torchrun (workers on several hosts); local workers meet "
                            "through a private file store, with no network socket")
    workers = len(cluster.devices)
    threads = config.threads or cluster.devices[0].spec.threads or 1
    spec = resolve_model(config.model)
    files = weight_files(config.model)
    tokenizer = load_tokenizer(spec)
    ids = tokenizer(prompt).input_ids
    if not ids:
        raise RunSetupError("the prompt is empty after tokenisation")
    ctx = cache_context(len(ids), config.max_tokens)
    say(f"tracing {config.model}: prefill {len(ids)} tokens, decode, cache {ctx}")
    graphs = runtime_graphs(config.model, len(ids), ctx)
    chosen = _placement(config, graphs, workers, threads, say)
    say(f"placement: {chosen.how}")
    say(f"starting {workers} workers ({threads} thread{'s' if threads != 1 else ''} each)")
    pool = attach_torchrun(workers, threads, config.interface) if torchrun_driver else WorkerPool.local(
        workers, threads, backend=config.backend, allow_lost=config.on_failure == "replan")
    try:
        runner = DistributedRunner(pool, graphs, chosen.placements, chosen.micro_batches, weights_path=files,
                                   on_failure=config.on_failure, replan=chosen.replan, log=log)
    except BaseException:
        pool.close()
        raise
    return Run(config, tokenizer, ids, ctx, threads, graphs, chosen, pool, runner)


def eager_tokens(run: Run) -> list[int]:
    """The tokens a single-process eager run generates at the same shapes, threads and sampling."""
    from tessera.capture.eager import EagerRunner
    from tessera.capture.pretrained import load_pretrained

    spec, module, values = load_pretrained(run.config.model)
    before = torch.get_num_threads()
    torch.set_num_threads(run.threads)
    try:
        return generate(EagerRunner(spec, module, values, slots=1, ctx=run.ctx), run.ids, run.config.max_tokens,
                        run.tokenizer.eos_token_id, run.config.sampling())
    finally:
        torch.set_num_threads(before)


def check_run(run: Run, new: list[int]) -> str:
    """Check a finished run's tokens against a single-process eager run; returns what was compared.

    The eager run reads the same weights files as the workers, so first those files are hashed again and
    compared with the manifest written when they were converted (smollm2-135m): a file damaged after
    conversion fails the check instead of agreeing with itself.

    Raises:
        WeightCacheError: a weights file no longer matches its manifest.
        RunSetupError: the tokens differ.
    """
    from tessera.capture.pretrained import verify_weights

    verified = verify_weights(resolve_model(run.config.model))
    expected = eager_tokens(run)
    if expected != new:
        raise RunSetupError(f"the distributed run differs from the single-process run: {new} vs {expected}")
    weights = verified or "a local model folder has no manifest: its files were not verified independently"
    return (f"the {len(new)} tokens are identical to a single-process eager run ({run.threads} "
            f"thread{'s' if run.threads != 1 else ''}) on the same weights files as the workers; {weights}")


def torchrun_rank() -> int | None:
    """This process's torchrun rank, or None outside torchrun."""
    return int(os.environ["RANK"]) if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ else None


def attach_torchrun(workers: int, threads: int, interface: str | None = None) -> WorkerPool:
    """Rank 0's pool over torchrun's ranks 1..N (checked against the cluster's worker count), on the
    coordination plane of :func:`torchrun_plane` (``interface``: where workers on several hosts meet)."""
    world = int(os.environ["WORLD_SIZE"])
    if world - 1 != workers:
        raise RuntimeSetupError(f"torchrun started {world} processes: rank 0 drives and {world - 1} work, but "
                                f"--cluster has {workers} workers")
    plane, store, _ = torchrun_plane(0, interface)
    try:
        return WorkerPool.attach(store, workers, threads, [f"cpu:{w}" for w in range(workers)], plane)
    except BaseException:
        if plane is not None:
            plane.close()
        raise


def serve_torchrun_worker(rank: int, threads: int | None, interface: str | None = None) -> None:
    """Serve as worker ``rank - 1`` of a torchrun job until the driver closes it."""
    from tessera.runtime.worker import WorkerConfig, worker_main

    world = int(os.environ["WORLD_SIZE"])
    _, store, bind = torchrun_plane(rank, interface)
    n = threads or max(1, (os.cpu_count() or 1) // max(1, world - 1))
    worker_main(WorkerConfig(rank - 1, os.environ.get("MASTER_ADDR", ""), 0, n, bind=bind), store)
