"""The fixpoint of one PTX function's provenance dataflow: which origins each key may hold.

Shared memory is one abstract cell (`$shared`): a store adds the stored value's origins, a load
reads them back. Local memory (`$local`) keeps the byte span of every store: local addresses carry
an offset range (``C`` origins, each local variable in its own window), integer registers carry a
value range (constants, masks, shifts, sums), so a load from `ptrs[k & 1]` reads back only the
pointers stored in that array (nvcc spills arrays of pointers indexed at run time to local memory).
A load from global memory yields ``L`` of the parameters its address derives from.

A call maps the callee's summary into the caller: its return values, the pointers it stores where
the caller can see them, and what it leaves in shared memory. `FunctionDataflow.solve` applies the
transfers by chaotic iteration in program order until nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tessera.capture.ptx.classify import FunctionTransfers
from tessera.capture.ptx.operands import Cell
from tessera.capture.ptx.origins import (
    CALLER_SHARED,
    COLLAPSE_AT,
    EMPTY,
    LOADED_UNKNOWN,
    LOCAL_ANYWHERE,
    MODULE_GLOBAL,
    UNKNOWN,
    collapse,
    select_base,
    with_flag,
)
from tessera.capture.ptx.ranges import IntegerRanges, Range
from tessera.capture.ptx.summary import KNOWN_EXTERNS
from tessera.capture.ptx.transfers import (
    CallArg,
    CallTransfer,
    LoadTransfer,
    SharedCopyTransfer,
    StoreTransfer,
    Transfer,
    UnionTransfer,
    UnknownTransfer,
)

__all__ = ["ArgValues", "FunctionDataflow"]

ArgValues = dict[int | None, set]       # the origins an argument passes, by byte offset in it


class FunctionDataflow:
    """The origins of every key of one function, once `solve` has run."""

    __slots__ = ("graph", "fn", "pflag", "psize", "loaded_params", "prov", "collapsed", "track_offsets", "ranges")

    def __init__(self, graph: FunctionTransfers) -> None:
        self.graph = graph
        self.fn = graph.fn
        self.pflag = graph.pflag
        self.psize = [p.size for p in graph.fn.params]
        self.loaded_params = graph.loaded_params    # grows as loads through parameter addresses are met
        self.prov: dict[object, set] = {}
        self.collapsed: set = set()
        self.track_offsets = graph.may_offset_addresses
        # value ranges only ever bound address offsets
        self.ranges = IntegerRanges(graph) if self.track_offsets else None
        if not graph.fn.is_entry:
            self.prov["$shared"] = {CALLER_SHARED}

    def solve(self) -> None:
        """Chaotic iteration in program order: only transfers that can produce origins by themselves
        (constants, loads, calls) start dirty; a change makes the users of the changed key dirty."""
        ts = self.graph.transfers
        users = self.graph.users
        apply = _APPLY
        n = len(ts)
        dirty = bytearray(n)
        for ti in self.graph.seeds:
            dirty[ti] = 1
        steps = 0
        limit = 100 * (n + 10)
        pos = dirty.find(1)
        while pos >= 0:
            dirty[pos] = 0
            steps += 1
            if steps > limit:
                raise RuntimeError(f"PTX dataflow did not converge in {self.fn.name}")
            t = ts[pos]
            for k in apply[type(t)](self, t):
                for u in users.get(k, ()):
                    dirty[u] = 1
            nxt = dirty.find(1, pos + 1)
            pos = nxt if nxt >= 0 else dirty.find(1)

    # ------------------------------------------------------------------ the lattice
    def get(self, key) -> set:
        """The origins `key` may hold."""
        s = self.prov.get(key)
        return s if s is not None else EMPTY

    def join(self, key, origins, owned: bool = False) -> bool:
        """Join `origins` into the set of `key`; True if it grew. A set that grows past COLLAPSE_AT
        forgets byte offsets for good (so pointer increments in loops cannot grow it forever).
        `owned`: the caller hands `origins` over (it may become the key's set)."""
        if not origins:
            return False
        prov = self.prov
        s = prov.get(key)
        if s is None:
            if len(origins) > COLLAPSE_AT:
                origins = collapse(origins)
                self.collapsed.add(key)
            elif not owned:
                origins = set(origins)
            prov[key] = origins
            return True
        if key in self.collapsed:
            origins = collapse(origins)
        n = len(s)
        s |= origins
        if len(s) == n:
            return False
        if len(s) > COLLAPSE_AT and key not in self.collapsed:
            self._collapse_key(key, s)
        return True

    def _collapse_key(self, key, s: set) -> None:
        """Make `key` forget byte offsets from now on, starting with its set `s`."""
        c = collapse(s)
        s.clear()
        s |= c
        self.collapsed.add(key)

    def _join_all(self, keys, origins, changed: list) -> None:
        for k in keys:
            if self.join(k, origins):
                changed.append(k)

    def address_of(self, keys, consts) -> set:
        """The origins of an address held by `keys` plus the constant origins `consts`."""
        addr = set(consts)
        for k in keys:
            addr |= self.get(k)
        return addr

    # ------------------------------------------------------------------ memory
    def local_read(self, spans) -> set:
        """Origins stored in local memory at any of the byte spans [(start, end)] (None: anywhere)."""
        out = set()
        cell = self.prov.get("$local")
        if not cell:
            return out
        for a, b, o in cell:
            for s, e in spans:
                if a is None or s is None or (a < e and s < b):
                    out.add(o)
                    break
        return out

    @staticmethod
    def _spans(addr, off: int, width: int) -> list:
        """Byte spans of local memory that an access of `width` bytes at addr+off may touch."""
        spans = []
        for o in addr:
            if o[0] == "C":
                if o[1] is None or o[2] is None:
                    return [(None, None)]
                spans.append((o[1] + off, o[2] + off + max(width, 1)))
            elif o[0] not in ("S", "G", "A", "H", "F", "P"):
                return [(None, None)]          # may point anywhere, local memory included
        return spans

    def load_result(self, addr: set, off: int, size: int, k: int = 0) -> set:
        """Origins of the value an access at addr+off (+k elements of `size` bytes) may load."""
        out = set()
        local_spans = None
        for o in select_base(addr):
            kind = o[0]
            if kind == "P" or kind == "L":
                out.add(("L", o[1], o[2], 0))
            elif kind == "A":
                ao = o[2]
                i = o[1]
                out.add(("P", i, None if ao is None else ao + off + k * size,
                         self.pflag[i] if i is not None and i < len(self.pflag) else 0))
                if i is not None and i < len(self.psize):
                    self.loaded_params.add(i)
            elif kind == "C":
                if local_spans is None:
                    local_spans = []
                if o[1] is None or o[2] is None:
                    local_spans.append((None, None))
                else:
                    local_spans.append((o[1] + off + k * size, o[2] + off + (k + 1) * max(size, 1)))
            elif kind == "S":
                out |= self.get("$shared")
            elif kind in ("G", "H", "SH"):
                out.add(LOADED_UNKNOWN)
            else:
                out.add(UNKNOWN)
        if local_spans:
            out |= self.local_read(local_spans)
        if not addr:
            out.add(UNKNOWN)
        return out

    # ------------------------------------------------------------------ address offsets
    def _offsets(self, res: set, rule: int, idx: int) -> set:
        """Shift (rule 1: add/sub/mad by the other operand's range) or forget (rule 2) the offsets of
        parameter (A) and local (C) addresses after arithmetic."""
        if not any(o[0] in ("A", "C") for o in res):
            return res
        out = {o for o in res if o[0] not in ("A", "C")}
        if rule == 2:
            for o in res:
                if o[0] in ("A", "C"):
                    out.add((o[0], o[1], None, o[3]) if o[0] == "A" else LOCAL_ANYWHERE)
            return out
        op = self.fn.body[idx].opcode
        specs = self.ranges.sources(idx)
        for j, sp in enumerate(specs):
            if sp.kind == "k":
                origs = self.get(sp.value)
            elif sp.kind == "c":
                origs = (sp.value,)
            else:
                continue
            delta = self._shift(op, specs, j)
            for o in origs:
                k = o[0]
                if k == "A":
                    if delta is not None and delta[0] == delta[1] and o[2] is not None \
                            and 0 <= o[2] + delta[0] < self._psize_of(o[1]):
                        out.add(("A", o[1], o[2] + delta[0], o[3]))
                    else:
                        out.add(("A", o[1], None, o[3]))
                elif k == "C":
                    if delta is not None and o[1] is not None and o[2] is not None:
                        out.add(("C", o[1] + delta[0], o[2] + delta[1], 1))
                    else:
                        out.add(LOCAL_ANYWHERE)
        return out

    def _shift(self, op: str, specs: list, j: int) -> Range:
        """The range added to source operand j by an add, sub or mad (None: unknown)."""
        of = self.ranges.of
        if op == "add" and j < 2 and len(specs) > 1:
            return of(specs[1 - j])
        if op == "sub" and j == 0 and len(specs) > 1:
            d = of(specs[1])
            return None if d is None else (-d[1], -d[0])
        if op == "mad" and j == 2:
            a, b = of(specs[0]), of(specs[1])
            if a is not None and b is not None and a[0] >= 0 and b[0] >= 0:
                return (a[0] * b[0], a[1] * b[1])
        return None

    def _psize_of(self, i) -> int:
        return self.psize[i] if i is not None and 0 <= i < len(self.psize) else 0

    # ------------------------------------------------------------------ transfer functions
    def _union(self, t: UnionTransfer) -> tuple | list:
        # the transfer functions unpack their records: cheaper than one attribute load per field
        dsts, plain, consts, scaled, scaled_consts, definite, rule, idx = t
        prov = self.prov
        owned = True
        if not consts and not scaled and not scaled_consts and len(plain) == 1 and len(dsts) == 1:
            res = prov.get(plain[0])        # the common copy of one register: join copies it if needed
            if not res:
                return ()
            owned = False
        else:
            res = set(consts)
            for k in plain:
                s = prov.get(k)
                if s:
                    res |= s
            for k in scaled:
                s = prov.get(k)
                if s:
                    res |= with_flag(s, 2)
            if scaled_consts:
                res |= scaled_consts
            if not res:
                return ()
        if definite:
            res = with_flag(res, 1)
            owned = True
        if rule and self.track_offsets:
            res = self._offsets(res, rule, idx)
        if len(dsts) != 1:
            changed: list = []
            self._join_all(dsts, res, changed)
            return changed
        d = dsts[0]
        s = prov.get(d)
        if s is None or d in self.collapsed:
            return (d,) if self.join(d, res, owned) else ()
        n = len(s)                          # join, inlined for the common case of a set that exists
        s |= res
        if len(s) == n:
            return ()
        if len(s) > COLLAPSE_AT:
            self._collapse_key(d, s)
        return (d,)

    def _load(self, t: LoadTransfer) -> list:
        dsts, space, keys, consts, offset, size = t
        changed: list = []
        if space == "shared":
            res = set(self.get("$shared"))
            for d in dsts:
                self._join_all(d, res, changed)
            return changed
        prov = self.prov
        addr = set(consts)
        for k in keys:
            s = prov.get(k)
            if s:
                addr |= s
        if space == "local":
            addr = {o for o in addr if o[0] == "C"} or {LOCAL_ANYWHERE}
        elif space == "const" and not any(o[0] == "A" for o in addr):
            addr = {MODULE_GLOBAL}
        join = self.join
        for j, d in enumerate(dsts):
            if d:
                res = self.load_result(addr, offset, size, j)
                for k in d:
                    if join(k, res):
                        changed.append(k)
        return changed

    def _store(self, t: StoreTransfer) -> list:
        space, keys, consts, value_keys, value_consts, offset, width = t
        changed: list = []
        val = self.address_of(value_keys, value_consts)
        if not val:
            return changed
        if space == "shared":
            if self.join("$shared", val):
                changed.append("$shared")
            return changed
        if space not in ("generic", "global", "local"):
            return changed
        addr = self.address_of(keys, consts)
        if space == "local":
            addr = {o for o in addr if o[0] == "C"} or {LOCAL_ANYWHERE}
        else:
            addr = set(select_base(addr))
        kinds = {o[0] for o in addr}
        spans = self._spans(addr, offset, width) if "C" in kinds or space == "local" else []
        unknown = not addr or bool(kinds & {"U", "L", "SH"})
        if unknown:
            spans = [(None, None)]
        if spans and self.join("$local", {(a, b, o) for a, b in spans for o in val}):
            changed.append("$local")
        if ("S" in kinds or unknown) and self.join("$shared", val):
            changed.append("$shared")
        return changed

    def _shared_copy(self, t: SharedCopyTransfer) -> list:
        if t.tensor:
            res = {LOADED_UNKNOWN}
        else:
            res = self.load_result(self.address_of(t.keys, t.consts), 0, 0)
        return ["$shared"] if self.join("$shared", res) else []

    def _unknown(self, t: UnknownTransfer) -> list:
        changed: list = []
        for k in t.dsts:
            if self.join(k, {UNKNOWN}):
                changed.append(k)
        return changed

    # ------------------------------------------------------------------ calls
    def argument_values(self, args: list[CallArg]) -> list[ArgValues]:
        """The origins each argument of a call passes, by byte offset (0 for a scalar argument)."""
        vals = []
        for a in args:
            if a.kind == "cells":
                d = {}
                for c in a.value:
                    s = self.get(c)
                    if s:
                        d[c.offset] = set(s)
                vals.append(d)
            elif a.kind == "reg":
                vals.append({0: set(self.get(a.value))})
            elif a.kind == "const":
                vals.append({0: set(a.value)})
            else:
                vals.append({})
        return vals

    def map_callee(self, origins, args: list[ArgValues]) -> set:
        """Map a callee's origins into this (the caller's) origin space."""
        out = set()
        for o in origins:
            k = o[0]
            if k in ("P", "A", "L"):
                j = o[1]
                if j is None:
                    out.add(o)
                    continue
                if j >= len(args):
                    out.add(UNKNOWN)
                    continue
                av = args[j]
                if k == "P" and o[2] is not None and o[2] in av:
                    vals = set(av[o[2]])
                else:
                    vals = set()
                    for v in av.values():
                        vals |= v
                if k == "L":
                    vals = self.load_result(vals, 0, 0) if vals else set()
                if o[3] == 2:
                    vals = with_flag(vals, 2)
                elif o[3] == 1 and k != "L":
                    vals = with_flag(vals, 1)
                out |= vals
            elif k == "SH":
                out |= self.get("$shared")
            else:
                out.add(o)
        return out

    def _call(self, t: CallTransfer) -> list:
        if t.summary.unknown is not None:
            return self._unknown_call(t)
        summary = t.summary
        changed: list = []
        args = self.argument_values(t.args)
        for ri, r in enumerate(t.rets):               # return values
            for (j, off), s in summary.ret.items():
                if j != ri:
                    continue
                key = Cell(r.value, off) if r.kind == "cell" else r.value
                if self.join(key, self.map_callee(s, args)):
                    changed.append(key)
        for store in summary.ptr_stores:              # pointers stored into memory the caller can see
            self._callee_store(self.map_callee(store.address, args), self.map_callee(store.value, args), changed)
        if summary.shared_values and self.join("$shared", self.map_callee(summary.shared_values, args)):
            changed.append("$shared")
        return changed

    def _callee_store(self, addr: set, val: set, changed: list) -> None:
        kinds = {o[0] for o in addr}
        targets = []
        if "C" in kinds:
            targets.append("$local")
        if "S" in kinds:
            targets.append("$shared")
        if not addr or kinds & {"U", "L"}:
            targets = ["$local", "$shared"]
        for c in targets:
            if self.join(c, {(None, None, o) for o in val} if c == "$local" else val):
                changed.append(c)

    def _unknown_call(self, t: CallTransfer) -> list:
        """Code that cannot be analysed: unknown results, and unknown values in the memory it can reach."""
        summary = t.summary
        changed: list = []
        args = self.argument_values(t.args)
        kinds = {o[0] for a in args for v in a.values() for o in v}
        res = set(summary.extern_ret) if summary.name in KNOWN_EXTERNS else {UNKNOWN}
        if summary.name not in KNOWN_EXTERNS:
            if "C" in kinds and self.join("$local", {(None, None, UNKNOWN)}):
                changed.append("$local")
            if "S" in kinds and self.join("$shared", {UNKNOWN}):
                changed.append("$shared")
        for r in t.rets:
            self._join_all([Cell(r.value, None)] if r.kind == "cell" else [r.value], res, changed)
        return changed


# the transfer function of each kind of transfer; plain functions, not bound methods, so that a
# FunctionDataflow holds no reference cycle (the analysis runs with the garbage collector off)
_APPLY: dict[type, Callable[[FunctionDataflow, Transfer], Sequence]] = {
    UnionTransfer: FunctionDataflow._union, LoadTransfer: FunctionDataflow._load, StoreTransfer: FunctionDataflow._store,
    SharedCopyTransfer: FunctionDataflow._shared_copy, UnknownTransfer: FunctionDataflow._unknown,
    CallTransfer: FunctionDataflow._call,
}
