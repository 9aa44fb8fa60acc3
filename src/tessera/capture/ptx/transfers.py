"""The transfer records of the PTX dataflow: what one instruction does to the origins of its keys.

A *key* is what holds origins: a register name, a `Cell` of a `.param` variable, or one of the two
abstract memories `"$local"` and `"$shared"`. Each instruction that moves provenance becomes one or
more transfers; the solver applies them until nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from tessera.capture.ptx.operands import Resolved
from tessera.capture.ptx.summary import Summary

__all__ = [
    "CallArg", "CallTransfer", "LoadTransfer", "SharedCopyTransfer", "StoreTransfer", "Transfer",
    "UnionTransfer", "UnknownTransfer",
]

Key = object            # a register name, a Cell, "$local" or "$shared"


class UnionTransfer(NamedTuple):
    """`dsts` receive the origins of `plain` keys and `consts`, and those of `scaled` keys and
    `scaled_consts` as index-like values. `definite` marks the result a definite address (cvta to
    global); `offset_rule` (`instructions.OFFSET_RULE`) says what becomes of parameter and local
    address offsets; `index` is the instruction whose operands give the shift (-1: none)."""

    dsts: Sequence[Key]
    plain: Sequence[Key]
    consts: frozenset
    scaled: Sequence[Key]
    scaled_consts: frozenset
    definite: bool
    offset_rule: int
    index: int


class LoadTransfer(NamedTuple):
    """A load (or the fetch half of an atomic) of `size`-byte elements from `space` at the address
    held by `keys` / `consts` plus `offset`; `dsts[j]` are the keys of vector element j."""

    dsts: list[list[Key]]
    space: str
    keys: tuple
    consts: frozenset
    offset: int
    size: int


class StoreTransfer(NamedTuple):
    """A store of `width` bytes of the values of `value_keys` / `value_consts` to `space`, at the
    address held by `keys` / `consts` plus `offset` (only what lands in local or shared memory is
    tracked)."""

    space: str
    keys: tuple
    consts: frozenset
    value_keys: tuple
    value_consts: frozenset
    offset: int
    width: int


class SharedCopyTransfer(NamedTuple):
    """An asynchronous copy into shared memory from the address held by `keys` / `consts`, or, for a
    bulk tensor copy (`tensor`), from memory described by a tensor map."""

    keys: Sequence[Key]
    consts: frozenset
    tensor: bool


class CallArg(NamedTuple):
    """One argument of a call: `kind` "cells" (`value` the `Cell` keys of the `.param` variable
    passed), "reg" (a register key), "const" (a set of constant origins) or "imm" (an immediate)."""

    kind: str
    value: object = None


class CallTransfer(NamedTuple):
    """A call of the function summarised by `summary`; `rets` are the resolved return operands
    ("reg" or "cell"), `callee_register` the register of an indirect call to unknown code."""

    summary: Summary
    args: list[CallArg]
    rets: list[Resolved]
    line: int
    callee_register: str | None
    index: int


class UnknownTransfer(NamedTuple):
    """`dsts` receive values of unknown origin (texels, results of unrecognised instructions)."""

    dsts: list[Key]


Transfer = UnionTransfer | LoadTransfer | StoreTransfer | SharedCopyTransfer | CallTransfer | UnknownTransfer
