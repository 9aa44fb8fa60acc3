"""`tessera run`: text on stdout (identical to a single-process run), plan files checked, clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tessera.cli.main import app

PROMPT = "The capital of France is"
ENTRY = "from tessera.cli.main import main; main()"


def _tessera(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ENTRY, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def prompt_tokens(smollm2_path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(smollm2_path))(PROMPT).input_ids)


def test_run_prints_only_the_text_and_matches_single_process():
    result = _tessera("run", "smollm2-135m", "--cluster", "cpu:2", "--prompt", PROMPT, "--max-tokens", "4",
                      "--placement", "alternate", "--check")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(" Paris") and result.stdout.endswith("\n")
    assert not any(word in result.stdout for word in ("tracing", "placement", "workers", "tokens", "check"))
    assert "check: the 4 tokens are identical to a single-process eager run" in result.stderr
    assert "placement: alternate placement" in result.stderr and "transfers" in result.stderr


def _run(*args: str):
    """`tessera run` in this process (its workers are still processes): the same command as `_tessera` without
    a second interpreter's start-up; `test_run_prints_only_the_text_and_matches_single_process` and
    `test_torchrun_rank_zero_drives_and_the_others_work` run it as a real subprocess."""
    return CliRunner().invoke(app, ["run", "smollm2-135m", *args])


def test_hostile_sampling_values_generate_like_greedy():
    """The probe of issue 20: a nucleus of 1e-300 keeps only the top token, so the text is the greedy one."""
    result = _run("--cluster", "cpu:2", "--prompt", PROMPT, "--max-tokens", "4", "--placement", "alternate",
                  "--temperature", "1", "--top-p", "1e-300", "--check")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(" Paris")
    assert "check: the 4 tokens are identical" in result.stderr


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory, prompt_tokens):
    """A layer-pipeline plan for cpu:2 at the run's shapes (prompt, 4 new tokens, cache 64)."""
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    result = CliRunner().invoke(app, ["plan", "smollm2-135m", "--cluster", "cpu:2", "--workload",
                                      f"fixed:in={prompt_tokens},out=4,requests=1", "--max-batch", "1", "--ctx",
                                      "64", "--policy", "layer-pipeline", "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path


def test_run_follows_a_plan_file(plan_file):
    result = _run("--cluster", "cpu:2", "--prompt", PROMPT, "--max-tokens", "4", "--plan", str(plan_file), "--check")
    assert result.exit_code == 0, result.output
    assert "layer-pipeline plan from" in result.stderr
    assert result.stdout.startswith(" Paris")


def test_run_follows_a_route_mix_along_the_route_its_shares_send_a_first_request_to():
    """The mix of the fixtures (written by `tessera plan` at its serving workload, for A100 + L40S): the one
    request takes the prefill-decode route (64% of requests), prefilled on the L40S's stand-in worker and
    decoded on the A100's, and its tokens equal one process's."""
    from pathlib import Path

    mix = Path(__file__).resolve().parents[1] / "fixtures" / "plans" / "smollm2-135m_A100_L40S_mix.json"
    result = _run("--cluster", "cpu:2", "--prompt", PROMPT, "--max-tokens", "4", "--plan", str(mix), "--check")
    assert result.exit_code == 0, result.output
    err = " ".join(result.stderr.split())
    assert "route mix, the one request takes route prefill-decode (64% of requests" in err, err
    assert "not run: homogeneous (L40S) 36%" in err and "A100 -> cpu:0, L40S -> cpu:1" in err
    assert "prefill: 304 kernels (304 on cpu:1)" in err and "decode: 304 kernels (304 on cpu:0)" in err
    assert result.stdout.startswith(" Paris")
    assert "check: the 4 tokens are identical" in result.stderr


def _run_error(*args: str) -> str:
    result = CliRunner().invoke(app, ["run", "smollm2-135m", *args])
    assert result.exit_code == 2, result.output
    return " ".join(result.output.split())


def test_plan_for_another_graph_is_refused(plan_file):
    out = _run_error("--cluster", "cpu:2", "--prompt", PROMPT + " a city", "--max-tokens", "4", "--plan", str(plan_file))
    assert "prefill step was made for graph" in out and "plan again for it" in out


def test_cluster_smaller_than_the_plan_is_refused(plan_file):
    out = _run_error("--cluster", "cpu:1", "--prompt", PROMPT, "--max-tokens", "4", "--plan", str(plan_file))
    assert "places kernels on 2 devices" in out and "the cluster has 1 workers" in out


def test_unavailable_backend_and_bad_options_are_clear_errors():
    assert "backend nccl needs CUDA GPUs" in _run_error("--prompt", "hi", "--placement", "alternate", "--backend",
                                                        "nccl")
    assert "unknown backend 'mpi'" in _run_error("--prompt", "hi", "--placement", "alternate", "--backend", "mpi")
    assert "at most one of --plan, --policy and --placement" in _run_error("--prompt", "hi", "--policy", "tessera",
                                                                          "--placement", "random")
    assert "--placement must be one of alternate, random" in _run_error("--prompt", "hi", "--placement", "zigzag")
    assert "--max-tokens must be at least 1" in _run_error("--prompt", "hi", "--max-tokens", "0")
    assert "--top-p must be in (0, 1]" in _run_error("--prompt", "hi", "--top-p", "0")
    assert "has GPUs, which are planned and simulated" in _run_error("--prompt", "hi", "--cluster", "A100:1")
    out = _run_error("--prompt", "hi", "--plan", "/nonexistent/plan.json")
    assert "/nonexistent/plan.json" in out


def test_models_without_weights_or_text_are_refused():
    result = CliRunner().invoke(app, ["run", "llama-3.1-8b", "--prompt", "hi"])
    assert result.exit_code == 2 and "has no weights here" in " ".join(result.output.split())


def test_torchrun_rank_zero_drives_and_the_others_work():
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    result = subprocess.run([*torchrun, "-m", "tessera", "run", "smollm2-135m", "--cluster", "cpu:2", "--prompt",
                             PROMPT, "--max-tokens", "3", "--placement", "random", "--threads", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(" Paris")
    assert "3 tokens in" in result.stderr and "on 2 workers" in result.stderr
