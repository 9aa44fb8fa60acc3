"""From a solved PTX function to its `Summary`: effects, access sites and pointer stores.

Every instruction that may touch global memory is read back with the origins of its address
operands: each becomes an effect (what is done, through which origins), and, when asked for, an
`AccessSite` for instrumentation. Addresses proven to lie in shared, local or parameter memory are
dropped. Each call contributes the callee's effects mapped into this function's origins, or, for a
callee that cannot be analysed, an *escape* of every value passed to it. Device functions also
record the pointers they store where a caller can see them.

Unrecognised instructions with a bracketed address derived from a parameter are read-write with a
reason; nothing reachable is ever reported as `none`.
"""

from __future__ import annotations

from collections.abc import Callable

from tessera.capture.ptx.dataflow import FunctionDataflow
from tessera.capture.ptx.instructions import (
    address_text,
    first_space,
    is_immediate,
    memory_type,
    opname,
    site_space,
    space_of,
)
from tessera.capture.ptx.operands import Cell, ReturnCell
from tessera.capture.ptx.origins import CALLER_SHARED, NON_GLOBAL_KINDS, UNKNOWN, select_base
from tessera.capture.ptx.parse import Function, Instruction, parse_int
from tessera.capture.ptx.results import ACCESSES, READ, READ_WRITE, WRITE, AccessSite
from tessera.capture.ptx.summary import Effect, PointerStore, Summary
from tessera.capture.ptx.transfers import CallTransfer

__all__ = ["summarize"]

_VERB = {0: "does not access", 1: "reads", 2: "writes", 3: "reads and writes"}


def summarize(flow: FunctionDataflow, with_sites: bool = False) -> Summary:
    """The summary of a solved function; with `with_sites`, also its access sites."""
    return _Summarizer(flow, with_sites).run()


class _Summarizer:
    """Collects the summary of one solved function."""

    __slots__ = ("flow", "graph", "fn", "with_sites", "effects", "seen", "sites", "ptr_stores")

    def __init__(self, flow: FunctionDataflow, with_sites: bool) -> None:
        self.flow = flow
        self.graph = flow.graph
        self.fn = flow.fn
        self.with_sites = with_sites
        self.effects: list[Effect] = []
        self.seen: dict[tuple[frozenset, str], Effect] = {}
        self.sites: list[AccessSite] = []
        self.ptr_stores: list[PointerStore] = []

    def run(self) -> Summary:
        """The summary: effects and sites of the memory accesses, then of the calls."""
        fn = self.fn
        for index, kind in self.graph.accesses.items():
            ins = fn.body[index]
            _SITES_OF[kind](self, ins, index)
            if not fn.is_entry and kind in ("st", "atom", "red"):
                self._pointer_store(ins, 1 if kind == "atom" else 0)
        for t in self.graph.calls:
            self._call(t)
        shared_values = set(self.flow.get("$shared")) - {CALLER_SHARED}
        return Summary(fn.name, self.effects, self._returns(), self.ptr_stores, shared_values, sites=self.sites,
                       has_sites=self.with_sites)

    def _effect(self, mode: int, origins, role: str, reason: str, line: int) -> None:
        key = (frozenset(origins), role)
        e = self.seen.get(key)
        if e is None:
            self.seen[key] = e = Effect(mode, key[0], role, reason, line)
            self.effects.append(e)
        elif mode & ~e.mode:
            e.mode |= mode
            e.reason = f"{e.reason}; {reason}"

    def _site(self, index: int, ins: Instruction, mode: int, space: str | None, opi: int, origins: set,
              width: int, role: str, why: str) -> None:
        """Record one address operand of a memory instruction: its effect, and if asked for, its access
        site. `mode`: the access; `space`: the site's space (None: not an instrumentable site); `opi`:
        the operand; `origins`: of the address; `width`: in bytes (0: unknown); `role`: of the address
        (see Effect); `why`: the reason the site is reported so."""
        name = opname(ins)
        if role == "addr" and origins and {o[0] for o in origins} <= NON_GLOBAL_KINDS:
            return                  # provably shared/local/param memory
        if not origins and role != "escape":
            origins = {UNKNOWN}
        if mode or role != "escape":
            self._effect(mode, origins, role, f"{name} at line {ins.line}", ins.line)
        if not self.with_sites or role not in ("addr", "tmap") or space is None:
            return
        base = select_base(origins) if role == "addr" else origins
        plist = sorted({o[1] for o in base if o[0] in ("P", "A") and o[1] is not None})
        instr = width > 0 and space != "bulk-tensor" and mode != 0
        if not instr:
            why = why or ("no data access" if mode == 0 else "unrecognised instruction")
        else:
            why = _describe(base, self.fn)
        self.sites.append(AccessSite(self.fn.name, ins.line, name, space, ACCESSES[mode],
                                     address_text(ins.operands[opi]) if opi is not None else "", width, plist,
                                     ins.predicate, instr, why, index, opi if opi is not None else -1))

    def _pointer_store(self, ins: Instruction, ai: int) -> None:
        """A store of pointer-carrying values through parameter-derived addresses (for callers)."""
        names = self.graph.names
        vals: set = set()
        for o in ins.operands[(ai + 1):]:
            ks: list = []
            cs: set = set()
            names.source(o, ins.scope, ks, cs)
            vals |= cs
            for k in ks:
                vals |= self.flow.get(k)
        if vals:
            addr = self._address(ins.operands[ai], ins.scope)
            if not addr or not {o[0] for o in addr} <= {"C", "S"}:
                self.ptr_stores.append(PointerStore(frozenset(addr), frozenset(vals)))

    def _call(self, t: CallTransfer) -> None:
        """Callee effects mapped into this function; values passed to unknown callees escape."""
        flow = self.flow
        summary = t.summary
        args = flow.argument_values(t.args)
        if summary.unknown is not None:
            self._escape(t, args)
            return
        merged: dict[tuple[frozenset, str], list[Effect]] = {}
        for e in summary.effects:
            mo = flow.map_callee(e.origins, args)
            if e.role != "escape" and not mo:
                mo = {UNKNOWN}
            merged.setdefault((frozenset(mo), e.role), []).append(e)
        for (mo, role), es in merged.items():
            mode = 0
            for e in es:
                mode |= e.mode
            self._effect(mode, mo, role, _call_reason(summary.name, mode, es, t.line), t.line)
        if not self.fn.is_entry:
            for store in summary.ptr_stores:
                self.ptr_stores.append(PointerStore(frozenset(flow.map_callee(store.address, args)),
                                                    frozenset(flow.map_callee(store.value, args))))

    def _escape(self, t: CallTransfer, args: list) -> None:
        """Every pointer-like value handed to a callee that cannot be analysed."""
        mode = t.summary.extern_mode
        if not mode:
            return
        esc = set()
        for a in args:
            for v in a.values():
                esc |= {o for o in v if o[3] != 2}
        kinds = {o[0] for o in esc}
        if "C" in kinds:
            esc |= self.flow.local_read([(None, None)])
        if "S" in kinds:
            esc |= self.flow.get("$shared")
        esc = {o for o in esc if o[3] != 2}
        if esc:
            self._effect(mode, esc, "escape", f"passed to {t.summary.unknown} at line {t.line}", t.line)

    def _returns(self) -> dict[tuple[int, int | None], set]:
        """The origins of each return parameter, by byte offset."""
        ret: dict = {}
        for key, offs in self.graph.cell_offsets.items():
            if isinstance(key, ReturnCell):
                for off in offs:
                    s = self.flow.get(Cell(key, off))
                    if s:
                        ret[(key.index, off)] = set(s)
        return ret

    # ------------------------------------------------------------------ address operands, by access kind
    def _address(self, op: str, sid: int) -> set:
        keys, consts, _ = self.graph.names.address(op, sid)
        return self.flow.address_of(keys, consts)

    def _load(self, ins: Instruction, index: int) -> None:
        space, vector, size = memory_type(ins)
        t = self.graph.global_loads.get(index)
        addr = self.flow.address_of(t.keys, t.consts) if t is not None else self._address(ins.operands[1], ins.scope)
        self._site(index, ins, READ, "global" if space == "global" else "generic", 1, addr, vector * size, "addr", "")

    def _store(self, ins: Instruction, index: int) -> None:
        space, vector, size = memory_type(ins)
        self._site(index, ins, WRITE, "global" if space == "global" else "generic", 0,
                   self._address(ins.operands[0], ins.scope), vector * size, "addr", "")

    def _atomic(self, ins: Instruction, index: int) -> None:
        space, vector, size = memory_type(ins)
        ai = 1 if ins.opcode == "atom" else 0
        self._site(index, ins, READ_WRITE, "global" if space == "global" else "generic", ai,
                   self._address(ins.operands[ai], ins.scope), vector * size, "addr", "")

    def _multimem(self, ins: Instruction, index: int) -> None:
        mods, ops = ins.modifiers, ins.operands
        kind = mods[0] if mods else ""
        mode = {"ld_reduce": READ, "st": WRITE, "red": READ_WRITE}.get(kind, READ_WRITE)
        oi = 1 if kind == "ld_reduce" else 0
        if oi < len(ops) and ops[oi].startswith("["):
            _, vector, size = memory_type(ins)
            why = "" if kind in ("ld_reduce", "st", "red") else "unrecognised multimem instruction"
            self._site(index, ins, mode, "generic", oi, self._address(ops[oi], ins.scope), vector * size, "addr", why)

    def _copy(self, ins: Instruction, index: int) -> None:
        mods, ops = ins.modifiers, ins.operands
        if first_space(mods) == "global":
            mode, oi = (READ_WRITE if "reduce" in mods else WRITE), 0
        else:
            mode, oi = READ, 1
        if oi >= len(ops) or not ops[oi].startswith("["):
            return
        width = 0
        if len(ops) > 2:
            w = parse_int(ops[2]) if is_immediate(ops[2]) else None
            width = w or 0
        why = "" if width else "copy size is not a constant"
        self._site(index, ins, mode, "global", oi, self._address(ops[oi], ins.scope), width, "addr", why)

    def _tensor_copy(self, ins: Instruction, index: int) -> None:
        mods, ops = ins.modifiers, ins.operands
        if "prefetch" in mods:
            mode, oi = 0, 0
        elif first_space(mods) == "global":
            mode, oi = (READ_WRITE if "reduce" in mods else WRITE), 0
        else:
            mode, oi = READ, 1
        if oi < len(ops) and ops[oi].startswith("["):
            self._site(index, ins, mode, "bulk-tensor", oi, self._address(ops[oi], ins.scope), 0, "tmap",
                       "bulk tensor copy through a tensor map")

    def _texture(self, ins: Instruction, index: int) -> None:
        mode = {"tex": READ, "tld4": READ, "suld": READ, "sust": WRITE, "sured": READ_WRITE}.get(ins.opcode,
                                                                                             READ_WRITE)
        for oi, o in enumerate(ins.operands):
            if o.startswith("["):
                self._site(index, ins, mode, None, oi, self._address(o, ins.scope), 0, "tex", "texture/surface access")
                return

    def _prefetch(self, ins: Instruction, index: int) -> None:
        ops = ins.operands
        if not ops or not ops[0].startswith("["):
            return
        if "tensormap" in ins.modifiers:
            self._site(index, ins, 0, None, 0, self._address(ops[0], ins.scope), 0, "tmap", "prefetch of a tensor map")
        else:
            # no data access, but evidence that the address is a pointer
            self._site(index, ins, 0, None, 0, self._address(ops[0], ins.scope), 0, "addr", "prefetch")

    def _discard(self, ins: Instruction, index: int) -> None:
        ops = ins.operands
        if ops and ops[0].startswith("["):
            self._site(index, ins, WRITE, site_space(ins.modifiers), 0, self._address(ops[0], ins.scope), 0, "addr",
                       "discard makes the line's contents undefined")

    def _tensormap(self, ins: Instruction, index: int) -> None:
        # tensormap.replace [addr], v  /  tensormap.cp_fenceproxy [dst], [src], size
        mods, ops = ins.modifiers, ins.operands
        if not ops or not ops[0].startswith("["):
            return
        replace = bool(mods) and mods[0] == "replace" and "global" in mods
        fence_copy = bool(mods) and mods[0] == "cp_fenceproxy" and first_space(mods) == "global"
        if replace or fence_copy or "shared" not in "".join(mods):
            self._site(index, ins, WRITE, "global", 0, self._address(ops[0], ins.scope), 0, "addr",
                       "tensor map update")

    def _wmma(self, ins: Instruction, index: int) -> None:
        mods, ops = ins.modifiers, ins.operands
        kind = mods[0]
        oi = 1 if kind == "load" else 0
        sp = space_of(mods)
        if sp in ("global", "generic") and oi < len(ops) and ops[oi].startswith("["):
            self._site(index, ins, READ if kind == "load" else WRITE, sp, oi, self._address(ops[oi], ins.scope), 0,
                       "addr", "wmma fragment access")

    def _unknown(self, ins: Instruction, index: int) -> None:
        for oi, o in enumerate(ins.operands):
            if o.startswith("["):
                org = self._address(o, ins.scope)
                if any(x[0] in ("P", "L", "U") for x in org):
                    self._site(index, ins, READ_WRITE, "generic", oi, org, 0, "addr",
                               f"unrecognised instruction {opname(ins)}")


# how each kind of access records its address operands; plain functions, not bound methods, so that a
# _Summarizer holds no reference cycle (the analysis runs with the garbage collector off)
_SITES_OF: dict[str, Callable[[_Summarizer, Instruction, int], None]] = {
    "ld": _Summarizer._load, "st": _Summarizer._store, "atom": _Summarizer._atomic, "red": _Summarizer._atomic,
    "multimem": _Summarizer._multimem, "cp": _Summarizer._copy, "cp-tensor": _Summarizer._tensor_copy,
    "tex": _Summarizer._texture, "prefetch": _Summarizer._prefetch, "prefetchu": _Summarizer._prefetch,
    "applypriority": _Summarizer._prefetch, "discard": _Summarizer._discard, "tensormap": _Summarizer._tensormap,
    "wmma": _Summarizer._wmma, "unknown": _Summarizer._unknown,
}


def _call_reason(callee: str, mode: int, es: list[Effect], line: int) -> str:
    for e in es:
        js = sorted({o[1] for o in e.origins if o[0] in ("P", "A") and o[1] is not None})
        if e.role != "escape" and js and not any(o[0] in ("L", "U") for o in e.origins):
            return f"passed to .func {callee} at line {line} ({_VERB[mode]} its param {js[0]})"
    return f"{es[0].reason} in .func {callee} (called at line {line})"


def _describe(base, fn: Function) -> str:
    names = []
    for o in base:
        if o[0] == "P" and o[1] is not None and o[1] < len(fn.params):
            names.append(f"param {o[1]} ({fn.params[o[1]].name}" + (f"+{o[2]}" if o[2] else "") + ")")
        elif o[0] == "L":
            names.append("address loaded from memory")
        elif o[0] == "U":
            names.append("address of unknown origin")
        elif o[0] == "G":
            names.append("module variable")
    return "address from " + ", ".join(sorted(set(names))) if names else ""
