"""Shared fixtures: tiny models of each family built on the CPU and on `meta`."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels run on the CPU through Triton's interpreter, which must be chosen before triton is imported.
os.environ["TRITON_INTERPRET"] = "1"
# Rich sizes tables to the terminal; CI terminals vary, so the CLI tests see one known width.
os.environ["COLUMNS"] = "160"
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm2_path():
    from tessera.capture.smollm2 import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def pool():
    """Three runtime worker processes (1 thread each), shared by every runtime test that kills none of them."""
    from tessera.runtime.pool import WorkerPool

    with WorkerPool.local(3, threads=1) as workers:
        yield workers
