"""Function summaries: what a PTX function does to memory, in terms of its own parameters.

A summary is computed once per function (kernel or `.func`) and is what a caller maps into its own
origins at a call site. Callees that cannot be analysed (extern, indirect, recursive, or whose body
failed to parse) get an *unknown* summary carrying the reason; a few well-known externs (`vprintf`,
`malloc`, ...) have a fixed behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from tessera.capture.ptx.origins import EMPTY, HEAP
from tessera.capture.ptx.results import READ, READ_WRITE, AccessSite

__all__ = ["KNOWN_EXTERNS", "Effect", "ExternCallee", "PointerStore", "Summary", "unknown_summary"]


@dataclass(slots=True)
class Effect:
    """One kind of access through a set of address origins, with the first reason it was seen for.

    `role` is "addr" (an address), "tmap" (a tensor map handle), "tex" (a texture or surface), or
    "escape" (values handed to code that cannot be analysed)."""

    mode: int
    origins: frozenset
    role: str
    reason: str
    line: int


class PointerStore(NamedTuple):
    """A store of pointer-carrying values through an address a caller may see."""

    address: frozenset
    value: frozenset


@dataclass(slots=True)
class Summary:
    """What a function does, in terms of its own parameters."""

    name: str
    effects: list[Effect]
    ret: dict[tuple[int, int | None], set]     # (return parameter, byte offset) -> origins
    ptr_stores: list[PointerStore]
    shared_values: set
    unknown: str | None = None      # set for callees that cannot be analysed: the reason
    extern_mode: int = READ_WRITE
    extern_ret: frozenset = EMPTY
    sites: list[AccessSite] = field(default_factory=list)
    loaded_params: set = field(default_factory=set)
    has_sites: bool = False


class ExternCallee(NamedTuple):
    """The fixed behaviour of a well-known extern function."""

    mode: int               # the access given to its pointer arguments
    returns: frozenset      # origins of its return value
    writes_arguments: bool


KNOWN_EXTERNS = {
    "vprintf": ExternCallee(READ, EMPTY, False),
    "__assertfail": ExternCallee(READ, EMPTY, False),
    "__assert_fail": ExternCallee(READ, EMPTY, False),
    "malloc": ExternCallee(0, frozenset({HEAP}), False),
    "free": ExternCallee(READ_WRITE, EMPTY, False),
}


def unknown_summary(name: str, reason: str) -> Summary:
    """The summary of a callee that cannot be analysed, for `reason`."""
    return Summary(name, [], {}, [], set(), unknown=reason)
