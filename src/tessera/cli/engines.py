"""Engine-level plans on vLLM: `tessera serve --engine vllm` (engines on this host's cpu workers, the router
in front), `tessera route` (the router alone, over engines started elsewhere) and `tessera deploy` (every
engine's command and the router's, for a GPU cluster)."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import threading
from pathlib import Path

import typer

from tessera.console import err as _err
from tessera.console import fail as _fail
from tessera.console import out as _out
from tessera.errors import TesseraError
from tessera.serve.step_probe import DEFAULT_CONTEXTS, DEFAULT_PROMPTS, DEFAULT_ROWS


def serve_vllm(cfg, sock: socket.socket, url: str, api_key: str | None, max_body_bytes: int, max_in_flight: int,
               limits, grace_s: float) -> int:
    """Plan, start the vLLM engines behind the router listening on ``sock``; block until shut down. The router
    answers at once (/health 503 while the engines start); the exit code (1 when an engine cannot start)."""
    from tessera.engines.kvstore import StoreCleaner
    from tessera.engines.process import Supervisor, pin_this_process
    from tessera.router.app import RouterOptions
    from tessera.router.launch import deployment_router, prepare_vllm
    from tessera.router.server import run_router

    say = lambda text: _err.print(f"[dim]{text}[/]", highlight=False)  # noqa: E731
    try:
        prepared = prepare_vllm(cfg, say)
    except TesseraError as e:
        sock.close()
        _fail(e)
    deployment = prepared.deployment
    if deployment.host_cores:
        pin_this_process(deployment.host_cores)
        say(f"router and engine schedulers on core(s) {','.join(map(str, deployment.host_cores))}; engines compute "
            "on " + ", ".join(f"{ln.engine.name} {','.join(map(str, ln.placement.cores))}" for ln in deployment.launches))
    supervisor = Supervisor(list(deployment.launches), prepared.logs, say=say)
    try:
        router = deployment_router(deployment, RouterOptions(cfg.model, api_key, max_body_bytes, max_in_flight,
                                                             shares=cfg.shares, cooldown_s=cfg.cooldown_s), supervisor)
    except TesseraError as e:
        sock.close()
        _fail(e)
    router.ready = False  # 503 until every engine is up
    cleaner = StoreCleaner(prepared.store).start()
    code = [0]
    say(f"plan: {prepared.how}; engine logs in {prepared.logs}")
    for r in deployment.routes:
        latency = f", planned latency {r.latency_s:.3g} s" if r.latency_s is not None else ""
        say(f"route {r.name}: {r.share:.0%} of requests via {' -> '.join(r.hops)}{latency}")
    if router.table.switch.fastest is not None:
        say(f"route shares: {cfg.shares} (now {router.table.switch.mode}: "
            + ("the plan's" if router.table.switch.mode == "throughput" else
               f"all on {router.table.switch.fastest.name} until {router.table.switch.capacity} are in flight")
            + ")")

    def start() -> None:
        try:
            took = supervisor.start()
        except TesseraError as e:
            _err.print(f"[red]error:[/] {e}", highlight=False)
            code[0] = 1
            router.draining = True  # so the signal below stops the router at once
            os.kill(os.getpid(), signal.SIGINT)
            return
        router.ready = True
        _err.print(f"serving {cfg.model} at {url}/v1 through {len(deployment.launches)} vLLM engines (up in "
                   f"{took:.0f} s); Ctrl-C stops", markup=False, highlight=False)

    try:
        run_router(router, sock, limits, grace_s, say,
                   ready=lambda: (say(f"router listening at {url} (/health answers 503 until the engines are up)"),
                                  threading.Thread(target=start, name="tessera-engines-start", daemon=True).start()))
    finally:
        say("stopping the engines")
        supervisor.stop()
        cleaner.stop()
    return code[0]


def route(
    plan_file: Path = typer.Argument(..., help="The plan file (`tessera plan ... -o FILE`) whose routes to follow."),
    engine_url: list[str] = typer.Option(..., "--engine-url", help="NAME=URL of each engine of the plan (its names: "
                                         "`tessera deploy PLAN`), e.g. prefill@L40S=http://10.0.0.2:8100."),
    connector: str = typer.Option("nixl", "--kv-connector", help="The KV connector the prefill and decode engines "
                                  "use: nixl | tessera-store | example."),
    model_id: str = typer.Option(None, "--served-model-name", help="The model id clients send (default: the plan's "
                                 "model)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    api_key: str = typer.Option(None, "--api-key", envvar="TESSERA_API_KEY", help="Require 'Authorization: Bearer "
                                "KEY' on /v1 requests."),
    max_in_flight: int = typer.Option(512, "--max-in-flight", help="Requests forwarded at once; beyond it 429 with "
                                      "Retry-After."),
    shares: str = typer.Option("auto", "--shares", help="Route shares: auto (all on the plan's fastest route until "
                               "its engine is full, then the plan's shares) | throughput (the plan's) | latency."),
    cooldown_s: float = typer.Option(1.0, "--cooldown-s", help="Least time between two switches of the shares."),
    shutdown_timeout: float = typer.Option(10.0, "--shutdown-timeout", help="Seconds SIGTERM waits for requests in "
                                           "flight."),
) -> None:
    """Tessera's router alone: the OpenAI API in front of a plan's engines started elsewhere (what `tessera
    deploy` prints for a GPU cluster), each request along the plan's routes in their planned shares."""
    from tessera.cli.sockets import listen, url_of
    from tessera.engines.vllm import CONNECTORS, VLLMSetupError
    from tessera.plan.deployment import DeploymentPlan
    from tessera.router.app import RouterOptions
    from tessera.router.launch import router_for
    from tessera.router.server import run_router
    from tessera.serve.config import HTTPLimits

    say = lambda text: _err.print(f"[dim]{text}[/]", highlight=False)  # noqa: E731
    try:
        if connector not in CONNECTORS:
            raise VLLMSetupError(f"--kv-connector must be one of {', '.join(CONNECTORS)} (got {connector!r})")
        plan = DeploymentPlan.load(plan_file)
        urls = _engine_urls(engine_url)
        names = {e.name for e in plan.layout.engines}
        unknown, missing = sorted(set(urls) - names), sorted(names - set(urls))
        if unknown or missing:
            raise VLLMSetupError("--engine-url must name every engine of the plan once: "
                                 + "; ".join(x for x in (f"unknown: {', '.join(unknown)}" if unknown else "",
                                                         f"missing: {', '.join(missing)}" if missing else "") if x)
                                 + f" (the plan's engines: {', '.join(sorted(names))})")
        engines = {e.name: (e, urls[e.name], connector if e.kv_role else None) for e in plan.layout.engines}
        router = router_for(plan.layout.routes, engines, RouterOptions(model_id or plan.model, api_key,
                                                                        max_in_flight=max_in_flight, shares=shares,
                                                                        cooldown_s=cooldown_s))
        sock = listen(host, port)
    except TesseraError as e:
        _fail(e)
    url = url_of(sock)
    run_router(router, sock, HTTPLimits(), shutdown_timeout, say,
               ready=lambda: _err.print(f"routing {plan.model} at {url}/v1 over {len(engines)} engines",
                                        markup=False, highlight=False))


def _engine_urls(items: list[str]) -> dict[str, str]:
    from tessera.engines.vllm import VLLMSetupError

    out = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not url.startswith(("http://", "https://")):
            raise VLLMSetupError(f"--engine-url {item!r}: give NAME=http://HOST:PORT")
        if name in out:
            raise VLLMSetupError(f"--engine-url names {name} twice")
        out[name] = url
    return out


def deploy(
    plan_file: Path = typer.Argument(..., help="The plan file (`tessera plan MODEL --cluster ... -o FILE`)."),
    engine: str = typer.Option("vllm", "--engine", help="The engine that runs the plan's engines: vllm."),
    model_path: str = typer.Option(None, "--model-path", help="The model as vLLM loads it on the GPU hosts (a folder "
                                   "or a Hugging Face id; default: the catalog's id)."),
    python: str = typer.Option("python", "--vllm-python", help="The interpreter of the vLLM environment on the GPU "
                               "hosts."),
    max_model_len: int = typer.Option(4096, "--max-model-len", help="Longest prompt + output per request."),
    connector: str = typer.Option("nixl", "--kv-connector", help="KV connector between prefill and decode engines: "
                                  "nixl (GPU to GPU) | tessera-store | example (a shared folder: hosts without GPU transfer)."),
    kv_store: str = typer.Option("/dev/shm/tessera-kv", "--kv-store", help="The shared folder of the tessera-store and example connectors."),
    first_port: int = typer.Option(8100, "--first-port", help="Engines listen on ports counted up from here (per "
                                   "node)."),
    router_port: int = typer.Option(8000, "--router-port", help="The router's port."),
    eager: bool = typer.Option(False, "--enforce-eager/--no-enforce-eager", help="Skip CUDA graphs and compilation "
                               "(faster start, slower steps)."),
    script: Path = typer.Option(None, "--script", help="Also write the commands as a shell script here."),
) -> None:
    """Print how to run a plan on its GPU cluster: every engine's environment and command line (one vLLM
    server per planned engine, with the plan's knobs and KV-connector roles), then the router's command.
    Start them under your own supervisor; `tessera serve --engine vllm` launches the same description on
    this host's cpu workers."""
    from tessera.capture.models import resolve_model
    from tessera.engines.deployment import gpu_deployment
    from tessera.engines.vllm import VLLMOptions, VLLMSetupError
    from tessera.plan.deployment import DeploymentPlan

    try:
        if engine != "vllm":
            raise VLLMSetupError(f"--engine {engine!r}: `tessera deploy` writes vLLM deployments (--engine vllm); "
                                 "Tessera's own runtime is started with `tessera serve` / torchrun (see docs)")
        plan = DeploymentPlan.load(plan_file)
        spec = resolve_model(plan.model)
        options = VLLMOptions(python, model_path or (spec.source if not spec.local else str(spec.config_dir)),
                              plan.model, max_model_len, enforce_eager=eager, connector=connector, kv_store=kv_store)
        options.check()
        d = gpu_deployment(plan, options, first_port)
    except TesseraError as e:
        _fail(e)
    lines = [f"# Tessera deployment of {plan.model}: {plan.policy} plan for {plan.cluster}",
             *([f"# {plan.reason}"] if plan.reason else []),
             f"# predicted {plan.throughput:,.0f} {plan.unit}; {len(d.launches)} vLLM engines, "
             f"KV connector {connector}; node names ({', '.join(sorted({ln.placement.node for ln in d.launches}))}) "
             "stand for the hosts' addresses", ""]
    for ln in d.launches:
        e = ln.engine
        lines.append(f"# engine {e.name} ({' + '.join(e.roles)}) on {ln.placement.node}: {', '.join(e.devices)}"
                     + (f"; {'; '.join(ln.notes)}" if ln.notes else ""))
        lines.append(ln.shell() + " &")
        lines.append("")
    urls = " ".join(f"--engine-url {shlex.quote(ln.engine.name + '=' + _node_url(ln))}" for ln in d.launches)
    lines.append("# the router (the only endpoint clients use), on the node of your choice")
    lines.append(f"tessera route {shlex.quote(str(plan_file))} {urls} --kv-connector {connector} "
                 f"--host 0.0.0.0 --port {router_port}")
    for r in d.routes:
        lines.append(f"#   route {r.name}: {r.share:.0%} of requests via {' -> '.join(r.hops)}")
    text = "\n".join(lines) + "\n"
    if script is not None:
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + text)
        script.chmod(0o755)
        _err.print(f"written to {script}", highlight=False)
    _out.print(text, markup=False, highlight=False, soft_wrap=True, end="")


def _node_url(launch) -> str:
    """The engine's URL as the router reaches it: its node's host name, the engine's port."""
    return f"http://{launch.placement.node}:{launch.port}"


def _sizes(text: str, option: str) -> tuple[int, ...]:
    """A comma-separated list of positive sizes ("1,16,64")."""
    from tessera.serve.step_probe import StepProbeError

    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise StepProbeError(f"{option} {text!r}: give positive whole numbers separated by commas, e.g. 1,16,64") \
            from None
    if not sizes or min(sizes) < 1:
        raise StepProbeError(f"{option} {text!r}: give positive whole numbers separated by commas, e.g. 1,16,64")
    return sizes


def profile_engine(
    model: str = typer.Argument(..., help="The model the engine serves (its served name)."),
    output: Path = typer.Option(..., "--output", "-o", help="Write the step-times JSON here (for `tessera simulate "
                                "--engine vllm --step-times`)."),
    url: str = typer.Option(None, "--url", help="Measure the vLLM OpenAI server running at this URL (any device); "
                            "default: start one vLLM engine on this host's cores, measure it and stop it."),
    threads: int = typer.Option(None, "--threads", help="Cores of the engine started here (default: all)."),
    max_num_seqs: int = typer.Option(128, "--max-num-seqs", help="The engine's sequence cap (the started engine's; "
                                     "with --url, what the running engine was given)."),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", help="The engine's token budget per "
                                               "step (vLLM's default on a CPU: 2048)."),
    max_model_len: int = typer.Option(2048, "--max-model-len", help="Longest context of the started engine."),
    prompts: str = typer.Option(",".join(map(str, DEFAULT_PROMPTS)), "--prompts", help="Prompt lengths of "
                                "the prefill probes."),
    rows: str = typer.Option(",".join(map(str, DEFAULT_ROWS)), "--rows", help="Decode rows of the decode "
                             "probes."),
    contexts: str = typer.Option(",".join(map(str, DEFAULT_CONTEXTS)), "--contexts", help="Prompt lengths "
                                 "of the decode probes."),
    repeats: int = typer.Option(3, "--repeats", help="Lone prompts per length (the median is kept)."),
    device: str = typer.Option(None, "--device", help="What the engine runs on, recorded in the file (default: "
                               "this host's cpu and threads, or 'unknown' with --url)."),
    python: str = typer.Option(None, "--vllm-python", help="The vLLM environment's interpreter (default: "
                               ".venv-vllm/bin/python or TESSERA_VLLM_PYTHON)."),
    api_key: str = typer.Option(None, "--api-key", envvar="TESSERA_API_KEY", help="Bearer key of the engine at --url."),
) -> None:
    """Measure a vLLM engine's step times (prefills by prompt length, decodes by rows and context) over its
    OpenAI API, for `tessera simulate --engine vllm --step-times`."""
    import tempfile

    from tessera.cli.outputs import check_output_file, write_output
    from tessera.engines.deployment import cpu_engine
    from tessera.engines.process import Supervisor
    from tessera.engines.vllm import VLLMOptions, check_python, default_python
    from tessera.router.launch import free_ports, model_folder
    from tessera.serve.step_probe import StepProbeError, measure

    def say(line: str) -> None:
        _err.print(f"[dim]{line}[/]", highlight=False)

    supervisor = None
    try:
        check_output_file(output, "--output", "steps.json")
        sizes = {"prompts": _sizes(prompts, "--prompts"), "rows": _sizes(rows, "--rows"),
                 "contexts": _sizes(contexts, "--contexts")}
        if repeats < 1:
            raise StepProbeError(f"--repeats must be at least 1 (got {repeats})")
        if url is None:
            python = python or default_python()
            check_python(python)
            options = VLLMOptions(python, model_folder(model), model, max_model_len, prefix_caching=False)
            launch = cpu_engine(options, free_ports(1)[0], max_num_seqs, threads)
            supervisor = Supervisor([launch], Path(tempfile.mkdtemp(prefix="tessera-profile-")), say=say,
                                    restart=False)
            supervisor.start()
            url = launch.url
            device = device or f"cpu ({len(launch.placement.cores)} threads)"
        times = measure(url.rstrip("/"), model, **sizes, max_num_batched_tokens=max_num_batched_tokens,
                        max_num_seqs=max_num_seqs, repeats=repeats, device=device or "unknown", api_key=api_key,
                        progress=say)
        write_output(output, "--output", times.save, "steps.json")
    except TesseraError as e:
        _fail(e)
    finally:
        if supervisor is not None:
            supervisor.stop()
    from rich.table import Table

    table = Table(title=f"{times.model} on {times.device}: step times ({times.engine})")
    for col in ("step", "size", "seconds"):
        table.add_column(col, justify="left" if col == "step" else "right")
    for n, sec in times.prefill:
        table.add_row("prefill", f"{n} tokens", f"{sec:.4f}")
    for r, c, sec in times.decode:
        table.add_row("decode", f"{r} rows at context {c}", f"{sec:.4f}")
    _out.print(table)
    _out.print(f"request overhead {times.overhead_s * 1e3:.1f} ms; KV blocks {times.kv_blocks} of {times.block_size} "
               f"tokens; written to {output}", highlight=False)


def register(app: typer.Typer) -> None:
    """Mount `tessera route`, `tessera deploy` and `tessera profile-engine`."""
    app.command("route")(route)
    app.command("deploy")(deploy)
    app.command("profile-engine")(profile_engine)
