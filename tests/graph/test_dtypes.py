"""Bytes per element by dtype name without torch: the table agrees with torch, other dtypes are asked of
torch, and a name that is no dtype is refused."""

from __future__ import annotations

import pytest
import torch

from tessera.graph.dtypes import ITEMSIZE, dtype_itemsize


def test_the_table_agrees_with_torch():
    for name, size in ITEMSIZE.items():
        assert getattr(torch, name).itemsize == size, name


def test_a_dtype_outside_the_table_is_asked_of_torch():
    assert "int4" not in ITEMSIZE
    assert dtype_itemsize("int4") == torch.int4.itemsize


def test_a_name_that_is_no_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_itemsize("float7")
