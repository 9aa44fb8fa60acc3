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


def test_every_fused_op_has_an_access_truth_test():
    """A new tessera:: op must come with a declared-access test in tests/kernels (by name, in a module that
    runs assert_accesses_true)."""
    from pathlib import Path

    import tessera.triton_kernels  # noqa: F401  (its ops too, whatever other tests have imported)

    ops = sorted({n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("tessera::")})
    assert len(ops) > 20
    texts = [p.read_text() for p in Path(__file__).parent.glob("test_*.py")
             if "assert_accesses_true(" in p.read_text() and p.name != Path(__file__).name]
    missing = [op for op in ops if not any(f"{op}" in t for t in texts)]
    assert not missing, f"fused ops without an access-truth test in tests/kernels: {missing}"
