"""`tessera simulate --engine vllm` and `tessera profile-engine` from the command line: a measured step-times
file drives the simulation; bad options are refused before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessera.cli.main import app
from tessera.cost.engine_steps import EngineStepTimes

ROOT = Path(__file__).resolve().parents[2]
MIX = ROOT / "tests" / "fixtures" / "plans" / "smollm2-135m_A100_L40S_mix.json"
ARGS = ["simulate", "smollm2-135m", "--cluster", "A100:1,L40S:1", "--plan", str(MIX), "--workload",
        "fixed:in=64,out=32,requests=32"]


def _run(*args: str):
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "400"})
    return result.exit_code, result.stdout, " ".join(result.output.split())


@pytest.fixture
def steps(tmp_path) -> Path:
    path = tmp_path / "steps.json"
    EngineStepTimes("vllm 0.32.0", "smollm2-135m", "cpu (2 threads)", ((16, 0.03), (256, 0.2), (1024, 0.8)),
                    ((1, 64, 0.02), (32, 64, 0.08)), overhead_s=0.004, block_size=32, kv_blocks=1456).save(path)
    return path


def test_simulate_on_measured_vllm_step_times(steps):
    code, stdout, _ = _run(*ARGS, "--engine", "vllm", "--step-times", str(steps), "--json")
    assert code == 0, stdout
    s = json.loads(stdout)
    assert s["engine"] == "vllm" and s["completed"] == 32 and s["step_times"] == str(steps)
    assert s["ttft_p50_s"] > 0.2  # 32 prompts of 64 tokens queue behind each other's prefill chunks
    code, _, text = _run(*ARGS, "--engine", "vllm", "--step-times", str(steps))
    assert code == 0 and "tessera on vLLM engines" in text and "busy: decode@A100" in text


@pytest.mark.parametrize(("extra", "message"), [
    (["--engine", "sglang"], "--engine must be tessera or vllm (got 'sglang')"),
    (["--step-times", "STEPS"], "--step-times is an option of the vLLM simulator: give it with --engine vllm"),
    (["--shares", "latency"], "--shares is an option of the vLLM simulator"),
    (["--engine", "vllm", "--shares", "fastest"], "--shares must be one of auto, throughput, latency"),
    (["--engine", "vllm", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be at least 1"),
    (["--engine", "vllm", "--step-times", "/nonexistent/steps.json"], "/nonexistent/steps.json"),
])
def test_simulate_refuses_bad_engine_options(steps, extra, message):
    code, _, text = _run(*ARGS, *[str(steps) if a == "STEPS" else a for a in extra])
    assert code != 0 and message in text


@pytest.mark.parametrize(("extra", "message"), [
    (["--prompts", "1,x"], "--prompts '1,x': give positive whole numbers separated by commas"),
    (["--rows", "0"], "--rows '0': give positive whole numbers"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--url", "http://127.0.0.1:9"], "cannot reach an engine at http://127.0.0.1:9"),
    (["--vllm-python", "/nonexistent/python"], "no vLLM environment at /nonexistent/python"),
])
def test_profile_engine_refuses_bad_input(tmp_path, extra, message):
    code, _, text = _run("profile-engine", "smollm2-135m", "-o", str(tmp_path / "s.json"), *extra)
    assert code != 0 and message in text
    assert not (tmp_path / "s.json").exists()


def test_plan_on_vllm_reports_the_simulated_engines():
    code, stdout, _ = _run("plan", "smollm2-135m", "--cluster", "A100:1,L40S:1", "--policy", "homogeneous",
                           "--device", "A100", "--max-num-seqs", "1", "--workload", "poisson:rate=2,lengths=azure-conv,"
                           "requests=8", "--engine", "vllm", "--json")
    assert code == 0, stdout
    (row,) = json.loads(stdout)
    assert row["vllm"]["completed"] == 8 and row["vllm"]["throughput"] > 0
    assert row["vllm"]["ttft_p50_s"] > 0 and row["vllm"]["tpot_p50_s"] > 0
    code, _, text = _run("plan", "smollm2-135m", "--cluster", "A100:1,L40S:1", "--engine", "sglang")
    assert code != 0 and "--engine must be tessera or vllm (got 'sglang')" in text
