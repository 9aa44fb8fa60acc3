"""The fused attention ops read and write what they declare."""

from __future__ import annotations

import pytest
import torch

import tessera.kernels  # noqa: F401
from tests.kernels.access_truth import assert_accesses_true


@pytest.mark.parametrize("window", [0, 3])
def test_decode_attention_reads_and_writes_what_it_declares(window):
    b, h, kvh, ctx, d = 2, 4, 2, 8, 16
    q = torch.randn(b, h, 1, d)
    kc, vc = torch.randn(3, kvh, ctx, d), torch.randn(3, kvh, ctx, d)
    args = (q, kc, vc, torch.tensor([2, 0]), torch.tensor([5, 1]), d ** -0.5, window, None)
    assert_accesses_true(torch.ops.tessera.decode_attention, args)


def test_prefill_attention_reads_and_writes_what_it_declares():
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    assert_accesses_true(torch.ops.tessera.prefill_attention, (q, k, v, 0.25, 0, torch.randn(4)))
