"""`tessera run`: generate text with a model disaggregated over worker processes.

stdout carries only the generated text; everything else (setup, placement, timings, checks) goes to
stderr. Under torchrun (several hosts), rank 0 is the driver and ranks 1..N are the workers.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich.markup import escape

from tessera.cli import options as opt
from tessera.console import err as _err
from tessera.console import fail as _fail
from tessera.errors import TesseraError
from tessera.runtime.config import RunConfig

_RUN = RunConfig(model="")


def run(
    model: str = opt.MODEL,
    cluster: str = typer.Option(_RUN.cluster, "--cluster", help="Local workers: cpu:N (N processes, cores/N threads "
                                "each). Under torchrun: cpu:N with N = world size - 1."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt to continue."),
    max_tokens: int = typer.Option(_RUN.max_tokens, "--max-tokens", "-n", help="Most new tokens."),
    plan_file: Path = typer.Option(None, "--plan", help="A plan file from `tessera plan ... --ctx C -o FILE` made "
                                   "for this prompt's shapes; a route mix (from any `tessera plan`) runs the route "
                                   "its shares send a first request to."),
    policy: str = typer.Option(None, "--policy", help="Plan this policy for the run (default tessera), with this "
                               "host's measured kernel times."),
    placement: str = typer.Option(None, "--placement", help="alternate | random: a synthetic placement (stress "
                                  "tests: the most cut edges / a random valid one)."),
    placement_for: str = typer.Option(None, "--placement-for", help="Run the placement --policy (default tessera) "
                                      "plans for this GPU cluster (e.g. A100:1,L40S:1: its cost model, the run's "
                                      "graphs): its target i (one per device type) runs on worker cpu:i."),
    seed: int = typer.Option(_RUN.seed, "--seed", help="Seed of --placement random and of sampling."),
    device: str = typer.Option(None, "--device", "-d", help="homogeneous policy: which worker (default cpu:0)."),
    threads: int = typer.Option(None, "--threads", help="Torch threads per worker (default cores / workers)."),
    profile_file: Path = typer.Option(None, "--profile", help="Kernel times for planning (`tessera profile`); "
                                      "default: measured here for the run's graphs and cached."),
    on_failure: str = typer.Option(_RUN.on_failure, "--on-failure", help="fail | replan: after a lost worker, re-plan "
                                   "onto the survivors and finish the request."),
    backend: str = typer.Option(_RUN.backend, "--backend", help="gloo (CPU tensors; CUDA transfers staged on the host)."),
    temperature: float = typer.Option(_RUN.temperature, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(_RUN.top_p, "--top-p", help="Nucleus sampling mass."),
    interface: str = typer.Option(None, "--interface", help="Under torchrun: the network interface (e.g. eth0) the "
                                  "coordination store and transfers listen on; needed over several hosts, with "
                                  "TESSERA_SECRET_FILE. Default: loopback."),
    check: bool = typer.Option(False, "--check", help="Also generate in this process, eagerly, at the same shapes "
                               "and threads, and fail unless the tokens are identical (smollm2-135m: its cached "
                               "weights are first re-hashed against the manifest written at conversion)."),
) -> None:
    """Generate text on a disaggregated plan: each worker runs its kernels, transfers overlap compute."""
    from tessera.runtime.launch import check_run, serve_torchrun_worker, start_run, torchrun_rank
    from tessera.runtime.session import describe_made, describe_transfers

    rank = torchrun_rank()
    if rank is not None and rank > 0:
        try:
            serve_torchrun_worker(rank, threads, interface)
        except TesseraError as e:
            _fail(e)
        return
    say = lambda text: _err.print(f"[dim]{text}[/]")  # noqa: E731
    run = None
    try:
        config = RunConfig(model, cluster, max_tokens, plan_file, policy, placement, seed, device, threads,
                           profile_file, on_failure, backend, temperature, top_p, interface, placement_for)
        run = start_run(config, prompt, say, log=lambda t: _err.print(t), torchrun_driver=rank == 0)
        say(describe_transfers(run.runner))
        t0 = time.perf_counter()
        printed = []

        def emit(token: int) -> None:
            printed.append(token)
            text = run.tokenizer.decode(printed)
            sys.stdout.write(text[len(run.tokenizer.decode(printed[:-1])):])
            sys.stdout.flush()

        new = run.generate(emit)
        sys.stdout.write("\n")
        seconds = time.perf_counter() - t0
        say(f"{len(new)} tokens in {seconds:.2f} s ({len(new) / seconds:.1f} tokens/s) on {run.workers} workers")
        say(describe_made(run.runner))
        for r in run.runner.recoveries:
            say(f"recovered from losing {r.device} ({r.how}) in {r.seconds:.2f} s: re-planned onto "
                f"{', '.join(r.survivors)}, replayed {r.replayed_steps} steps")
        if check:
            _err.print(f"[green]check: {escape(check_run(run, new))}[/]")
    except TesseraError as e:
        _fail(e)
    finally:
        if run is not None:
            run.pool.close()


def register(app: typer.Typer) -> None:
    """Mount `tessera run`."""
    app.command("run")(run)
