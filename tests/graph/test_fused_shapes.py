"""The fused GEMM units' shapes live in a torch-free table that the cost model reads and the op registry
takes them from: every fused GEMM op registered has its shape from the table, the table names no op that is
not registered, and a GEMM op without one is refused when registered."""

from __future__ import annotations

import pytest

import tessera.kernels  # noqa: F401  (registers the fused ops)
from tessera.cost.features import gemm_dims
from tessera.graph.fused_shapes import FUSED_GEMMS, merged_linear_dims, moe_gemm_dims, op_base_name
from tessera.graph.ir import Kernel
from tessera.graph.opclass import FUSED, register_fused


def test_every_fused_gemm_takes_its_shape_from_the_table():
    gemms = {name for name, info in FUSED.items() if info.op_class in ("gemm", "grouped_gemm")}
    assert gemms == set(FUSED_GEMMS)
    for name, info in FUSED.items():
        assert info.gemm is FUSED_GEMMS.get(name), name


def test_no_fused_op_shares_an_aten_gemm_name():
    aten = {"mm", "matmul", "addmm", "bmm", "baddbmm", "mv", "addmv", "linear", "_grouped_mm"}
    assert not aten & set(FUSED)


def test_a_gemm_op_without_a_shape_is_refused():
    with pytest.raises(ValueError, match="no GEMM shape"):
        register_fused("not_declared_gemm", "gemm")
    assert "not_declared_gemm" not in FUSED


def test_shapes_by_hand():
    assert op_base_name("tessera.merged_linear.default") == "merged_linear"
    assert merged_linear_dims([[2, 8, 64], [96, 64], [32, 64], [96], [32]]) == (1, 16, 128, 64)
    assert moe_gemm_dims([[10, 64], [4, 128, 64], [4], [30]]) == (1, 30, 128, 64)  # gathered rows
    k = Kernel(0, "tessera.merged_linear.default", "model.layers.0.self_attn", 0, 0, "gemm", [], {}, [],
               shapes=[[4, 64], [96, 64], [32, 64]], dtypes=["bfloat16"] * 3, flops=0, bytes_read=0, bytes_written=0)
    assert gemm_dims(k) == (1, 4, 128, 64)
