"""`tessera run`: generate text with a model disaggregated over worker processes.

stdout carries only the generated text; everything else (setup, placement, timings, checks) goes to
stderr. Under torchrun (several hosts), rank 0 is the driver and ranks 1..N are the workers.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import typer

from tessera.cli import options as opt
from tessera.console import err as _err
from tessera.console import fail as _fail
from tessera.errors import TesseraError


def _torchrun_rank() -> int | None:
    return int(os.environ["RANK"]) if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ else None


def run(
    model: str = opt.MODEL,
    cluster: str = typer.Option("cpu:2", "--cluster", help="Local workers: cpu:N (N processes, cores/N threads "
                                "each). Under torchrun: cpu:N with N = world size - 1."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt to continue."),
    max_tokens: int = typer.Option(32, "--max-tokens", "-n", help="Most new tokens."),
    plan_file: Path = typer.Option(None, "--plan", help="A plan file from `tessera plan ... --ctx C -o FILE` made "
                                   "for this prompt's shapes."),
    policy: str = typer.Option(None, "--policy", help="Plan this policy for the run (default tessera), with this "
                               "host's measured kernel times."),
    placement: str = typer.Option(None, "--placement", help="alternate | random: a synthetic placement (stress "
                                  "tests: the most cut edges / a random valid one)."),
    seed: int = typer.Option(0, "--seed", help="Seed of --placement random and of sampling."),
    device: str = typer.Option(None, "--device", "-d", help="homogeneous policy: which worker (default cpu:0)."),
    threads: int = typer.Option(None, "--threads", help="Torch threads per worker (default cores / workers)."),
    profile_file: Path = typer.Option(None, "--profile", help="Kernel times for planning (`tessera profile`); "
                                      "default: measured here for the run's graphs and cached."),
    on_failure: str = typer.Option("fail", "--on-failure", help="fail | replan: after a lost worker, re-plan "
                                   "onto the survivors and finish the request."),
    backend: str = typer.Option("gloo", "--backend", help="gloo (CPU tensors; CUDA transfers staged on the host)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    check: bool = typer.Option(False, "--check", help="Also generate in this process, eagerly, at the same shapes "
                               "and threads, and fail unless the tokens are identical."),
) -> None:
    """Generate text on a disaggregated plan: each worker runs its kernels, transfers overlap compute."""
    from tessera.capture.models import resolve_model
    from tessera.hardware.cluster import parse_cluster
    from tessera.runtime.distributed import DistributedRunner
    from tessera.runtime.generate import Sampling, generate
    from tessera.runtime.pool import WorkerPool, check_backend
    from tessera.runtime.session import (
        RunSetupError,
        cache_context,
        describe_transfers,
        distributed_runner_fn,
        host_profile,
        plan_file_placement,
        policy_placement,
        runtime_graphs,
        synthetic,
        weight_files,
    )

    rank = _torchrun_rank()
    if rank is not None and rank > 0:
        _serve_torchrun_worker(rank, threads)
        return
    say = lambda text: _err.print(f"[dim]{text}[/]")  # noqa: E731
    pool = None
    try:
        if sum(x is not None for x in (plan_file, policy, placement)) > 1:
            raise RunSetupError("give at most one of --plan, --policy and --placement")
        if max_tokens < 1:
            raise RunSetupError(f"--max-tokens must be at least 1 (got {max_tokens})")
        if on_failure not in ("fail", "replan"):
            raise RunSetupError(f"--on-failure must be fail or replan (got {on_failure!r})")
        if threads is not None and threads < 1:
            raise RunSetupError(f"--threads must be at least 1 (got {threads})")
        sampling = Sampling(temperature, top_p, seed)
        cl = parse_cluster(cluster)
        if any(d.spec.id != "cpu" for d in cl.devices):
            raise RunSetupError(f"tessera run starts local cpu workers (--cluster cpu:N); {cl.describe()} has GPUs, "
                                "which are planned and simulated, not run here")
        workers = len(cl.devices)
        check_backend(backend, ["cpu"] * workers)
        threads = threads or cl.devices[0].spec.threads or 1
        spec = resolve_model(model)
        files = weight_files(model)
        from transformers import AutoTokenizer

        from tessera.capture.pretrained import weights_dir

        tokenizer = AutoTokenizer.from_pretrained(str(weights_dir(spec)))
        ids = tokenizer(prompt).input_ids
        if not ids:
            raise RunSetupError("the prompt is empty after tokenisation")
        ctx = cache_context(len(ids), max_tokens)
        say(f"tracing {model}: prefill {len(ids)} tokens, decode, cache {ctx}")
        graphs = runtime_graphs(model, len(ids), ctx)
        if placement is not None:
            chosen = synthetic(graphs, workers, placement, seed)
        else:
            profile = None
            if profile_file is not None:
                from tessera.cost.profile import Profile

                profile = Profile.load(profile_file)
            elif (plan_file is None and policy != "homogeneous") or (plan_file is not None and on_failure == "replan"):
                profile = host_profile(model, graphs, threads, say)
            if plan_file is not None:
                chosen = plan_file_placement(plan_file, graphs, workers, model, max_tokens, profile, say)
            else:
                chosen = policy_placement(model, graphs, workers, policy or "tessera", max_tokens, profile, device,
                                          say)
        say(f"placement: {chosen.how}")
        say(f"starting {workers} workers ({threads} thread{'s' if threads != 1 else ''} each)")
        if rank == 0:
            pool = _attach_torchrun(workers, threads)
        else:
            pool = WorkerPool.local(workers, threads, backend=backend)
        runner = DistributedRunner(pool, graphs, chosen.placements, chosen.micro_batches, weights_path=files,
                                   on_failure=on_failure, replan=chosen.replan, log=lambda t: _err.print(t))
        say(describe_transfers(runner))
        t0 = time.perf_counter()
        printed = []

        def emit(token: int) -> None:
            printed.append(token)
            text = tokenizer.decode(printed)
            sys.stdout.write(text[len(tokenizer.decode(printed[:-1])):])
            sys.stdout.flush()

        new = generate(distributed_runner_fn(runner), ids, max_tokens, tokenizer.eos_token_id, sampling, emit)
        sys.stdout.write("\n")
        seconds = time.perf_counter() - t0
        say(f"{len(new)} tokens in {seconds:.2f} s ({len(new) / seconds:.1f} tokens/s) on {workers} workers")
        for r in runner.recoveries:
            say(f"recovered from losing {r.device} ({r.how}) in {r.seconds:.2f} s: re-planned onto "
                f"{', '.join(r.survivors)}, replayed {r.replayed_steps} steps")
        if check:
            _check_single_process(model, ids, max_tokens, ctx, threads, tokenizer.eos_token_id, sampling, new)
    except TesseraError as e:
        _fail(e)
    finally:
        if pool is not None:
            pool.close()


def _check_single_process(model, ids, max_tokens, ctx, threads, eos, sampling, new) -> None:
    import torch

    from tessera.capture.eager import EagerRunner
    from tessera.capture.pretrained import load_pretrained
    from tessera.runtime.generate import generate

    spec, module, values = load_pretrained(model)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        expected = generate(EagerRunner(spec, module, values, slots=1, ctx=ctx), ids, max_tokens, eos, sampling)
    finally:
        torch.set_num_threads(before)
    if expected != new:
        _fail(TesseraError(f"the distributed run differs from the single-process run: {new} vs {expected}"))
    _err.print(f"[green]check: the {len(new)} tokens are identical to a single-process eager run "
               f"({threads} thread{'s' if threads != 1 else ''})[/]")


def _attach_torchrun(workers: int, threads: int):
    import torch.distributed as dist

    from tessera.runtime.pool import RuntimeSetupError, WorkerPool

    world = int(os.environ["WORLD_SIZE"])
    if world - 1 != workers:
        raise RuntimeSetupError(f"torchrun started {world} processes: rank 0 drives and {world - 1} work, but "
                                f"--cluster has {workers} workers")
    store, _, _ = next(dist.rendezvous("env://"))
    return WorkerPool.attach(store, workers, threads, [f"cpu:{w}" for w in range(workers)])


def _serve_torchrun_worker(rank: int, threads: int | None) -> None:
    import torch.distributed as dist

    from tessera.runtime.worker import WorkerConfig, worker_main

    store, _, world = next(dist.rendezvous("env://"))
    n = threads or max(1, (os.cpu_count() or 1) // max(1, world - 1))
    worker_main(WorkerConfig(rank - 1, os.environ.get("MASTER_ADDR", ""), 0, n), store)


def register(app: typer.Typer) -> None:
    """Mount `tessera run`."""
    app.command("run")(run)
