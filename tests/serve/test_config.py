"""Served deployments: every bad option of a ServeConfig is refused with its message before anything starts."""

from __future__ import annotations

import re

import pytest

from tessera.plan.config import PolicyError
from tessera.serve.config import ServeConfig, ServeOptionError


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"cluster": "A100:1"}, ServeOptionError, "tessera serve starts local cpu workers (--cluster cpu:N)"),
        ({"slots": 0}, ServeOptionError, "--slots must be at least 1 (got 0)"),
        ({"transfer_timeout_s": 0}, ServeOptionError, "--transfer-timeout must be positive (got 0)"),
        ({"max_context": 1}, ServeOptionError, "--max-context must be at least 2 (got 1)"),
        ({"threads": 0}, ServeOptionError, "--threads must be at least 1 (got 0)"),
        ({"placement": "spread"}, ServeOptionError, "--placement must be one of alternate, random (got 'spread')"),
        ({"beta": 0.0}, ServeOptionError, "--beta must be positive (got 0.0)"),
        ({"window_s": 0.0}, ServeOptionError, "--window-ms must be positive (got 0)"),
        ({"cooldown_s": -1.0}, ServeOptionError, "--cooldown-s must be 0 or more (got -1.0)"),
        ({"policy": "best"}, PolicyError, "unknown policy 'best'"),
        ({"latency_policy": "best"}, PolicyError, "unknown policy 'best'"),
        ({"local": True, "placement": "random"}, ServeOptionError, "--local runs every step in this process"),
    ],
)
def test_bad_options(change, error, message):
    with pytest.raises(error, match=re.escape(message)):
        ServeConfig("smollm2-135m", **change).check()


def test_the_defaults_pass():
    ServeConfig("smollm2-135m").check()
