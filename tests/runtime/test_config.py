"""Generation runs: every bad option of a RunConfig is refused with its message before anything starts."""

from __future__ import annotations

import re

import pytest

from tessera.runtime.config import RunConfig, RunSetupError
from tessera.runtime.pool import RuntimeSetupError


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"plan_file": "p.json", "policy": "tessera"}, RunSetupError, "give at most one of --plan, --policy and --placement"),
        ({"max_tokens": 0}, RunSetupError, "--max-tokens must be at least 1 (got 0)"),
        ({"on_failure": "retry"}, RunSetupError, "--on-failure must be fail or replan (got 'retry')"),
        ({"threads": 0}, RunSetupError, "--threads must be at least 1 (got 0)"),
        ({"cluster": "A100:1,L40S:1"}, RunSetupError, "tessera run starts local cpu workers (--cluster cpu:N)"),
        ({"backend": "nccl"}, RuntimeSetupError, "nccl"),
    ],
)
def test_bad_options(change, error, message):
    with pytest.raises(error, match=re.escape(message)):
        RunConfig("smollm2-135m", **change).check()


def test_a_good_config_gives_its_cluster():
    cluster = RunConfig("smollm2-135m", cluster="cpu:3").check()
    assert [d.spec.id for d in cluster.devices] == ["cpu"] * 3
