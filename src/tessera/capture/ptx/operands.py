"""What the names and operands of a PTX function stand for, in the terms of its dataflow.

A name resolves, through the function's nested `{ }` scopes and then the module's symbols, to a
register, a parameter of the function, a return parameter, a call-sequence `.param` cell, or a
constant origin (the address of a local, shared or global variable, or of a function). An operand
is then a register key to read, a constant origin, an integer, or nothing the dataflow tracks.
Both are cached per (text, scope).
"""

from __future__ import annotations

from typing import NamedTuple

from tessera.capture.ptx.instructions import address_parts, elements
from tessera.capture.ptx.origins import LOCAL_ANYWHERE, MODULE_GLOBAL, SHARED, Origin
from tessera.capture.ptx.parse import Function, parse_int

__all__ = ["NOTHING", "Cell", "Operand", "OperandResolver", "Resolved", "ReturnCell"]


class Resolved(NamedTuple):
    """What a name means: `kind` "reg" (`value` the register key), "fparam" / "fret" (the index of a
    parameter / return parameter of the function), "cell" (the key of a call-sequence `.param`
    variable) or "orig" (a constant origin)."""

    kind: str
    value: object


class Operand(NamedTuple):
    """A scalar operand: `kind` "k" (`value` a register key), "c" (a constant origin), "i" (an
    integer) or "n" (nothing tracked: a vector, an address, a sink)."""

    kind: str
    value: object = None


class Cell(NamedTuple):
    """The dataflow key of the bytes at `offset` (None: anywhere) of a `.param` variable or return."""

    name: object        # the variable's key, or a ReturnCell
    offset: int | None


class ReturnCell(NamedTuple):
    """The key of return parameter `index` of the function, as a `.param` variable."""

    index: int


NOTHING = Operand("n")


class OperandResolver:
    """Resolves the names and operands of one function (cached), and allocates its local variables'
    windows of the local offset space."""

    __slots__ = ("fn", "symbols", "params", "rets", "local_regs", "resolved", "operands", "local_base",
                 "saw_address")

    def __init__(self, fn: Function, symbols: dict[str, str]) -> None:
        self.fn = fn
        self.symbols = symbols
        self.params = {p.name: i for i, p in enumerate(fn.params)}
        self.rets = {p.name: i for i, p in enumerate(fn.returns)}
        # '%' names that something declares in the function scope (rare): resolved the slow way
        self.local_regs = {name for (name, sid) in fn.decls if sid == 0 and name[:1] == "%"}
        self.resolved: dict[tuple[str, int], Resolved] = {}
        self.operands: dict[tuple[str, int], Operand] = {}
        self.local_base: dict[str, int] = {}
        self.saw_address = False        # some operand is a parameter (A) or local (C) address

    def resolve(self, name: str, sid: int) -> Resolved:
        """What `name` means in scope `sid`."""
        ck = (name, sid)
        r = self.resolved.get(ck)
        if r is not None:
            return r
        fn = self.fn
        if not name:
            r = _shared_resolved("reg", "")
        elif name[0] == "%" and sid == 0 and (name, 0) not in fn.decls:
            r = _shared_resolved("reg", name)
        else:
            r = self._declared(name, sid)
            if r is None:
                r = self._undeclared(name)
        self.resolved[ck] = r
        return r

    def _undeclared(self, name: str) -> Resolved:
        """A name no scope declares: a parameter, a return parameter, or a module symbol."""
        if name in self.params:
            return _shared_resolved("fparam", self.params[name])
        if name in self.rets:
            return _shared_resolved("fret", self.rets[name])
        kind = self.symbols.get(name)
        if kind is None:
            return _shared_resolved("reg", name)
        if kind == "shared":
            return _shared_resolved("orig", SHARED)
        if kind == "local":
            return _shared_resolved("orig", self.local_var(name))
        if kind in ("func", "extern-func", "bad-func"):
            return _shared_resolved("orig", ("F", name, None, 1))
        return _shared_resolved("orig", MODULE_GLOBAL)

    def _declared(self, name: str, sid: int) -> Resolved | None:
        """The innermost declaration of `name` in scope `sid` or its parents, if any."""
        fn = self.fn
        s = sid
        while True:
            sp = fn.decls.get((name, s))
            if sp is None and s in fn.range_decls:
                for prefix, n in fn.range_decls[s]:
                    if name.startswith(prefix) and name[len(prefix):].isdigit() and int(name[len(prefix):]) < n:
                        sp = "reg"
                        break
            if sp is not None:
                key = name if s == 0 else f"{name}@{s}"
                if sp == "reg":
                    return _shared_resolved("reg", key)
                if sp == "param":
                    return _shared_resolved("cell", key)
                if sp == "local":
                    return _shared_resolved("orig", self.local_var(key))
                if sp == "shared":
                    return _shared_resolved("orig", SHARED)
                return _shared_resolved("orig", MODULE_GLOBAL)
            if s == 0:
                return None
            s = fn.scope_parent[s]

    def local_var(self, name: str) -> Origin:
        """The address of a local variable: its own 4 GiB window of the local offset space."""
        base = self.local_base.get(name)
        if base is None:
            base = self.local_base[name] = len(self.local_base) << 32
        return ("C", base, base, 1)

    def is_plain_register(self, op: str, sid: int) -> bool:
        """Whether `op` is a function-scope register, its own key (the common case)."""
        return sid == 0 and op[:1] == "%" and op not in self.local_regs and "+" not in op

    def operand(self, op: str, sid: int) -> Operand:
        """What a scalar operand stands for."""
        ck = (op, sid)
        r = self.operands.get(ck)
        if r is None:
            r = _shared_operand("k", op) if self.is_plain_register(op, sid) else self._operand(op, sid)
            self.operands[ck] = r
        return r

    def _operand(self, op: str, sid: int) -> Operand:
        c = op[0] if op else ""
        if not op or op == "_" or c in "[{":
            return NOTHING
        if c.isdigit() or c == "-":
            return _immediate(op)
        name = op[1:] if c == "!" else op
        base, off = name, 0
        if "+" in name:
            base, _, o = name.partition("+")
            off = parse_int(o) or 0
            base = base.strip()
        res = self.resolve(base, sid)
        if res.kind == "reg":
            return _shared_operand("k", res.value)
        if res.kind == "fparam":
            self.saw_address = True
            return _shared_operand("c", ("A", res.value, off, 1))
        if res.kind == "orig":
            o = res.value
            if off and o[0] == "C" and o[1] is not None:
                o = ("C", o[1] + off, o[2] + off, 1)
            if o[0] == "C":
                self.saw_address = True
            return _shared_operand("c", o)
        self.saw_address = True         # the address of a call-sequence .param cell
        return _shared_operand("c", LOCAL_ANYWHERE)

    def source(self, op: str, sid: int, keys: list, consts: set) -> None:
        """Add the register keys / constant origins of a source operand to `keys` / `consts`."""
        if sid == 0 and op[:1] == "%" and op not in self.local_regs and "+" not in op:
            keys.append(op)             # is_plain_register, inlined: this is the hottest call
            return
        if op and op[0] == "{":
            for e in elements(op):
                self.source(e, sid, keys, consts)
            return
        r = self.operand(op, sid)
        if r.kind == "k":
            keys.append(r.value)
        elif r.kind == "c":
            consts.add(r.value)

    def destinations(self, op: str, sid: int) -> list:
        """The register keys a destination operand (plain, vector, or `a|b`) writes."""
        if op and op[0] == "%" and "|" not in op:
            if self.is_plain_register(op, sid):
                return [op]
            r = self.operand(op, sid)
            return [r.value] if r.kind == "k" else []
        out = []
        for e in elements(op):
            if e == "_" or not e or e[0] == "[":
                continue
            r = self.operand(e, sid)
            if r.kind == "k":
                out.append(r.value)
        return out

    def address(self, op: str, sid: int) -> tuple[list, frozenset, int]:
        """(register keys, constant origins, immediate offset) of a bracketed address operand."""
        base, off = address_parts(op)
        keys: list = []
        consts: set = set()
        if base is not None:
            self.source(base, sid, keys, consts)
        return keys, frozenset(consts), off


# Resolved names and operands are plain values: each is made once and shared by all functions (making
# a record costs several times a dictionary look-up, and most recur across functions)
_RESOLVED: dict[tuple, Resolved] = {}
_OPERANDS: dict[tuple, Operand] = {}
_IMMEDIATES: dict[str, Operand] = {}        # by operand text
_SHARED_LIMIT = 65536


def _shared_resolved(kind: str, value: object) -> Resolved:
    r = _RESOLVED.get((kind, value))
    if r is None:
        r = Resolved(kind, value)
        if len(_RESOLVED) < _SHARED_LIMIT:
            _RESOLVED[r] = r
    return r


def _shared_operand(kind: str, value: object) -> Operand:
    r = _OPERANDS.get((kind, value))
    if r is None:
        r = Operand(kind, value)
        if len(_OPERANDS) < _SHARED_LIMIT:
            _OPERANDS[r] = r
    return r


def _immediate(op: str) -> Operand:
    r = _IMMEDIATES.get(op)
    if r is None:
        v = parse_int(op)
        r = _shared_operand("i", v) if v is not None else NOTHING
        if len(_IMMEDIATES) < _SHARED_LIMIT:
            _IMMEDIATES[op] = r
    return r
