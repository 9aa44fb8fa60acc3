"""`tessera serve` (the OpenAI-compatible server over local cpu workers) and `tessera bench` (a workload
sent to such a server). Diagnostics go to stderr; `bench --json` prints only JSON on stdout."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from tessera.cli import options as opt
from tessera.cli.sockets import is_loopback, listen, url_of
from tessera.console import err as _err
from tessera.console import fail as _fail
from tessera.console import out as _out
from tessera.errors import TesseraError
from tessera.serve.config import MAX_BODY_BYTES, HTTPLimits, ServeConfig, ServeOptionError

_SERVE = ServeConfig(model="")
_LIMITS = HTTPLimits()


def serve(
    model: str = opt.MODEL,
    cluster: str = typer.Option(_SERVE.cluster, "--cluster", help="Local workers: cpu:N (N processes, cores/N threads "
                                "each)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port)."),
    api_key: str = typer.Option(None, "--api-key", envvar="TESSERA_API_KEY",
                                help="Require 'Authorization: Bearer KEY' on /v1 requests."),
    policy: str = typer.Option(None, "--policy", help="The policy planned (with this host's measured kernel "
                               "times) for both objectives: homogeneous | request-dist | prefill-decode | "
                               "attention-ffn | layer-pipeline | tessera (the default: the best plan for one copy of the "
                               "model over the workers, or request-dist where its plan is predicted faster, also on a burst "
                               "that fills every slot, or within 5% of it at a lower time per output token)."),
    latency_policy: str = typer.Option(None, "--latency-policy", help="Another policy for the latency objective "
                                       "(default: --policy's own latency step plans)."),
    placement: str = typer.Option(None, "--placement", help="alternate | random: a synthetic placement for both "
                                  "objectives instead of a plan (stress tests)."),
    seed: int = typer.Option(_SERVE.seed, "--seed", help="Seed of --placement random."),
    slots: int = typer.Option(_SERVE.slots, "--slots", help="Requests in flight at once (KV-cache rows)."),
    max_context: int = typer.Option(_SERVE.max_context, "--max-context", help="Longest prompt + output a request may have."),
    threads: int = typer.Option(None, "--threads", help="Torch threads per worker (default cores / workers); "
                                "--engine vllm: the cores each engine's worker binds."),
    beta: float = typer.Option(_SERVE.beta, "--beta", help="Monitor: switch to the throughput plans when mean latency / "
                               "execution time reaches this."),
    window_ms: float = typer.Option(_SERVE.window_s * 1000, "--window-ms", help="Monitor window in milliseconds."),
    cooldown_s: float = typer.Option(_SERVE.cooldown_s, "--cooldown-s", help="Least time between two plan switches."),
    local: bool = typer.Option(_SERVE.local, "--local", help="Run every step in this process (the single-process "
                               "reference) instead of on workers."),
    batch_invariant: bool = typer.Option(_SERVE.batch_invariant, "--batch-invariant", help="GEMMs row by row, so a "
                                         "request's outputs do not depend on the requests batched with it (slower; "
                                         "off by default)."),
    on_failure: str = typer.Option(_SERVE.on_failure, "--on-failure", help="replan | respawn | fail: after a lost "
                                   "worker, re-plan onto the survivors and go on; also start it again and re-plan "
                                   "back onto every worker; or exit non-zero (for a supervisor)."),
    max_queue: int = typer.Option(_SERVE.max_queue, "--max-queue", help="Requests that may wait for a slot; beyond "
                                  "them a new request gets 429 with Retry-After (split between request-dist "
                                  "replicas)."),
    queue_timeout: float = typer.Option(None, "--queue-timeout", help="Seconds a request may wait for its first "
                                        "slot before it fails with 503 (default: no deadline)."),
    transfer_timeout: float = typer.Option(_SERVE.transfer_timeout_s, "--transfer-timeout", help="Seconds a worker "
                                           "waits on another's transfer before counting it lost."),
    shutdown_timeout: float = typer.Option(10.0, "--shutdown-timeout", help="Seconds SIGTERM / Ctrl-C waits for "
                                           "requests in flight before ending them with an error."),
    max_body_bytes: int = typer.Option(MAX_BODY_BYTES, "--max-body-bytes", help="Largest request body accepted "
                                       "(413 above it)."),
    header_timeout: float = typer.Option(_LIMITS.header_timeout_s, "--header-timeout", help="Seconds a client has "
                                         "to send a request's headers before its connection is closed."),
    body_timeout: float = typer.Option(_LIMITS.body_timeout_s, "--body-timeout", help="Seconds a client has to send "
                                       "a request's body (408 after)."),
    max_connections: int = typer.Option(_LIMITS.max_connections, "--max-connections", help="Open connections at "
                                        "most (503 beyond)."),
    engine: str = typer.Option("tessera", "--engine", help="tessera: Tessera's own kernel-level runtime on cpu "
                               "workers | vllm: one vLLM server per engine of the plan, Tessera's router in front."),
    plan_file: Path = typer.Option(None, "--plan", help="Serve this plan file (`tessera plan -o`; route mixes "
                                   "included) instead of planning --policy, made for --cluster or, with cpu workers "
                                   "standing in (target i on cpu:i), for a GPU cluster."),
    placement_for: str = typer.Option(None, "--placement-for", help="--engine vllm: plan --policy for this GPU "
                                      "cluster (e.g. A100:1,L40S:1), each of its targets on one cpu worker."),
    mix_min_gain: float = typer.Option(None, "--mix-min-gain", help="--engine vllm with --policy tessera: adopt a "
                                       "route mix from this planned gain over one engine (default 0.05)."),
    vllm_python: str = typer.Option(None, "--vllm-python", envvar="TESSERA_VLLM_PYTHON", help="--engine vllm: the "
                                    "interpreter of the vLLM environment (default .venv-vllm/bin/python; `make "
                                    "vllm-env` creates it)."),
    enforce_eager: bool = typer.Option(True, "--enforce-eager/--no-enforce-eager", help="--engine vllm: skip "
                                       "vLLM's compile warm-up (30-40 s to healthy here instead of about 2 min)."),
    prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching", help="--engine vllm: vLLM's "
                                        "prefix caching (off to compare engines on repeated prompts)."),
    kv_cache_gib: float = typer.Option(1.0, "--kv-cache-gib", help="--engine vllm: KV cache of each engine on a cpu "
                                       "worker, GiB."),
    max_in_flight: int = typer.Option(512, "--max-in-flight", help="--engine vllm: requests the router forwards at "
                                      "once (429 with Retry-After beyond)."),
    shares: str = typer.Option(None, "--shares", help="How requests take the plan's routes (--engine vllm: the "
                               "router's; --engine tessera: with --plan): auto (all on the plan's fastest route "
                               "until its engine is full, then the plan's shares; the default) | throughput (the "
                               "plan's) | latency."),
    log_dir: Path = typer.Option(None, "--log-dir", help="--engine vllm: the engines' logs (default: a new temporary "
                                 "folder, named at start)."),
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics): on Tessera's own runtime, its kernels placed on local cpu workers (--engine
    tessera), or as vLLM engines, one per engine of the plan, behind Tessera's router (--engine vllm). It
    listens at once (/health answers 503 until the engines are up); SIGTERM drains; it exits non-zero when
    the engine cannot go on."""
    from tessera.serve.server import ServerOptions, run_server

    say = lambda text: _err.print(f"[dim]{text}[/]", highlight=False)  # noqa: E731
    limits = HTTPLimits(header_timeout, body_timeout, max_connections)
    if engine == "vllm":
        code = _serve_vllm(model, cluster, policy or _SERVE.policy, plan_file, placement_for, mix_min_gain, vllm_python,
                           max_context, enforce_eager, prefix_caching, kv_cache_gib, log_dir, host, port, api_key,
                           max_body_bytes, max_in_flight, limits, shutdown_timeout, threads, shares or "auto",
                           cooldown_s)
        if code:
            raise typer.Exit(code)
        return
    try:
        if engine != "tessera":
            raise ServeOptionError(f"--engine must be tessera or vllm (got {engine!r})")
        for name, given in (("--placement-for", placement_for), ("--mix-min-gain", mix_min_gain)):
            if given is not None:
                raise ServeOptionError(f"{name} is an option of --engine vllm; `tessera serve --engine tessera` "
                                       "plans --policy for its cpu workers itself, or serves a plan file (--plan)")
        if plan_file is not None and policy is not None:
            raise ServeOptionError("--plan is a plan already made; --policy plans one now: give one of them")
        limits.check()
        cfg = ServeConfig(model, cluster, slots=slots, max_context=max_context, policy=policy or _SERVE.policy,
                          latency_policy=latency_policy, placement=placement, seed=seed, threads=threads,
                          beta=beta, window_s=window_ms / 1000, cooldown_s=cooldown_s, local=local,
                          batch_invariant=batch_invariant, on_failure=on_failure, max_queue=max_queue,
                          transfer_timeout_s=transfer_timeout,
                          queue_timeout_s=queue_timeout, plan_file=str(plan_file) if plan_file else None,
                          shares=shares or "auto")
        cfg.check()
        from tessera.capture.models import resolve_model

        resolve_model(model)  # an unknown model fails here, not after listening
        if not 0 <= port <= 65535:
            raise ServeOptionError(f"--port must be 0..65535 (got {port})")
        if not shutdown_timeout >= 0:
            raise ServeOptionError(f"--shutdown-timeout must be 0 or more seconds (got {shutdown_timeout})")
        if max_body_bytes < 1024:
            raise ServeOptionError(f"--max-body-bytes must be at least 1024 (got {max_body_bytes})")
        sock = listen(host, port)
    except TesseraError as e:
        _fail(e)
    _warn_if_open(sock, host, api_key)
    url = url_of(sock)
    say(f"listening at {url} (/health answers 503 until the engine is up)")

    def announce(how: str) -> None:
        say(f"placement: {how}")
        _err.print(f"serving {model} at {url}/v1 ({slots} slots, context {max_context}"
                   f"{', API key required' if api_key else ''}); Ctrl-C stops", markup=False, highlight=False)

    code = run_server(cfg, sock, ServerOptions(model, api_key, max_body_bytes, shutdown_timeout, limits), say,
                      announce)
    if code:
        raise typer.Exit(code)


def _serve_vllm(model, cluster, policy, plan_file, placement_for, mix_min_gain, vllm_python, max_context,
                enforce_eager, prefix_caching, kv_cache_gib, log_dir, host, port, api_key, max_body_bytes,
                max_in_flight, limits, shutdown_timeout, threads, shares, cooldown_s) -> int:
    """`tessera serve --engine vllm`: the options checked, the router's socket bound, then the engines."""
    from tessera.cli.engines import serve_vllm
    from tessera.engines.vllm import default_python
    from tessera.plan.config import check_policy
    from tessera.plan.shares import SHARE_MODES
    from tessera.router.launch import VLLMServeConfig

    try:
        check_policy(policy)
        limits.check()
        if plan_file is not None and placement_for is not None:
            raise ServeOptionError("--plan is a plan already made; --placement-for plans --policy now: give one")
        if not kv_cache_gib > 0:
            raise ServeOptionError(f"--kv-cache-gib must be positive (got {kv_cache_gib})")
        if max_in_flight < 1:
            raise ServeOptionError(f"--max-in-flight must be at least 1 (got {max_in_flight})")
        if shares not in SHARE_MODES:
            raise ServeOptionError(f"--shares must be one of {', '.join(SHARE_MODES)} (got {shares!r})")
        if not 0 <= port <= 65535:
            raise ServeOptionError(f"--port must be 0..65535 (got {port})")
        if threads is not None and threads < 1:
            raise ServeOptionError(f"--threads must be at least 1 (got {threads})")
        if max_context < 16:
            raise ServeOptionError(f"--max-context must be at least 16 for vLLM (got {max_context})")
        cfg = VLLMServeConfig(model, cluster, str(plan_file) if plan_file else None, policy, placement_for,
                              mix_min_gain, vllm_python or default_python(), max_context, enforce_eager, prefix_caching,
                              int(kv_cache_gib * (1 << 30)), str(log_dir) if log_dir else None, threads, shares,
                              cooldown_s)
        from tessera.capture.models import resolve_model

        resolve_model(model)
        sock = listen(host, port)
    except TesseraError as e:
        _fail(e)
    _warn_if_open(sock, host, api_key)
    return serve_vllm(cfg, sock, url_of(sock), api_key, max_body_bytes, max_in_flight, limits, shutdown_timeout)


def _warn_if_open(sock, host: str, api_key: str | None) -> None:
    """Warn when the server listens beyond loopback without an API key."""
    if api_key is None and not is_loopback(sock):
        _err.print(f"[yellow]warning:[/] listening on {host}, reachable from other machines, without an API key: "
                   "anyone who can reach it can use it; give --api-key (or TESSERA_API_KEY)", highlight=False)


def _s(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def bench(
    url: str = typer.Option(..., "--url", help="The server, e.g. http://127.0.0.1:8000 (with or without /v1)."),
    workload: str = typer.Option(..., "--workload", "-w", help="fixed:in=..,out=..,requests=.. (all at once) | "
                                 "poisson:rate=..,lengths=azure-conv|FILE[,requests=N] (Poisson arrivals)."),
    model: str = typer.Option(None, "--model", help="The model field of each request (default: the first "
                              "model /v1/models lists)."),
    api_key: str = typer.Option(None, "--api-key", envvar="TESSERA_API_KEY", help="Sent as a Bearer token."),
    slo_ttft: float = typer.Option(None, "--slo-ttft", help="TTFT objective in seconds (for SLO attainment)."),
    slo_tpot: float = typer.Option(None, "--slo-tpot", help="TPOT objective in seconds (for SLO attainment)."),
    seed: int = typer.Option(0, "--seed", help="Seed of a poisson workload's arrivals and lengths."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds one request may take."),
    as_json: bool = opt.JSON,
) -> None:
    """Benchmark an OpenAI-compatible server: a workload's requests sent open loop as streamed completions;
    output tokens/s, TTFT and TPOT p50/p99, SLO attainment."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tessera.serve.bench import BenchError, base_url, run_bench
    from tessera.workload import parse_workload

    try:
        base_url(url)
        parse_workload(workload)
        for name, value in (("--slo-ttft", slo_ttft), ("--slo-tpot", slo_tpot), ("--timeout", timeout)):
            if value is not None and not value > 0:
                raise BenchError(f"{name} must be positive seconds (got {value})")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=_err, transient=True, disable=as_json) as bar:
            task = bar.add_task("requests", total=None)

            def progress(done: int, failed: int, total: int) -> None:
                bar.update(task, completed=done, total=total,
                           description=f"requests ({failed} failed)" if failed else "requests")

            report = run_bench(url, workload, model, api_key, seed, slo_ttft, slo_tpot, timeout, progress)
    except TesseraError as e:
        _fail(e)
    s = report.summary()
    if as_json:
        print(json.dumps(s, indent=2))
        return
    table = Table(title=f"{s['model']} at {s['url']}: {s['workload']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [("requests completed", f"{s['completed']} of {s['requests']}"),
            ("failed", str(s["failed"])),
            ("duration", _s(s["duration_s"])),
            ("output tokens", str(s["output_tokens"])),
            ("throughput", f"{s['throughput']:.3g} tokens/s" if s["throughput"] else "-"),
            ("TTFT p50 / p99", f"{_s(s['ttft_p50_s'])} / {_s(s['ttft_p99_s'])}"),
            ("TPOT p50 / p99", f"{_s(s['tpot_p50_s'])} / {_s(s['tpot_p99_s'])}"),
            ("latency p50 / p99", f"{_s(s['latency_p50_s'])} / {_s(s['latency_p99_s'])}")]
    if s["slo"] is not None:
        slo = s["slo"]
        goal = " and ".join(f"{k} <= {_s(slo[f'{k.lower()}_s'])}" for k in ("TTFT", "TPOT")
                            if slo[f"{k.lower()}_s"] is not None)
        rows.append((f"SLO attainment ({goal})", f"{100 * slo['attainment']:.1f}%"))
    for name, value in rows:
        table.add_row(name, value)
    _out.print(table)
    for e in s["errors"]:
        _err.print(f"[yellow]failed request:[/] {e}", highlight=False)
    if s["failed"] and not s["completed"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Mount `tessera serve` and `tessera bench`."""
    app.command("serve")(serve)
    app.command("bench")(bench)
