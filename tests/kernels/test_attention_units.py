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


def _decode_reference(q, kc, vc, slots, positions, scale, window):
    """Decode attention written out in fp32: each query head against its KV head's rows 0..position."""
    group = q.shape[1] // kc.shape[1]
    k = kc[slots].float().repeat_interleave(group, 1)
    v = vc[slots].float().repeat_interleave(group, 1)
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    j = torch.arange(kc.shape[2])
    allowed = j[None, :] <= positions[:, None]
    if window > 0:
        allowed &= j[None, :] > positions[:, None] - window
    probs = scores.masked_fill(~allowed[:, None, None, :], float("-inf")).softmax(-1)
    return (probs @ v).transpose(1, 2)


@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(9, 3, 0), (9, 3, 5), (8, 1, 0), (4, 4, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_attention_written_out(heads, kv_heads, window, dtype):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads + window)
    rows, ctx, d = 5, 24, 16
    q = torch.randn(rows, heads, 1, d, generator=g).to(dtype)
    kc = torch.randn(7, kv_heads, ctx, d, generator=g).to(dtype)
    vc = torch.randn(7, kv_heads, ctx, d, generator=g).to(dtype)
    slots, positions = torch.tensor([6, 0, 3, 2, 5]), torch.tensor([0, 17, 9, 4, 12])
    got = torch.ops.tessera.decode_attention(q, kc, vc, slots, positions, d ** -0.5, window, None)
    want = _decode_reference(q, kc, vc, slots, positions, d ** -0.5, window)
    assert got.shape == (rows, 1, heads, d) and got.dtype == dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
