"""From the summary of an `.entry` to its `KernelAccess`: which parameter each access belongs to.

Attribution, at each global or generic access site, of the address origins:

- the *base* candidates are the non-index origins (flag != 2); if some are definite addresses
  (flag 1) only those are kept (the others are offsets added to a known pointer); if only index-like
  origins are left they are all kept. Ambiguous sums (two plain 64-bit values added) charge both;
- a ``P`` base gives the parameter (or the struct field at that offset) the site's access: `ld`,
  `ldu`, `cp.async` and bulk-copy sources, `multimem.ld_reduce`, `tex`/`suld` read; `st`, bulk-copy
  destinations, `multimem.st`, `sust`, `discard`, `tensormap.replace` write; `atom`, `red`,
  `cp.reduce.*`, `multimem.red`, `sured` and unrecognised instructions read-write; prefetches none;
- INDIRECT RULE. An ``L`` base means the address itself was loaded from memory (a table of
  pointers, a linked list). That access belongs to no parameter (the buffers it reaches are not
  arguments): the parameter the pointer was loaded from is marked `indirect` (its own access is the
  load of the pointer: `read`), its `indirect_access` records what was done through the loaded
  pointers, and the kernel is `indirect` with `KernelAccess.indirect_access` the union of all such
  accesses. A consumer must treat an indirect kernel as touching memory beyond its arguments. With
  `analyze_module(..., alias_loaded=True)` these accesses are also given to every parameter that
  may hold a pointer ("may alias any argument"). ``U`` bases (unknown address: returned by unknown
  code, or of no traceable origin) are handled the same way, without a parameter to mark;
- an ``L`` that is only part of the index (a gather `x[idx[i]]`, a histogram `h[keys[i]]`) marks the
  parameter the index was loaded from, and the kernel, `indirect`; the base gets the access exactly;
- accesses whose address is only shared/local/param memory or module globals are not arguments and
  are not reported.
"""

from __future__ import annotations

from typing import NamedTuple

from tessera.capture.ptx.instructions import OPAQUE_TYPES
from tessera.capture.ptx.origins import select_base
from tessera.capture.ptx.parse import Function, Module
from tessera.capture.ptx.results import ACCESSES, READ, FieldAccess, KernelAccess, ParamAccess
from tessera.capture.ptx.summary import Effect, Summary

__all__ = ["conservative_access", "kernel_access"]


class Reason(NamedTuple):
    """An access mode and why it was given."""

    mode: int
    text: str


class _ParamState:
    """What has been found about one parameter (or one 8-byte field of a by-value struct)."""

    __slots__ = ("mode", "reasons", "indirect", "ind_reason", "ind_mode", "fields", "tmap", "tmap_reason",
                 "used", "hint")

    def __init__(self) -> None:
        self.mode = 0
        self.reasons: list[Reason] = []
        self.indirect = False
        self.ind_reason = ""
        self.ind_mode = 0
        self.fields: dict[int, _ParamState] = {}
        self.tmap = False
        self.tmap_reason = ""
        self.used = False
        self.hint = ""

    def add(self, mode: int, reason: str) -> None:
        self.used = True
        if mode & ~self.mode:
            self.reasons.append(Reason(mode & ~self.mode, reason))
            self.mode |= mode

    def reason(self) -> str:
        return "; ".join([r.text for r in self.reasons])


def kernel_access(module: Module, fn: Function, summary: Summary, alias_loaded: bool) -> KernelAccess:
    """The per-parameter accesses of kernel `fn`, from its summary."""
    att = _Attribution(module, fn, summary)
    att.run()
    triton_style = any(p.ptr for p in fn.params)
    out = [att.param(i, triton_style, alias_loaded) for i in range(len(fn.params))]
    unexplained = 0
    for r in att.alias:
        unexplained |= r.mode
    return KernelAccess(fn.name, module.file, bool(att.alias) or any(p.indirect for p in out), out, module.target,
                        fn.start_line, ACCESSES[unexplained], [r.text for r in att.alias[:8]])


def conservative_access(module: Module, fn: Function, reason: str) -> KernelAccess:
    """The answer for a kernel that could not be analysed: whatever may hold a pointer is read-write."""
    params = []
    for i, p in enumerate(fn.params):
        if p.type in OPAQUE_TYPES:
            params.append(ParamAccess(i, p.name, "descriptor", "read-write", True, reason))
        elif p.array is not None and p.size >= 8:
            params.append(ParamAccess(i, p.name, "struct", "read-write", True, reason,
                                      [FieldAccess(o, "read-write", True, reason) for o in range(0, p.size - 7, 8)]))
        elif p.size >= 8 or p.ptr:
            params.append(ParamAccess(i, p.name, "pointer", "read-write", True, reason))
        else:
            params.append(ParamAccess(i, p.name, "scalar", "none", False, f"scalar .{p.type}"))
    return KernelAccess(fn.name, module.file, True, params, module.target, fn.start_line, "read-write", [reason])


class _Attribution:
    """Turns an entry's effects into per-parameter accesses (see the module docstring's rules)."""

    __slots__ = ("module", "fn", "summary", "params", "st", "alias", "is_agg")

    def __init__(self, module: Module, fn: Function, summary: Summary) -> None:
        self.module = module
        self.fn = fn
        self.summary = summary
        self.params = fn.params
        self.st = [_ParamState() for _ in fn.params]
        self.alias: list[Reason] = []     # accesses through addresses that no parameter explains
        self.is_agg = [p.array is not None and p.type not in OPAQUE_TYPES for p in fn.params]

    def target(self, i, off) -> list[_ParamState]:
        """The state(s) an origin (parameter i, byte offset off) stands for: the parameter, or fields."""
        if i is None or i >= len(self.params):
            return []
        s = self.st[i]
        if not self.is_agg[i]:
            return [s]
        if off is None:
            return [s.fields.setdefault(o, _ParamState()) for o in range(0, max(self.params[i].size - 7, 1), 8)]
        # a narrower piece belongs to the 8-byte slot holding it (pointers are 8-byte aligned)
        return [s.fields.setdefault(off - off % 8, _ParamState())]

    def mark_ind(self, i, off, mode: int, reason: str) -> None:
        """Parameter i's memory supplied an address (mode: what was done through it; 0 for an index)."""
        if i is None or i >= len(self.params):
            return
        for s in [self.st[i], *(self.target(i, off) if self.is_agg[i] else [])]:
            s.ind_mode |= mode
            if not s.indirect:
                s.indirect = True
                s.ind_reason = reason

    def run(self) -> None:
        for e in self.summary.effects:
            if e.role == "addr":
                self._address(e)
            elif e.role in ("tmap", "tex"):
                self._descriptor(e)
            else:
                self._escape(e)

    def _address(self, e: Effect) -> None:
        base = select_base(e.origins)
        for o in base:
            k = o[0]
            if k == "P":
                for s in self.target(o[1], o[2]):
                    s.add(e.mode, e.reason)
                    if not e.mode and not s.hint:
                        s.hint = f"{e.reason} (no data access)"
            elif not e.mode:
                continue                    # a prefetch through a loaded or unknown address
            elif k == "L":
                self.mark_ind(o[1], o[2], e.mode, f"pointers loaded from it are dereferenced ({e.reason})")
                self.alias.append(Reason(e.mode, f"{e.reason} through an address loaded from memory"))
            elif k == "U":
                self.alias.append(Reason(e.mode, f"{e.reason} through an address of unknown origin"))
        for o in e.origins:
            if o[0] == "L" and o not in base and o[1] is not None:
                self.mark_ind(o[1], o[2], 0, f"values loaded from it index {e.reason}")

    def _descriptor(self, e: Effect) -> None:
        for o in e.origins:
            k, i = o[0], o[1]
            if k in ("A", "P") and i is not None and i < len(self.params):
                self._descriptor_param(e, k, i)
            elif k in ("L", "U", "G"):
                if k == "L":
                    self.mark_ind(i, o[2], e.mode, f"tensor map address loaded from it ({e.reason})")
                if e.mode or k != "L":
                    self.alias.append(Reason(e.mode, f"{e.reason} through a descriptor that is not an argument"))

    def _descriptor_param(self, e: Effect, k: str, i: int) -> None:
        s = self.st[i]
        s.tmap = True
        s.tmap_reason = s.tmap_reason or e.reason
        s.used = True
        if e.mode:
            s.add(e.mode, e.reason)
        if k == "P" and not self.is_agg[i] and e.role == "tmap":
            # a pointer to a tensor map in memory: the map is read from the parameter's memory, and
            # the tensor it describes is chosen by memory contents
            s.add(READ, f"{e.reason} (tensor map read from memory)")
            self.mark_ind(i, None, e.mode, f"tensor map loaded from it ({e.reason})")
            if e.mode:
                self.alias.append(Reason(e.mode, f"{e.reason} through a tensor map in memory"))

    def _escape(self, e: Effect) -> None:
        """Values handed to code that cannot be analysed."""
        narrow = (self.module.address_size or 64) == 64
        for o in e.origins:
            k, i = o[0], o[1]
            if k in ("P", "A") and i is not None and i < len(self.params):
                if k == "P" and not self.is_agg[i] and self.params[i].size < 8 and narrow:
                    continue                # a 32-bit value cannot be a pointer
                for s in self.target(i, o[2] if k == "P" else None):
                    s.add(e.mode, e.reason)
            elif k == "L":
                self.mark_ind(i, o[2], e.mode, f"pointers loaded from it are {e.reason}")
                self.alias.append(Reason(e.mode, f"pointer loaded from memory {e.reason}"))
            elif k == "U":
                self.alias.append(Reason(e.mode, f"pointer of unknown origin {e.reason}"))

    def _kind(self, i: int, triton_style: bool) -> str:
        p, s = self.params[i], self.st[i]
        if p.type in OPAQUE_TYPES or s.tmap:
            return "descriptor"
        if self.is_agg[i]:
            if s.fields:
                return "struct"
            if p.size == 128 and (p.align or 0) >= 64 and not s.used:
                return "descriptor"         # shaped like a CUtensorMap, unused
            return "scalar"
        if s.mode or s.indirect or p.ptr or s.used:
            return "pointer"
        if p.size == 8 and i not in self.summary.loaded_params and not triton_style:
            return "pointer"                # never read: an 8-byte parameter of unknown type
        return "scalar"

    def param(self, i: int, triton_style: bool, alias_loaded: bool) -> ParamAccess:
        """The access of parameter i."""
        p, s = self.params[i], self.st[i]
        kind = self._kind(i, triton_style)
        if alias_loaded and self.alias and (kind != "scalar" or (self.is_agg[i] and p.size >= 8)
                                            or (p.size == 8 and not triton_style)):
            if kind == "scalar":
                kind = "struct" if self.is_agg[i] else "pointer"
            self._alias_everything(s)
        fields = self._fields(s) if kind == "struct" else []
        if kind == "scalar":
            reason = f"scalar .{p.type}" + (f"[{p.array}]" if p.array is not None else "")
            return ParamAccess(i, p.name, kind, "none", s.indirect, reason, fields, ACCESSES[s.ind_mode])
        return ParamAccess(i, p.name, kind, ACCESSES[s.mode], s.indirect, self._reason(s, kind), fields,
                           ACCESSES[s.ind_mode])

    def _alias_everything(self, s: _ParamState) -> None:
        """alias_loaded: every unexplained access may have gone through this parameter."""
        for r in self.alias:
            s.add(r.mode, f"{r.text} (may alias any argument)")
            for f in s.fields.values():
                f.add(r.mode, f"{r.text} (may alias any argument)")

    @staticmethod
    def _fields(s: _ParamState) -> list[FieldAccess]:
        """The fields of a struct parameter; their accesses and reasons are also the struct's."""
        fields = []
        for off in sorted(s.fields):
            f = s.fields[off]
            s.mode |= f.mode
            for r in f.reasons:
                if r not in s.reasons:
                    s.reasons.append(r)
            fields.append(FieldAccess(off, ACCESSES[f.mode], f.indirect, f.reason() or f.ind_reason or "never dereferenced"))
        return fields

    @staticmethod
    def _reason(s: _ParamState, kind: str) -> str:
        reason = s.reason()
        if not reason:
            if kind == "descriptor":
                reason = s.tmap_reason or "tensor map never used"
                if s.tmap_reason and not s.mode:
                    reason += " (no data access)"
            else:
                reason = s.ind_reason if s.indirect else (s.hint or "never dereferenced")
        elif s.indirect and s.ind_reason not in reason:
            reason = f"{reason}; {s.ind_reason}"
        return reason
