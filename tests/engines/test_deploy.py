"""`tessera deploy`: every engine's command for a GPU cluster is a vLLM command line that vLLM's own argument
parser accepts, with the plan's knobs and consistent KV-connector roles; and the same engines launched on cpu
workers carry their cpu stand-ins' settings."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessera.cli.main import app
from tessera.engines.deployment import cpu_deployment, gpu_deployment
from tessera.engines.vllm import SERVER_MODULE, VLLMOptions, VLLMSetupError, vllm_launch
from tessera.plan.deployment import DeploymentPlan, PlannedEngine

ROOT = Path(__file__).resolve().parents[2]
LLAMA_PLAN = ROOT / "tests" / "fixtures" / "plans" / "llama-3.1-8b_A100_L40S.json"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

# Parses each command line with vLLM's own server parser (the one `python -m vllm.entrypoints.openai.api_server`
# builds), validates it as vLLM does before serving, and reports what vLLM understood.
PARSE = r"""
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for argv in json.load(sys.stdin):
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    kv = args.kv_transfer_config
    out.append({"max_num_seqs": args.max_num_seqs, "gpu_memory_utilization": args.gpu_memory_utilization,
                "max_model_len": args.max_model_len, "port": args.port, "block_size": args.block_size,
                "kv_connector": kv.kv_connector if kv else None, "kv_role": kv.kv_role if kv else None,
                "is_producer": kv.is_kv_producer if kv else None, "is_consumer": kv.is_kv_consumer if kv else None})
print(json.dumps(out))
"""


def _engine_lines(text: str) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, argv after the server module) of each engine line of `tessera deploy`'s output."""
    out = []
    for line in text.splitlines():
        if SERVER_MODULE not in line:
            continue
        words = shlex.split(line.rstrip(" &"))
        env = {}
        while "=" in words[0] and not words[0].startswith("-"):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        out.append((env, words[words.index(SERVER_MODULE) + 1:]))
    return out


def test_deploy_prints_engine_commands_that_vllms_own_parser_accepts_with_consistent_roles(tmp_path):
    result = CliRunner().invoke(app, ["deploy", str(LLAMA_PLAN), "--script", str(tmp_path / "deploy.sh")],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    engines = _engine_lines(result.stdout)
    plan = DeploymentPlan.load(LLAMA_PLAN)
    assert len(engines) == len(plan.layout.engines) == 3
    assert (tmp_path / "deploy.sh").read_text().count(SERVER_MODULE) == 3
    router = next(line for line in result.stdout.splitlines() if line.startswith("tessera route"))
    for e in plan.layout.engines:  # the router is told where every engine listens
        assert f"--engine-url {e.name}=http://" in router
    if not VLLM_PYTHON.exists():
        pytest.skip("no vLLM environment to parse the commands with: `make vllm-env` creates it")
    parsed = json.loads(subprocess.run([str(VLLM_PYTHON), "-c", PARSE], input=json.dumps([a for _, a in engines]),
                                       capture_output=True, text=True, check=True, timeout=300).stdout)
    by_name = dict(zip((e.name for e in plan.layout.engines), zip(parsed, engines, strict=True), strict=True))
    for e in plan.layout.engines:
        vllm, (env, _) = by_name[e.name]
        assert vllm["max_num_seqs"] == e.max_num_seqs and vllm["block_size"] == e.block_size
        assert vllm["gpu_memory_utilization"] == pytest.approx(e.memory_fraction, abs=1e-4)
        assert env["CUDA_VISIBLE_DEVICES"] == "0"  # each of this cluster's nodes has one GPU
    whole, prefill, decode = (by_name[n][0] for n in ("whole@L40S", "prefill@L40S", "decode@A100"))
    assert whole["kv_connector"] is None
    assert prefill["kv_connector"] == decode["kv_connector"] == "NixlConnector"
    assert prefill["is_producer"] and decode["is_consumer"]
    # two engines on the L40S's node split its memory and need distinct ports and NIXL side channels
    l40s = [by_name[n][1][0] for n in ("whole@L40S", "prefill@L40S")]
    assert whole["port"] != prefill["port"] and sum(by_name[n][0]["gpu_memory_utilization"]
                                                    for n in ("whole@L40S", "prefill@L40S")) <= 0.9 + 1e-6
    assert l40s[1]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "node1"


def _engine(roles=("whole",), targets=("A100",)) -> PlannedEngine:
    return PlannedEngine(f"{'/'.join(roles)}@{'+'.join(targets)}", roles, targets, ("A100:0",), ("node0",), 64,
                         10000, 16, 0.9)


def test_cpu_engines_bind_their_workers_cores_and_use_the_example_connector_roles():
    options = VLLMOptions("/py", "/model", "m", 512, kv_store="/dev/shm/kv", connector="example")
    from tessera.engines.vllm import Placement

    prefill = vllm_launch(_engine(("prefill",), ("L40S",)), Placement("cpu:1", cores=(1,)), 9001, options)
    decode = vllm_launch(_engine(("decode", "whole")), Placement("cpu:0", cores=(0,)), 9002, options)
    whole = vllm_launch(_engine(), Placement("cpu:0", cores=(0, 1)), 9003, options)
    assert prefill.env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and whole.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    config = json.loads(prefill.argv[prefill.argv.index("--kv-transfer-config") + 1])
    assert config == {"kv_connector": "ExampleConnector", "kv_role": "kv_producer",
                      "kv_connector_extra_config": {"shared_storage_path": "/dev/shm/kv"}}
    assert json.loads(decode.argv[decode.argv.index("--kv-transfer-config") + 1])["kv_role"] == "kv_consumer"
    assert "--kv-transfer-config" not in whole.argv and "CUDA_VISIBLE_DEVICES" not in whole.env
    # a cpu stand-in gets a KV cache of its own size and vLLM's CPU block granule, not the GPU's share
    assert whole.argv[whole.argv.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)
    assert whole.argv[whole.argv.index("--block-size") + 1] == "32" and "--gpu-memory-utilization" not in whole.argv
    # Tessera's connector is the example connector's protocol, loaded by vLLM from Tessera's plugin folder
    ours = vllm_launch(_engine(("prefill",), ("L40S",)), Placement("cpu:1", cores=(1,)), 9001,
                       VLLMOptions("/py", "/model", "m", 512, kv_store="/dev/shm/kv"))
    config = json.loads(ours.argv[ours.argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "TesseraStoreConnector" and config["kv_role"] == "kv_producer"
    assert (Path(ours.env["PYTHONPATH"]) / f"{config['kv_connector_module_path']}.py").is_file()
    with pytest.raises(VLLMSetupError, match="splits kernels .* --engine tessera"):
        vllm_launch(_engine(("split",), ("A100", "L40S")), Placement("cpu:0", cores=(0,)), 9004, options)


def test_the_plans_targets_map_onto_cpu_workers_in_order():
    plan = DeploymentPlan.load(LLAMA_PLAN)
    d = cpu_deployment(plan, 2, VLLMOptions("/py", "/m", "llama", kv_store="/tmp/kv"), [9101, 9102, 9103], cores=2)
    where = {ln.engine.name: (ln.placement.node, ln.placement.cores) for ln in d.launches}
    assert where == {"whole@L40S": ("cpu:1", (1,)), "prefill@L40S": ("cpu:1", (1,)), "decode@A100": ("cpu:0", (0,))}
    with pytest.raises(Exception, match="cpu:2"):  # three targets? no: two, on three workers
        cpu_deployment(plan, 3, VLLMOptions("/py", "/m", "llama", kv_store="/tmp/kv"), [1, 2, 3], cores=3)
    gpu = gpu_deployment(plan, VLLMOptions("python", "/m", "llama", connector="nixl"))
    assert {ln.engine.name: ln.placement.gpus for ln in gpu.launches} == {
        "whole@L40S": (0,), "prefill@L40S": (0,), "decode@A100": (0,)}
    assert gpu.host_cores == () and all(ln.host_cores == () for ln in gpu.launches)


def test_cores_no_engine_computes_on_host_the_router_and_the_engines_schedulers():
    plan = DeploymentPlan.load(LLAMA_PLAN)
    options = VLLMOptions("/py", "/m", "llama", kv_store="/tmp/kv")
    # two workers of 4 cores each, 1 thread each: compute on cores 0 and 4, the rest hosts the others
    d = cpu_deployment(plan, 2, options, [9101, 9102, 9103], cores=8, threads=1)
    assert {ln.engine.name: ln.placement.cores for ln in d.launches} == {
        "whole@L40S": (4,), "prefill@L40S": (4,), "decode@A100": (0,)}
    assert d.host_cores == (1, 2, 3, 5, 6, 7) and all(ln.host_cores == d.host_cores for ln in d.launches)
    # every core computes: nothing is pinned
    full = cpu_deployment(plan, 2, options, [9101, 9102, 9103], cores=2)
    assert full.host_cores == () and all(ln.host_cores == () for ln in full.launches)
