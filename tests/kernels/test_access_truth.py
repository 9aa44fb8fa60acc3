"""The access-truth checker catches false claims (it is the oracle of every fused unit's access test)."""

from __future__ import annotations

import pytest
import torch

import tessera.kernels  # noqa: F401
from tests.kernels.access_truth import assert_accesses_true


@torch.library.custom_op("tessera_test::writes_undeclared", mutates_args=())
def _writes_undeclared(x: torch.Tensor) -> torch.Tensor:
    # the body writes its input although the schema says it does not
    torch.tensor([], dtype=x.dtype).set_(x.untyped_storage())[0] = 1.0
    return x.clone()


@torch.library.custom_op("tessera_test::reads_undeclared", mutates_args=())
def _reads_undeclared(x: torch.Tensor) -> torch.Tensor:
    whole = torch.tensor([], dtype=x.dtype).set_(x.untyped_storage())
    return x + whole.sum()


@torch.library.custom_op("tessera_test::honest", mutates_args=("out",))
def _honest(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 2)


def test_an_honest_op_passes():
    assert_accesses_true(torch.ops.tessera_test.honest, (torch.randn(4, 3), torch.zeros(4, 3)))


def test_an_undeclared_write_is_caught():
    with pytest.raises(AssertionError, match="outside the declared writes"):
        assert_accesses_true(torch.ops.tessera_test.writes_undeclared, (torch.randn(8),))


def test_an_undeclared_read_is_caught():
    with pytest.raises(AssertionError, match="outside the declared reads"):
        assert_accesses_true(torch.ops.tessera_test.reads_undeclared, (torch.randn(8),))


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
