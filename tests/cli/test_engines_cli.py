"""`tessera serve --engine vllm`, `tessera route` and `tessera deploy` refuse bad input with a clear message
before starting anything (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessera.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
LLAMA_PLAN = ROOT / "tests" / "fixtures" / "plans" / "llama-3.1-8b_A100_L40S.json"


def _run(*args: str):
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "400"})
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize(("args", "message"), [
    (["serve", "smollm2-135m", "--engine", "sglang"], "--engine must be tessera or vllm (got 'sglang')"),
    (["serve", "smollm2-135m", "--plan", str(LLAMA_PLAN)], "is a plan for llama-3.1-8b, not for smollm2-135m"),
    (["serve", "smollm2-135m", "--plan", str(LLAMA_PLAN), "--policy", "tessera"],
     "--plan is a plan already made; --policy plans one now: give one of them"),
    (["serve", "smollm2-135m", "--placement-for", "A100:1,L40S:1"], "--placement-for is an option of --engine vllm"),
    (["serve", "smollm2-135m", "--engine", "vllm", "--plan", str(LLAMA_PLAN), "--placement-for", "A100:1"],
     "give one"),
    (["serve", "smollm2-135m", "--engine", "vllm", "--policy", "fastest"], "unknown policy 'fastest'"),
    (["serve", "smollm2-135m", "--engine", "vllm", "--threads", "0"], "--threads must be at least 1"),
    (["serve", "smollm2-135m", "--engine", "vllm", "--kv-cache-gib", "0"], "--kv-cache-gib must be positive"),
    (["serve", "smollm2-135m", "--engine", "vllm", "--header-timeout", "0"], "--header-timeout must be a positive"),
    (["serve", "smollm2-135m", "--engine", "vllm", "--port", "0", "--vllm-python", "/nonexistent/python"],
     "no vLLM environment at /nonexistent/python: create it with `make vllm-env`"),
    (["route", str(LLAMA_PLAN), "--engine-url", "whole@L40S=http://h:1"],
     "missing: decode@A100, prefill@L40S (the plan's engines: decode@A100, prefill@L40S, whole@L40S)"),
    (["route", str(LLAMA_PLAN), "--engine-url", "whole@L40S"], "give NAME=http://HOST:PORT"),
    (["route", str(LLAMA_PLAN), "--engine-url", "x=http://h:1", "--kv-connector", "rdma"], "--kv-connector must be"),
    (["serve", "smollm2-135m", "--engine", "vllm", "--shares", "fastest"],
     "--shares must be one of auto, throughput, latency (got 'fastest')"),
    (["serve", "smollm2-135m", "--shares", "latency"], "--shares deals requests among a plan file's routes: give "
                                                        "--plan FILE"),
    (["route", str(LLAMA_PLAN), "--shares", "latency", "--engine-url", "whole@L40S=http://h:1", "--engine-url",
      "prefill@L40S=http://h:2", "--engine-url", "decode@A100=http://h:3"],
     "--shares latency: the plan's routes do not say their latency"),
    (["deploy", str(LLAMA_PLAN), "--engine", "sglang"], "writes vLLM deployments"),
    (["deploy", str(LLAMA_PLAN), "--kv-connector", "rdma"], "--kv-connector must be one of"),
    (["deploy", str(ROOT / "nonexistent.json")], "nonexistent.json"),
])
def test_bad_input_is_refused_with_what_to_do(args, message):
    code, output = _run(*args)
    assert code == 2 and message in output, output


def test_a_gpu_cluster_is_deployed_not_served():
    code, output = _run("serve", "smollm2-135m", "--engine", "vllm", "--cluster", "A100:1,L40S:1", "--port", "0")
    assert code == 2 and "has GPUs" in output and "tessera deploy PLAN --engine vllm" in output
