"""Provenance values of the PTX dataflow: the origins a register may hold, and the joins over them.

The analysis is a flow-insensitive provenance dataflow over registers, iterated to a fixpoint. Each
register holds a set of *origins*, tuples ``(kind, index, offset, flag)``:

- ``P`` value of parameter `index` (byte `offset` inside it; None: unknown offset),
- ``A`` address of parameter `index` (+ `offset`), from `mov %rd, param` / `cvta.param`,
- ``L`` value loaded from the memory that parameter `index` points to (None: from memory that no
  parameter reaches, e.g. a `__constant__` variable),
- ``U`` unknown (result of an unknown callee, or of an unrecognised memory instruction),
- ``G``/``S``/``C``/``H`` addresses of module globals, shared memory, local memory, `malloc` heap,
- ``SH`` (device functions only) whatever the caller left in shared memory, ``F`` a function address.

`flag` is 1 for definite addresses (a `.ptr` parameter, the result of `cvta.to.global`, a symbol
address), 2 for index-like values (through a multiplication, a shift left, or widened from 32 bits:
such a value cannot be a 64-bit pointer), 0 otherwise. Registers of compiler-generated PTX are
(nearly) SSA, so merging all definitions of a register is as precise as a flow-sensitive analysis
for it; PHI-like merges across loops and branches are exactly these unions.

A ``C`` origin is ``("C", lo, hi, 1)``: the local address lies in the byte range [lo, hi] of the
local offset space (None, None: anywhere). Local memory itself holds *cells* ``(start, end, origin)``:
`origin` was stored at bytes [start, end) (None, None: anywhere).

Origins and cells stay plain tuples on purpose: they are the elements of every set the fixpoint
joins, built and hashed in the innermost loops, and a NamedTuple costs several times as much to build
(about 240 ns against 50 ns for a plain tuple on the development VM). Their fields are read
positionally: ``o[0]`` kind, ``o[1]`` index, ``o[2]`` offset, ``o[3]`` flag.
"""

from __future__ import annotations

__all__ = [
    "CALLER_SHARED", "COLLAPSE_AT", "EMPTY", "HEAP", "LOADED_UNKNOWN", "LOCAL_ANYWHERE", "MODULE_GLOBAL",
    "NON_GLOBAL_KINDS", "SHARED", "UNKNOWN", "Cell", "Origin", "collapse", "select_base", "with_flag",
]

Origin = tuple          # (kind, index, offset, flag), see the module docstring
Cell = tuple            # (start, end, origin): an origin stored in local memory

UNKNOWN: Origin = ("U", None, None, 0)
LOADED_UNKNOWN: Origin = ("L", None, None, 0)       # loaded from memory that no parameter reaches
MODULE_GLOBAL: Origin = ("G", None, None, 1)
SHARED: Origin = ("S", None, None, 1)
LOCAL_ANYWHERE: Origin = ("C", None, None, 1)
HEAP: Origin = ("H", None, None, 1)
CALLER_SHARED: Origin = ("SH", None, None, 0)
EMPTY: frozenset = frozenset()
NON_GLOBAL_KINDS = {"S", "C", "A"}                  # address kinds that are never global memory
COLLAPSE_AT = 48                                    # a set larger than this forgets byte offsets


def with_flag(origins, flag: int) -> set:
    """The same origins with `flag` replaced."""
    return {(o[0], o[1], o[2], flag) for o in origins}


def collapse(s: set) -> set:
    """Forget byte offsets when a set grows (pointer increments through a parameter address)."""
    out = set()
    for o in s:
        k = o[0]
        if k in ("A", "P", "L"):
            out.add((k, o[1], None, o[3]))
        elif k == "C":
            out.add(LOCAL_ANYWHERE)
        elif len(o) == 3:
            out.add((None, None, o[2]))     # a local-memory cell: forget where it is
        else:
            out.add(o)
    return out


def select_base(origins) -> list:
    """The origins that may be the base pointer of an address (see the attribution rules)."""
    plain = []
    strong = []
    for o in origins:
        flag = o[3]
        if flag != 2:
            plain.append(o)
            if flag == 1:
                strong.append(o)
    return strong or plain or list(origins)
