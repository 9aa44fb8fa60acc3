"""From the body of a PTX function to its dataflow transfers: each instruction, classified once.

`FunctionTransfers.build` walks the body in order. Plain ALU instructions (the bulk of PTX) take a
fast path; loads, stores, atomics, copies, texture and tensor-map instructions, calls and anything
unrecognised are classified one by one. Besides the transfers, the build records which transfers
read each key (to re-run them when it changes), the transfers that can produce origins by
themselves (the first to run), the integer instructions defining each register (for value ranges),
and the instructions that may touch global memory (revisited by the summary step).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from tessera.capture.ptx.instructions import (
    ALU_CLASS,
    ALU_FORMS,
    ALU_INDEX,
    ALU_MAD,
    ALU_NONE,
    ALU_SELECT,
    MAD,
    NO_ACCESS,
    NO_PROVENANCE,
    SCALED,
    SHARED_ONLY,
    SPECIAL_REGS,
    address_parts,
    alu_form,
    cvt_widens,
    elements,
    first_space,
    is_immediate,
    memory_type,
    offset_rule,
    space_of,
    tracks_range,
    type_info,
)
from tessera.capture.ptx.operands import Cell, OperandResolver, Resolved, ReturnCell
from tessera.capture.ptx.origins import EMPTY, with_flag
from tessera.capture.ptx.parse import Function, Instruction, Module
from tessera.capture.ptx.summary import Summary
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

__all__ = ["FunctionTransfers", "SummaryLookup"]

SummaryLookup = Callable[[str, Resolved], Summary]      # the summary of a callee, by name as resolved
# tuple.__new__(Record, (fields...)) builds the same NamedTuple record as Record(...) in about half the
# time (a NamedTuple's own __new__ is a Python function): used where a record is made per instruction
_new = tuple.__new__
_TEXTURE_OPS = ("tex", "tld4", "suld", "sust", "sured", "txq", "suq")


class FunctionTransfers:
    """The transfers of one function, with what the solver and the summary step need about them."""

    __slots__ = ("fn", "names", "summary_for", "wide_addresses", "pflag", "transfers", "users", "seeds",
                 "top_keys", "rdefs", "cell_offsets", "loaded_params", "accesses", "calls", "global_loads")

    def __init__(self, fn: Function, module: Module, summary_for: SummaryLookup) -> None:
        self.fn = fn
        self.names = OperandResolver(fn, module.symbols)
        self.summary_for = summary_for
        self.wide_addresses = (module.address_size or 64) == 64    # a 64-bit target
        self.pflag = [1 if p.ptr else 0 for p in fn.params]
        self.transfers: list[Transfer] = []
        self.users: defaultdict[object, list[int]] = defaultdict(list)    # key -> transfers reading it
        self.seeds: list[int] = []                 # transfers that can produce origins by themselves
        # every key a transfer defines is in rdefs (ranged: its defining integer instructions) or in
        # top_keys (some definition computes no range), or both
        self.top_keys: set = set()
        self.rdefs: dict[object, list[int]] = {}
        self.cell_offsets: dict[object, set] = {}  # .param variable key -> offsets stored
        self.loaded_params: set[int] = set()
        self.accesses: dict[int, str] = {}         # instruction index -> how it may touch global memory
        self.calls: list[CallTransfer] = []
        self.global_loads: dict[int, LoadTransfer] = {}     # instruction index -> its global/generic load

    @property
    def may_offset_addresses(self) -> bool:
        """Whether some value may carry a parameter or local address (whose offsets then matter)."""
        return self.names.saw_address or bool(self.calls)

    def build(self) -> None:
        """Classify every instruction of the body, in order."""
        # One loop, with the fast path for plain ALU instructions inlined and the hot attributes bound to
        # locals: it runs once per instruction of every function, and a method call per ALU instruction
        # costs a few percent of the whole analysis. Other opcodes go to their own classification
        # (_SPECIAL) or to _general, as do ALU instructions the fast path cannot take.
        # (the offsets of call-sequence .param cells are recorded by _store as the st.param that fill
        # them are met, which is always before the call that reads them)
        names = self.names
        cache = names.operands
        operand = names.operand
        local_regs = names.local_regs
        users = self.users
        transfers = self.transfers
        seeds = self.seeds
        top = self.top_keys
        rdefs = self.rdefs
        alu_class = ALU_CLASS
        wide = self.wide_addresses
        forms = ALU_FORMS[wide]
        special_regs = SPECIAL_REGS
        new = _new
        for idx, ins in enumerate(self.fn.body):
            op = ins.opcode
            cls = alu_class.get(op)
            if cls is None:
                handler = _SPECIAL.get(op)
                if handler is not None:
                    handler(self, idx, ins)
                else:
                    self._general(idx, ins)
                continue
            if cls == ALU_NONE:
                continue                      # no provenance, no memory access
            ops = ins.operands
            text = ins.text
            if not ops or ins.scope or "{" in text or "|" in text:
                self._general(idx, ins)
                continue
            dst = ops[0]
            if dst[0] != "%" or dst in local_regs:
                kind, dst = cache.get((dst, 0)) or operand(dst, 0)
                if kind != "k":
                    continue
            cls, strong, ranged, rule = forms.get(ins.name) or alu_form(ins, wide)
            consts = None
            if cls == ALU_MAD:
                split = self._mad_sources(ops)
                if split is None:
                    self._general(idx, ins)
                    continue
                plain, scaled = split
                keys = plain + scaled
                sconsts = EMPTY
            else:
                keys = []
                for o in (ops[1:3] if cls == ALU_SELECT else ops[1:]):
                    if o[0] == "%" and o not in local_regs:
                        if o not in special_regs and "." not in o:
                            keys.append(o)
                        continue
                    kind, value = cache.get((o, 0)) or operand(o, 0)
                    if kind == "k":
                        keys.append(value)
                    elif kind == "c":
                        if consts is None:
                            consts = {value}
                        else:
                            consts.add(value)
                if cls == ALU_INDEX:          # index-like result (mul, shl, widening cvt)
                    plain, scaled = (), keys
                    sconsts = frozenset(with_flag(consts, 2)) if consts else EMPTY
                    consts = None
                else:                         # a plain union (cvta.to.global: a definite global address)
                    plain, scaled, sconsts = keys, (), EMPTY
            if ranged:
                rd = rdefs.get(dst)
                if rd is None:
                    rdefs[dst] = [idx]
                else:
                    rd.append(idx)
            else:
                top.add(dst)
            if not keys and not consts and not sconsts:
                continue                      # from immediates and special registers only: no origins
            ti = len(transfers)
            if consts or sconsts:
                seeds.append(ti)
            transfers.append(new(UnionTransfer, ((dst,), plain, frozenset(consts) if consts else EMPTY, scaled,
                                                 sconsts, strong, rule, idx)))
            for k in keys:
                users[k].append(ti)

    def _add(self, t: Transfer, defines: list, sources: list, ranged: bool = False) -> None:
        """Append a transfer defining `defines` and reading `sources`."""
        for k in defines:
            if ranged:
                self.rdefs.setdefault(k, []).append(t.index)
            else:
                self.top_keys.add(k)
        ti = len(self.transfers)
        if type(t) is not UnionTransfer or t.consts or t.scaled_consts:
            self.seeds.append(ti)
        self.transfers.append(t)
        for k in sources:
            u = self.users.get(k)
            if u is None:
                self.users[k] = [ti]
            elif u[-1] != ti:
                u.append(ti)

    # ------------------------------------------------------------------ ALU instructions
    def _mad_sources(self, ops: list[str]) -> tuple[list, list] | None:
        """mad d, a, b, c: the plain (c) and index-like (a*b) register sources; None if one is a
        constant origin or the form is unusual (then the general path takes it)."""
        srcs = ops[1:]
        if len(srcs) != 3:
            return None
        names = self.names
        cache = names.operands
        local_regs = names.local_regs
        keys: list = []
        for o in srcs:
            if o[:1] == "%" and o not in local_regs and "+" not in o:
                keys.append(o)              # a plain register (what names.operand would say)
                continue
            sp = cache.get((o, 0)) or names.operand(o, 0)
            if sp.kind == "c":
                return None
            keys.append(sp.value if sp.kind == "k" else None)
        plain = [keys[2]] if keys[2] is not None else []
        scaled = [k for k in keys[:2] if k is not None]
        return plain, scaled

    def _general(self, idx: int, ins: Instruction) -> None:
        """An instruction with no classification of its own (memory-like, without provenance, or
        arithmetic), or an ALU instruction the fast path cannot take."""
        op = ins.opcode
        ops = ins.operands
        mods = ins.modifiers
        if op in NO_ACCESS or op == "discard" or op == "tensormap" or (op == "wmma" and mods and
                                                                        mods[0] in ("load", "store")):
            self._misc_memory(idx, ins)
            return
        if op in NO_PROVENANCE or op in SHARED_ONLY or not ops:
            return
        for o in ops:
            if o and o[0] == "[":
                # an unrecognised instruction with a memory operand: conservative
                self.accesses[idx] = "unknown"
                dsts = self.names.destinations(ops[0], ins.scope) if ops[0][0] != "[" else []
                if dsts:
                    self._add(UnknownTransfer(dsts), dsts, [])
                return
        self._arithmetic(idx, ins)

    def _arithmetic(self, idx: int, ins: Instruction) -> None:
        """The general form of an ALU instruction (vector operands, inner scopes, other opcodes)."""
        op = ins.opcode
        ops = ins.operands
        sid = ins.scope
        mods = ins.modifiers
        names = self.names
        dsts = names.destinations(ops[0], sid)
        if not dsts:
            return
        plain: list = []
        consts: set = set()
        scaled: list = []
        sconsts: set = set()
        strong = False
        srcs = ops[1:]
        if op in SCALED:
            for o in srcs:
                names.source(o, sid, scaled, sconsts)
        elif op in MAD:
            for o in srcs[:2]:
                names.source(o, sid, scaled, sconsts)
            for o in srcs[2:]:
                names.source(o, sid, plain, consts)
        elif op == "selp" or op == "slct":
            for o in srcs[:2]:
                names.source(o, sid, plain, consts)
        elif op == "cvt" and cvt_widens(mods, self.wide_addresses):
            for o in srcs:
                names.source(o, sid, scaled, sconsts)
        else:
            for o in srcs:
                names.source(o, sid, plain, consts)
            if op == "cvta" and len(mods) > 1 and mods[0] == "to" and mods[1] == "global":
                strong = True
        t = UnionTransfer(dsts, tuple(plain), frozenset(consts), tuple(scaled),
                          frozenset(with_flag(sconsts, 2)) if sconsts else EMPTY, strong, offset_rule(op, mods), idx)
        self._add(t, dsts, plain + scaled if scaled else plain, ranged=tracks_range(op, mods))

    # ------------------------------------------------------------------ memory instructions
    def _load(self, idx: int, ins: Instruction) -> None:
        ops = ins.operands
        if len(ops) < 2 or not ops[1].startswith("["):
            self.accesses[idx] = "unknown"
            return
        sid = ins.scope
        names = self.names
        space, _, size = memory_type(ins)
        d0 = ops[0]
        if d0[0] == "%" and sid == 0 and "|" not in d0 and (d0, 0) not in self.fn.decls:
            dsts = [[d0]]
        else:
            dsts = [names.destinations(e, sid) for e in elements(d0)]
        a = ops[1]
        if a[1:2] == "%" and "+" not in a and "," not in a and "-" not in a:
            base, off = a[1:-1], 0                  # the common `[%rd5]`
        else:
            base, off = address_parts(a)
        if space == "param" and base is not None and self._param_load(names.resolve(base, sid), dsts, off, size):
            return
        keys: list = []
        if base is None:
            consts = EMPTY
        elif sid == 0 and base[0] == "%" and base not in names.local_regs:
            keys.append(base)
            consts = EMPTY
        else:
            cs: set = set()
            names.source(base, sid, keys, cs)
            consts = frozenset(cs)
        if space == "global" or space == "generic":
            srcs = keys + ["$local", "$shared"]
            self.accesses[idx] = "ld"
        elif space == "local":
            srcs = keys + ["$local"]
        elif space == "shared":
            srcs = keys + ["$shared"]
        else:
            srcs = keys
        t = _new(LoadTransfer, (dsts, space, tuple(keys), consts, off, size))
        if space == "global" or space == "generic":
            self.global_loads[idx] = t
        # _add, inlined (loads are frequent): a load defines no integer range and always seeds
        for d in dsts:
            for k in d:
                self.top_keys.add(k)
        ti = len(self.transfers)
        self.seeds.append(ti)
        self.transfers.append(t)
        users = self.users
        for k in srcs:
            users[k].append(ti)

    def _param_load(self, r: Resolved, dsts: list[list], off: int, size: int) -> bool:
        """A load from a parameter of the function, or from a call-sequence cell; False for neither."""
        kind, value = r
        if kind == "fparam":
            self.loaded_params.add(value)
            flag = self.pflag[value]
            for k, d in enumerate(dsts):
                if d:
                    # _add, inlined (parameter loads are frequent): a constant, so a seed that reads nothing
                    self.top_keys.update(d)
                    self.seeds.append(len(self.transfers))
                    self.transfers.append(_new(UnionTransfer, (d, (), frozenset({("P", value, off + k * size, flag)}),
                                                               (), EMPTY, False, 0, -1)))
            return True
        if kind in ("cell", "fret"):
            key = value if kind == "cell" else ReturnCell(value)
            for k, d in enumerate(dsts):
                if d:
                    cells = [_new(Cell, (key, off + k * size)), _new(Cell, (key, None))]
                    self._add(UnionTransfer(d, tuple(cells), EMPTY, (), EMPTY, False, 0, -1), d, cells)
            return True
        return False

    def _store(self, idx: int, ins: Instruction) -> None:
        ops = ins.operands
        if len(ops) < 2 or not ops[0].startswith("["):
            self.accesses[idx] = "unknown"
            return
        sid = ins.scope
        names = self.names
        space, vec, size = memory_type(ins)
        if space == "global":
            # a global store cannot put a value into local or shared memory: only the site matters
            self.accesses[idx] = "st"
            return
        if "async" in ins.modifiers:
            space = "shared"            # st.async writes remote shared memory of the cluster
        vals = []
        for e in elements(ops[1]):
            ks: list = []
            cs: set = set()
            names.source(e, sid, ks, cs)
            vals.append((tuple(ks), frozenset(cs)))
        base, off = address_parts(ops[0])
        if space == "param" and base is not None:
            r = names.resolve(base, sid)
            if r.kind in ("cell", "fret"):
                self._cell_store(r.value if r.kind == "cell" else ReturnCell(r.value), vals, off, size)
            return
        keys, consts, aoff = names.address(ops[0], sid)
        allk = [k for ks, _ in vals for k in ks]
        allc = frozenset(c for _, cs in vals for c in cs)
        self._add(StoreTransfer(space, tuple(keys), consts, tuple(allk), allc, aoff, vec * size), [],
                  list(keys) + allk)
        if space in ("global", "generic"):
            self.accesses[idx] = "st"

    def _cell_store(self, key: object, vals: list[tuple[tuple, frozenset]], off: int, size: int) -> None:
        """`st.param` of the elements `vals` (keys, constants) into a call-sequence cell or a return."""
        offs = self.cell_offsets.setdefault(key, set())
        for k, (ks, cs) in enumerate(vals):
            offs.add(off + k * size)
            cell = _new(Cell, (key, off + k * size))
            self._add(UnionTransfer([cell], ks, cs, (), EMPTY, False, 0, -1), [cell], list(ks))

    def _atom(self, idx: int, ins: Instruction) -> None:
        ops = ins.operands
        sid = ins.scope
        names = self.names
        space = space_of(ins.modifiers)
        if "async" in ins.modifiers:
            space = "shared"
        ai = 1 if ins.opcode == "atom" else 0
        if len(ops) <= ai or not ops[ai].startswith("["):
            self.accesses[idx] = "unknown"
            return
        keys, consts, off = names.address(ops[ai], sid)
        vk: list = []
        vc: set = set()
        for o in ops[ai + 1:]:
            names.source(o, sid, vk, vc)
        if ai == 1:
            dsts = [names.destinations(e, sid) for e in elements(ops[0])]
            srcs = list(keys) + ["$local", "$shared"]
            self._add(LoadTransfer(dsts, space, tuple(keys), consts, off, 0), [k for d in dsts for k in d], srcs)
        if vk or vc:
            vec, size = type_info(ins.modifiers)
            self._add(StoreTransfer(space, tuple(keys), consts, tuple(vk), frozenset(vc), off, vec * size), [],
                      list(keys) + vk)
        if space in ("global", "generic"):
            self.accesses[idx] = ins.opcode

    def _copy(self, idx: int, ins: Instruction) -> None:
        """cp.async and bulk copies: only those touching global memory matter."""
        mods = ins.modifiers
        ops = ins.operands
        if "global" not in mods or not ops:
            return
        if "tensor" in mods:
            self.accesses[idx] = "cp-tensor"
            if "shared" in "".join(mods) and "prefetch" not in mods and "reduce" not in mods \
                    and first_space(mods) != "global":
                self._add(SharedCopyTransfer((), EMPTY, True), [], [])
            return
        if "prefetch" in mods:
            return
        self.accesses[idx] = "cp"
        if first_space(mods) != "global" and len(ops) > 1 and ops[1].startswith("["):
            keys, consts, _ = self.names.address(ops[1], ins.scope)
            self._add(SharedCopyTransfer(keys, consts, False), [], list(keys) + ["$local", "$shared"])

    def _multimem(self, idx: int, ins: Instruction) -> None:
        mods = ins.modifiers
        ops = ins.operands
        if mods and mods[0] == "ld_reduce" and len(ops) >= 2:
            sid = ins.scope
            dsts = [self.names.destinations(e, sid) for e in elements(ops[0])]
            keys, consts, off = self.names.address(ops[1], sid)
            self._add(LoadTransfer(dsts, "global", tuple(keys), consts, off, 0), [k for d in dsts for k in d],
                      list(keys))
        self.accesses[idx] = "multimem"

    def _texture(self, idx: int, ins: Instruction) -> None:
        ops = ins.operands
        if ins.opcode in ("tex", "tld4", "suld") and ops:
            # texel values come from memory behind a descriptor: treat them as loaded
            dsts = [self.names.destinations(e, ins.scope) for e in elements(ops[0].split("|")[0])]
            flat = [k for d in dsts for k in d]
            self._add(UnknownTransfer(flat), flat, [])
        if ins.opcode in ("txq", "suq"):
            return
        self.accesses[idx] = "tex"

    def _misc_memory(self, idx: int, ins: Instruction) -> None:
        """Prefetches, discard, tensormap and wmma fragment loads and stores."""
        op = ins.opcode
        if op == "wmma":
            sid = ins.scope
            ops = ins.operands
            if ins.modifiers[0] == "load" and len(ops) >= 2:
                dsts = [self.names.destinations(e, sid) for e in elements(ops[0])]
                keys, consts, off = self.names.address(ops[1], sid)
                self._add(LoadTransfer(dsts, space_of(ins.modifiers), tuple(keys), consts, off, 0),
                          [k for d in dsts for k in d], list(keys) + ["$local", "$shared"])
        self.accesses[idx] = op

    # ------------------------------------------------------------------ calls
    def _call(self, idx: int, ins: Instruction) -> None:
        ops = ins.operands
        sid = ins.scope
        names = self.names
        rets: list[str] = []
        i = 0
        if ops and ops[0].startswith("("):
            rets = [x.strip() for x in ops[0][1:-1].split(",") if x.strip()]
            i = 1
        if i >= len(ops):
            return
        callee = ops[i]
        args: list[str] = []
        if i + 1 < len(ops) and ops[i + 1].startswith("("):
            args = [x.strip() for x in ops[i + 1][1:-1].split(",") if x.strip()]
        resolved_callee = names.resolve(callee, sid)
        summary = self.summary_for(callee, resolved_callee)
        srcs: list = ["$local", "$shared"]
        argspecs = [self._call_arg(a, sid, srcs) for a in args]
        retspecs = [r for r in (names.resolve(rname, sid) for rname in rets) if r.kind in ("cell", "reg")]
        callee_reg = None
        if summary.unknown is not None and resolved_callee.kind == "reg":
            callee_reg = resolved_callee.value
        t = CallTransfer(summary, argspecs, retspecs, ins.line, callee_reg, idx)
        self._add(t, [r.value for r in retspecs if r.kind == "reg"], srcs)
        self.calls.append(t)

    def _call_arg(self, a: str, sid: int, srcs: list) -> CallArg:
        """What an argument passes; the keys it reads are added to `srcs`."""
        if is_immediate(a):
            return CallArg("imm")
        r = self.names.resolve(a, sid)
        if r.kind == "cell":
            cells = [Cell(r.value, o) for o in sorted(self.cell_offsets.get(r.value, set()))]
            srcs.extend(cells)
            return CallArg("cells", cells)
        if r.kind == "reg":
            srcs.append(r.value)
            return CallArg("reg", r.value)
        if r.kind == "fparam":
            return CallArg("const", {("A", r.value, 0, 1)})
        if r.kind == "orig":
            return CallArg("const", {r.value})
        return CallArg("imm")


# opcodes with a classification of their own; plain functions, not bound methods, so that a
# FunctionTransfers holds no reference cycle (the analysis runs with the garbage collector off)
_SPECIAL: dict[str, Callable[[FunctionTransfers, int, Instruction], None]] = {
    "ld": FunctionTransfers._load, "ldu": FunctionTransfers._load, "st": FunctionTransfers._store,
    "atom": FunctionTransfers._atom, "red": FunctionTransfers._atom, "call": FunctionTransfers._call,
    "cp": FunctionTransfers._copy, "multimem": FunctionTransfers._multimem,
    **{op: FunctionTransfers._texture for op in _TEXTURE_OPS},
}
