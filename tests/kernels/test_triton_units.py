"""The Triton-backed ops (run by Triton's interpreter on the CPU) read and write what they declare."""

from __future__ import annotations

import torch

import tessera.triton_kernels  # noqa: F401  (registers tessera::triton_rms_norm)
from tests.kernels.access_truth import assert_accesses_true


def test_triton_rms_norm_accesses():
    x, w = torch.randn(4, 32), torch.randn(32)
    assert_accesses_true(torch.ops.tessera.triton_rms_norm, (x, w, 1e-6))
