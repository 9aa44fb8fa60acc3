"""Every policy `tessera plan` solves for smollm2-135m on cpu:2 runs under `tessera run --policy P`, its
tokens identical to a single-process eager run (`--check`), through the CLI."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from tessera.cli.main import app
from tessera.plan.config import POLICIES

PROMPT = "The capital of France is"
SPLITS = ("prefill-decode", "attention-ffn", "layer-pipeline")  # their plans put kernels on both workers


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_runs_and_matches_one_process(policy):
    result = CliRunner().invoke(app, ["run", "smollm2-135m", "--cluster", "cpu:2", "--policy", policy, "--prompt",
                                      PROMPT, "--max-tokens", "2", "--check"])
    assert result.exit_code == 0, result.output
    assert result.stdout == " Paris.\n"
    assert "check: the 2 tokens are identical to a single-process eager run" in result.stderr
    assert f"placement: {policy} plan" in result.stderr
    kernels = re.search(r"^prefill: \d+ kernels .*$", result.stderr, re.M)  # kernels per worker, both phases
    assert kernels is not None, result.stderr
    if policy in SPLITS:
        assert " on cpu:0" in kernels.group(0) and " on cpu:1" in kernels.group(0), kernels.group(0)
    if policy == "attention-ffn":  # a real attention/FFN split at the runtime's one micro-batch
        assert re.search(r"attention on cpu:\d, FFN on cpu:\d", result.stderr)
    if policy == "request-dist":  # one request: one replica serves it, the other has no rows
        assert "100% of requests" in result.stderr and "idle (no rows of a batch of 1)" in result.stderr
