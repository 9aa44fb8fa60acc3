"""Replay's faster equivalents of traced aten ops give the traced op's result bit for bit."""

from __future__ import annotations

import torch

from tessera.kernels.replay import broadcast_bmm, replay_op


def test_a_broadcast_bmm_gives_bmm_s_bits_in_every_dtype_and_any_other_bmm_is_bmm():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = torch.randn(300, 64, dtype=dtype)  # a linear layer's weight [N, K]
        for rows, seq in ((1, 1), (3, 1), (8, 1), (4, 5)):
            hidden = torch.randn(rows, 7, 64, dtype=dtype)
            a = hidden[:, -seq:]  # a slice of the positions: not contiguous when rows > 1
            b = w.t().unsqueeze(0).expand(rows, 64, 300)  # the weight broadcast over the batch (stride 0)
            got = broadcast_bmm(a, b)
            assert got.shape == (rows, seq, 300) and torch.equal(got, torch.ops.aten.bmm.default(a, b)), (dtype, rows)
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)  # a real batch of matrices
    assert torch.equal(broadcast_bmm(a, b), torch.bmm(a, b))
    assert replay_op("aten.bmm.default") is broadcast_bmm and replay_op("aten.mm.default") is None
