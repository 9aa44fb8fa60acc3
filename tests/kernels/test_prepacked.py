"""GEMMs on packed weights (`tessera.kernels.prepacked`) give PyTorch's CPU linear, bit for bit, in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.kernels.prepacked import PackedWeights, packable

pytestmark = pytest.mark.skipif(not packable(torch.bfloat16, torch.device("cpu")),
                                reason="this CPU's oneDNN has no bf16 GEMM")


@pytest.mark.parametrize("rows", [1, 3, 16, 33, 512])
def test_a_packed_gemm_equals_linear_and_a_merged_one_the_concatenation(rows):
    g = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(n, 576, generator=g).bfloat16() for n in (576, 192, 192))
    x = torch.randn(rows, 576, generator=g).bfloat16()
    packed = PackedWeights()
    assert torch.equal(packed.gemm(("q",), [q])(x, q.t()), torch.mm(x, q.t()))
    assert torch.equal(packed.gemm(("q",), [q])(x), F.linear(x, q))
    merged = packed.gemm(("q", "k", "v"), [q, k, v])(x[:, None])  # [rows, 1, K] as a decode step has it
    assert merged.shape == (rows, 1, 960)
    assert torch.equal(merged, torch.cat([F.linear(x[:, None], w) for w in (q, k, v)], -1))
    assert len(packed) == 2 and packed.nbytes == (576 + 960) * 576 * 2  # one copy per set of weights


def test_only_bf16_on_a_cpu_is_packed():
    assert packable(torch.bfloat16, torch.device("cpu"))
    assert not packable(torch.float32, torch.device("cpu"))  # MKL's fp32 GEMM: other bits than oneDNN's
    assert not packable(torch.bfloat16, torch.device("meta"))
