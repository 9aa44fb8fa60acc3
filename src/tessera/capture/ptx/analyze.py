"""Per-parameter read/write sets of PTX kernels: which kernel arguments reach a global access.

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

Shared memory is one abstract cell (`$shared`): a store adds the stored value's origins, a load
reads them back. Local memory (`$local`) keeps the byte span of every store: local addresses carry
an offset range (``C`` origins, each local variable in its own window), integer registers carry a
value range (constants, masks, shifts, sums), so a load from `ptrs[k & 1]` reads back only the
pointers stored in that array (nvcc spills arrays of pointers indexed at run time to local memory).
A load from global memory yields ``L`` of the parameters its address derives from.

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

Calls to `.func` bodies are analysed once per callee (a summary in terms of the callee's
parameters, with a recursion guard) and mapped into the caller through the `st.param` stores of the
call sequence. Unknown callees (extern, indirect `call %rd`, recursive, or a body that failed to
parse) make every pointer argument (and pointers stored in a local buffer passed to them)
read-write. Unrecognised instructions with a bracketed address derived from a parameter are
read-write with a reason; nothing reachable is ever reported as `none`.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from dataclasses import dataclass, field

from tessera.capture.ptx.parse import TYPE_SIZES, Function, Module, PtxSyntaxError, parse_int, parse_ptx

__all__ = [
    "ACCESSES", "KINDS", "AccessSite", "FieldAccess", "KernelAccess", "ParamAccess", "access_sites",
    "analyze_module", "analyze_ptx",
]

ACCESSES = ("none", "read", "write", "read-write")
KINDS = ("pointer", "scalar", "descriptor", "struct")

_R, _W, _RW = 1, 2, 3          # access bitmasks; ACCESSES[mask] is the name
_VERB = {0: "does not access", 1: "reads", 2: "writes", 3: "reads and writes"}


@dataclass
class FieldAccess:
    """The access through the pointer stored at byte `offset` of a by-value struct parameter."""

    offset: int
    access: str
    indirect: bool
    reason: str


@dataclass
class ParamAccess:
    """How a kernel uses one parameter."""

    index: int
    name: str
    kind: str
    access: str
    indirect: bool
    reason: str
    fields: list[FieldAccess] = field(default_factory=list)
    indirect_access: str = "none"   # access made through pointers loaded from this parameter's memory

    def to_json(self) -> dict:
        """The JSON form of the issue: index, name, kind, access, indirect, reason, fields."""
        return {"index": self.index, "name": self.name, "kind": self.kind, "access": self.access,
                "indirect": self.indirect, "reason": self.reason,
                "fields": [{"offset": f.offset, "access": f.access} for f in self.fields]}


@dataclass
class KernelAccess:
    """The analysis of one `.entry`: every parameter, in declaration order."""

    name: str
    file: str
    indirect: bool
    params: list[ParamAccess]
    target: str | None = None
    line: int = 0
    indirect_access: str = "none"   # union of the accesses through addresses no parameter explains
    indirect_reasons: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """The JSON form of the issue: name, file, indirect, params."""
        return {"name": self.name, "file": self.file, "indirect": self.indirect,
                "params": [p.to_json() for p in self.params]}


@dataclass
class AccessSite:
    """One global or generic memory access instruction of a function (one per global operand)."""

    function: str
    line: int
    opcode: str
    space: str
    mode: str
    address: str
    width: int
    params: list[int]
    predicate: str | None
    instrumentable: bool
    reason: str
    index: int = 0          # position of the instruction in Function.body
    operand: int = 0        # which operand holds the address


# --------------------------------------------------------------------------------------------------
# origins

_OPAQUE = ("texref", "samplerref", "surfref")
_U = ("U", None, None, 0)
_LNONE = ("L", None, None, 0)
_G = ("G", None, None, 1)
_S = ("S", None, None, 1)
_C = ("C", None, None, 1)           # somewhere in local memory
_H = ("H", None, None, 1)
_SH = ("SH", None, None, 0)
_EMPTY: frozenset = frozenset()
_NSPEC = ("n",)
_NONGLOBAL = {"S", "C", "A"}     # address kinds that are never global memory
_COLLAPSE_AT = 48
_RMAX = 1 << 40                         # integer ranges beyond this are treated as unbounded
# integer operations whose result range is tracked (to bound offsets into local arrays of pointers)
# build() fast path: 0 = no provenance and no memory; 1 = union of the sources; 2 = index-like result;
# opcodes not listed (memory, calls, mad, selp, cvta, anything unknown) go through _classify
_FAST_CLASS = {op: 0 for op in ("setp", "set", "testp", "isspacep", "vote", "activemask", "istypep", "bar",
                                "barrier", "membar", "fence", "griddepcontrol", "setmaxnreg", "nanosleep",
                                "pmevent", "trap", "brkpt", "exit", "ret", "bra", "brx", "createpolicy",
                                "elect", "ldmatrix", "stmatrix", "movmatrix", "wgmma", "tcgen05", "mma",
                                "match", "mbarrier")}
_FAST_CLASS.update({op: 1 for op in ("mov", "add", "sub", "and", "or", "xor", "not", "neg", "abs", "min",
                                     "max", "shr", "div", "rem", "fma", "rcp", "sqrt", "rsqrt", "ex2", "lg2",
                                     "sin", "cos", "tanh", "copysign", "bfe", "bfi", "prmt", "popc", "clz",
                                     "brev", "bfind", "shf", "addc", "subc", "cnot", "lop3", "fns",
                                     "shfl", "redux")})
_FAST_CLASS.update({op: 2 for op in ("mul", "mul24", "shl", "dp4a", "dp2a", "cvt")})  # cvt: 2 only if widening
_FAST_CLASS.update({"cvta": 3, "selp": 4, "slct": 4, "mad": 5, "mad24": 5})
_SPECIAL_REGS = {"%laneid", "%warpid", "%nwarpid", "%smid", "%nsmid", "%gridid", "%clock", "%clock64",
                  "%globaltimer", "%lanemask_eq", "%lanemask_le", "%lanemask_lt", "%lanemask_ge",
                  "%lanemask_gt", "%total_smem_size", "%dynamic_smem_size", "%aggr_smem_size",
                  "%is_explicit_cluster", "%cluster_ctarank", "%cluster_nctarank", "%current_graph_exec"}
_KEEP_OFFSET = {"mov", "cvta", "cvt", "selp", "slct"}
_ADJ = {**{op: 0 for op in _KEEP_OFFSET}, "add": 1, "sub": 1, "mad": 1}
_RANGE_OPS = {"mov", "cvt", "and", "or", "add", "sub", "shl", "shr", "mul", "mad", "rem", "min", "max",
              "selp", "bfe"}


def _with_flag(origins, flag: int) -> set:
    return {(o[0], o[1], o[2], flag) for o in origins}


def _collapse(s: set) -> set:
    """Forget byte offsets when a set grows (pointer increments through a parameter address)."""
    out = set()
    for o in s:
        k = o[0]
        if k in ("A", "P", "L"):
            out.add((k, o[1], None, o[3]))
        elif k == "C":
            out.add(_C)
        elif len(o) == 3:
            out.add((None, None, o[2]))     # a local-memory cell entry: forget where it is
        else:
            out.add(o)
    return out


_INT_TYPES = frozenset(t for t in TYPE_SIZES if t[0] in "usb")


def _int_type(t: str) -> bool:
    return t in _INT_TYPES


def _int_size(mods: list[str]) -> int:
    for m in mods:
        if m in TYPE_SIZES:
            return TYPE_SIZES[m]
    return 8


def _space_of(mods: list[str]) -> str:
    for m in mods:
        if m == "global":
            return "global"
        if m.startswith("shared"):
            return "shared"
        if m == "local":
            return "local"
        if m.startswith("const"):
            return "const"
        if m.startswith("param"):
            return "param"
    return "generic"


_MEM_INFO: dict[str, tuple[str, int, int]] = {}


def _mem_info(ins) -> tuple[str, int, int]:
    """(state space, vector count, element size) of a memory instruction, cached per opcode string."""
    key = ins.name or ".".join([ins.opcode, *ins.modifiers])
    r = _MEM_INFO.get(key)
    if r is None:
        mods = ins.modifiers
        vec, size = _type_info(mods)
        r = (_space_of(mods), vec, size)
        if len(_MEM_INFO) < 65536:
            _MEM_INFO[key] = r
    return r


def _type_info(mods: list[str]) -> tuple[int, int]:
    """(vector count, element size) from modifiers such as ['global', 'nc', 'v4', 'f32']."""
    vec = 1
    size = 0
    for m in mods:
        if m in TYPE_SIZES:
            size = TYPE_SIZES[m]
        elif m in ("v2", "v4", "v8"):
            vec = int(m[1])
    return vec, size


_ADDR_PARTS: dict[str, tuple[str | None, int]] = {}


def _addr_parts(op: str) -> tuple[str | None, int]:
    """`[%rd4+16]` -> ('%rd4', 16); `[sym]` -> ('sym', 0); `[%rd1, {%r3, %r4}]` -> ('%rd1', 0).
    Cached per operand string (a pure function of it)."""
    r = _ADDR_PARTS.get(op)
    if r is None:
        r = _addr_parts_uncached(op)
        if len(_ADDR_PARTS) < 65536:
            _ADDR_PARTS[op] = r
    return r


def _addr_parts_uncached(op: str) -> tuple[str | None, int]:
    inner = op[1:-1]
    if "," in inner:
        inner = inner.split(",", 1)[0]
    inner = inner.replace(" ", "").replace("\t", "")
    if not inner:
        return None, 0
    k = inner.find("+", 1)
    if k < 0:
        k = inner.find("-", 1)
        if k > 0:
            off = parse_int(inner[k:])
            return inner[:k], off if off is not None else 0
        v = parse_int(inner) if inner[0] in "-0123456789" else None
        if v is not None:
            return None, v
        return inner, 0
    off = parse_int(inner[k + 1:])
    return inner[:k], off if off is not None else 0


def _addr_text(op: str) -> str:
    inner = op[1:-1]
    if "," in inner:
        inner = inner.split(",", 1)[0]
    return inner.replace(" ", "").replace("\t", "")


def _is_imm(op: str) -> bool:
    c = op[0]
    return c.isdigit() or (c == "-" and len(op) > 1 and (op[1].isdigit()))


def _elems(op: str) -> list[str]:
    """Elements of a vector operand `{%f1, %f2}` (a plain operand is one element)."""
    if op and op[0] == "{":
        return [e.strip() for e in op[1:-1].split(",") if e.strip()]
    if "|" in op:
        return [e.strip() for e in op.split("|")]
    return [op]


# opcode classes
_NO_PROV = {"setp", "set", "testp", "isspacep", "vote", "activemask", "istypep", "mbarrier", "bar",
            "barrier", "membar", "fence", "griddepcontrol", "setmaxnreg", "nanosleep", "pmevent", "trap",
            "brkpt", "exit", "ret", "bra", "brx", "createpolicy", "getctarank", "elect", "txq", "suq",
            "ldmatrix", "stmatrix", "movmatrix", "wgmma", "tcgen05", "clusterlaunchcontrol", "alloca",
            "stacksave", "stackrestore", "mma", "match"}
# instructions whose bracketed addresses can only be shared/tensor memory (never global)
_SHARED_ONLY = {"mbarrier", "ldmatrix", "stmatrix", "movmatrix", "wgmma", "tcgen05", "clusterlaunchcontrol",
                "barrier", "bar", "alloca", "stackrestore", "stacksave", "getctarank", "mapa"}
_SCALED = {"mul", "mul24", "shl", "dp4a", "dp2a"}
_MAD = {"mad", "mad24", "madc", "sad"}
_NONE_ACCESS = {"prefetch", "prefetchu", "applypriority"}
_KNOWN_EXTERNS = {
    # name: (access given to pointer arguments, return value origins, writes through arguments)
    "vprintf": (_R, _EMPTY, False),
    "__assertfail": (_R, _EMPTY, False),
    "__assert_fail": (_R, _EMPTY, False),
    "malloc": (0, frozenset({_H}), False),
    "free": (_RW, _EMPTY, False),
}


@dataclass
class _Effect:
    mode: int
    origins: frozenset
    role: str           # "addr" (an address), "tmap" (tensor map / texture handle), "escape" (to unknown code)
    reason: str
    line: int


@dataclass
class _Summary:
    """What a function does, in terms of its own parameters."""

    name: str
    effects: list[_Effect]
    ret: dict[tuple[int, int | None], set]
    ptr_stores: list[tuple[frozenset, frozenset]]
    shared_values: set
    unknown: str | None = None      # set for callees that cannot be analysed: the reason
    extern_mode: int = _RW
    extern_ret: frozenset = _EMPTY
    sites: list[AccessSite] = field(default_factory=list)
    loaded_params: set = field(default_factory=set)
    has_sites: bool = False


# transfer kinds
_T_UNION, _T_LOAD, _T_STORE, _T_ATOM, _T_CPASYNC, _T_CALL, _T_UNKNOWN = range(7)


class _FnAnalysis:
    """Dataflow of one function; produces its `_Summary` (own sites + effects, mapped callees)."""

    def __init__(self, ctx: _ModuleCtx, fn: Function) -> None:
        self.ctx = ctx
        self.fn = fn
        self.params = {p.name: i for i, p in enumerate(fn.params)}
        self.rets = {p.name: i for i, p in enumerate(fn.returns)}
        self.pflag = [1 if p.ptr else 0 for p in fn.params]
        self.psize = [p.size for p in fn.params]
        self.prov: dict = {}
        self.users: dict = defaultdict(list)
        self.transfers: list = []
        self.resolve_cache: dict = {}
        self.cell_offsets: dict = {}       # param-cell symbol key -> set of offsets stored
        self.loaded_params: set[int] = set()
        self.narrow = (ctx.module.address_size or 64) == 64
        self.calls: list = []
        self.mem: list = []                # (instr index, handler info) for access collection
        self.local_base: dict[str, int] = {}
        self.op_cache: dict = {}
        self.rdefs: dict = {}              # key -> indices of its defining integer instructions
        self.spec_cache: dict = {}
        self.collapsed: set = set()
        self.addr_cache: dict = {}         # instruction index -> (keys, consts) of its load address
        self.seeds: list[int] = []
        # '%' names that something declares in the function scope (rare): resolved the slow way
        self.local_regs = {name for (name, sid) in fn.decls if sid == 0 and name[:1] == "%"}
        self.has_ac = False                # some A (parameter address) or C (local address) origin exists
        self.rmemo: dict = {}              # key -> (lo, hi) | None (unbounded), computed on demand
        self.defined: set = set()          # keys defined by some transfer
        self.top_keys: set = set()         # keys defined by a transfer that computes no range

    # ------------------------------------------------------------------ names
    def _resolve(self, name: str, sid: int):
        """('reg', key) | ('fparam', i) | ('fret', i) | ('cell', key) | ('orig', origin) | ('imm',)"""
        ck = (name, sid)
        r = self.resolve_cache.get(ck)
        if r is not None:
            return r
        if not name:
            return ("reg", "")
        fn = self.fn
        r = None
        if name[0] == "%" and sid == 0 and (name, 0) not in fn.decls:
            r = ("reg", name)
        else:
            s = sid
            while True:
                sp = fn.decls.get((name, s))
                if sp is None and s in fn.range_decls:
                    for prefix, n in fn.range_decls[s]:
                        if name.startswith(prefix) and name[len(prefix):].isdigit() \
                                and int(name[len(prefix):]) < n:
                            sp = "reg"
                            break
                if sp is not None:
                    key = name if s == 0 else f"{name}@{s}"
                    if sp == "reg":
                        r = ("reg", key)
                    elif sp == "param":
                        r = ("cell", key)
                    elif sp == "local":
                        r = ("orig", self._local_var(key))
                    elif sp == "shared":
                        r = ("orig", _S)
                    else:
                        r = ("orig", _G)
                    break
                if s == 0:
                    break
                s = fn.scope_parent[s]
            if r is None:
                if name in self.params:
                    r = ("fparam", self.params[name])
                elif name in self.rets:
                    r = ("fret", self.rets[name])
                else:
                    kind = self.ctx.module.symbols.get(name)
                    if kind is None:
                        r = ("reg", name)
                    elif kind == "shared":
                        r = ("orig", _S)
                    elif kind == "local":
                        r = ("orig", self._local_var(name))
                    elif kind in ("func", "extern-func", "bad-func"):
                        r = ("orig", ("F", name, None, 1))
                    else:
                        r = ("orig", _G)
        self.resolve_cache[ck] = r
        return r

    def _local_var(self, name: str) -> tuple:
        """The address of a local variable: its own 4 GiB window of the local offset space."""
        base = self.local_base.get(name)
        if base is None:
            base = self.local_base[name] = len(self.local_base) << 32
        return ("C", base, base, 1)

    def _operand(self, op: str, sid: int):
        """A scalar operand as ('k', register key) | ('c', constant origin) | ('i', int) | ('n',)."""
        if sid == 0 and op[:1] == "%" and op not in self.local_regs and "+" not in op:
            return ("k", op)            # a function-scope register: the common case
        ck = (op, sid)
        r = self.op_cache.get(ck)
        if r is not None:
            return r
        c = op[0] if op else ""
        if not op or op == "_" or c in "[{":
            r = _NSPEC
        elif c.isdigit() or c == "-":
            v = parse_int(op)
            r = ("i", v) if v is not None else _NSPEC
        else:
            name = op[1:] if c == "!" else op
            base, off = name, 0
            if "+" in name:
                base, _, o = name.partition("+")
                off = parse_int(o) or 0
                base = base.strip()
            res = self._resolve(base, sid)
            t = res[0]
            if t == "reg":
                r = ("k", res[1])
            elif t == "fparam":
                r = ("c", ("A", res[1], off, 1))
                self.has_ac = True
            elif t == "orig":
                o = res[1]
                if off and o[0] == "C" and o[1] is not None:
                    o = ("C", o[1] + off, o[2] + off, 1)
                r = ("c", o)
                if o[0] == "C":
                    self.has_ac = True
            else:                       # the address of a call-sequence .param cell
                r = ("c", _C)
                self.has_ac = True
        self.op_cache[ck] = r
        return r

    def _src(self, op: str, sid: int, keys: list, consts: set):
        """Collect the register keys / constant origins of a source operand; returns its spec."""
        if op and op[0] == "{":
            for e in _elems(op):
                self._src(e, sid, keys, consts)
            return _NSPEC
        r = self._operand(op, sid)
        t = r[0]
        if t == "k":
            keys.append(r[1])
        elif t == "c":
            consts.add(r[1])
        return r

    def _dst_keys(self, op: str, sid: int) -> list:
        if op and op[0] == "%" and "|" not in op:
            r = self._operand(op, sid)
            return [r[1]] if r[0] == "k" else []
        out = []
        for e in _elems(op):
            if e == "_" or not e or e[0] == "[":
                continue
            r = self._operand(e, sid)
            if r[0] == "k":
                out.append(r[1])
        return out

    # ------------------------------------------------------------------ building
    def build(self) -> None:
        fn = self.fn
        # (the offsets of call-sequence .param cells are recorded by _classify_store as the st.param
        # that fill them are met, which is always before the call that reads them)
        # fast path for the bulk of PTX: integer/float ALU instructions with plain operands in the
        # function scope; everything else goes through _classify
        opc = self.op_cache
        operand = self._operand
        local_regs = self.local_regs
        users = self.users
        transfers = self.transfers
        defined = self.defined
        top = self.top_keys
        rdefs_all = self.rdefs
        fast_class = _FAST_CLASS
        special = _SPECIAL_REGS
        for idx, ins in enumerate(fn.body):
            op = ins.opcode
            cls = fast_class.get(op)
            if cls is None:
                if op == "ld":
                    self._classify_load(idx, ins)
                else:
                    self._classify(idx, ins)
                continue
            if cls == 0:
                continue                      # no provenance, no memory access
            ops = ins.operands
            text = ins.text
            if not ops or ins.scope or "{" in text or "|" in text:
                self._classify(idx, ins)
                continue
            mods = ins.modifiers
            dst = ops[0]
            if dst[0] != "%" or dst in local_regs:
                r = opc.get((dst, 0)) or operand(dst, 0)
                if r[0] != "k":
                    continue
                dst = r[1]
            keys = []
            consts = None
            strong = False
            if cls == 5:
                # mad d, a, b, c: a*b is index-like, c is plain
                sa = [opc.get((o, 0)) or operand(o, 0) for o in ops[1:]]
                if len(sa) != 3 or sa[0][0] == "c" or sa[1][0] == "c" or sa[2][0] == "c":
                    self._classify(idx, ins)
                    continue
                plain = [sa[2][1]] if sa[2][0] == "k" else []
                scaled = [x[1] for x in sa[:2] if x[0] == "k"]
                keys = plain + scaled
                sconsts = _EMPTY
            else:
                for o in (ops[1:3] if cls == 4 else ops[1:]):
                    if o[0] == "%" and o not in local_regs:
                        if o not in special and "." not in o:
                            keys.append(o)
                    else:
                        sp = opc.get((o, 0)) or operand(o, 0)
                        if sp[0] == "k":
                            keys.append(sp[1])
                        elif sp[0] == "c":
                            if consts is None:
                                consts = {sp[1]}
                            else:
                                consts.add(sp[1])
                if cls == 2 and op == "cvt" and not (self.narrow and len(mods) >= 2
                                                    and TYPE_SIZES.get(mods[-2], 0) == 8
                                                    and TYPE_SIZES.get(mods[-1], 8) < 8):
                    cls = 1
                if cls == 2:                  # index-like result (mul, shl, widening cvt)
                    plain, scaled = (), keys
                    sconsts = frozenset(_with_flag(consts, 2)) if consts else _EMPTY
                    consts = None
                else:                         # a plain union (cvta.to.global: a definite global address)
                    plain, scaled, sconsts = keys, (), _EMPTY
                    if cls == 3:
                        strong = len(mods) > 1 and mods[0] == "to" and mods[1] == "global"
            if op in _RANGE_OPS and mods and (mods[-1] if op != "cvt" else mods[-2]) in _INT_TYPES:
                rd = rdefs_all.get(dst)
                if rd is None:
                    rdefs_all[dst] = [idx]
                else:
                    rd.append(idx)
            else:
                top.add(dst)
            defined.add(dst)
            if not keys and not consts and not sconsts:
                continue                      # from immediates and special registers only: no origins
            adjk = _ADJ.get(op, 2)
            if adjk == 1 and "hi" in mods:
                adjk = 2
            ti = len(transfers)
            if consts or sconsts:
                self.seeds.append(ti)
            transfers.append((_T_UNION, [dst], plain, frozenset(consts) if consts else _EMPTY, scaled, sconsts,
                              strong, adjk, idx))
            for k in keys:
                users[k].append(ti)

    def _add_transfer(self, t: tuple, srcs: list, ranged: bool = False) -> None:
        kind = t[0]
        if kind in (_T_UNION, _T_UNKNOWN):
            dk = t[1]
        elif kind == _T_LOAD:
            dk = [k for d in t[1] for k in d]
        elif kind == _T_CALL:
            dk = [r[1] for r in t[3] if r[0] == "reg"]
        else:
            dk = []
        for k in dk:
            self.defined.add(k)
            if ranged:
                self.rdefs.setdefault(k, []).append(t[8])      # the instruction index
            else:
                self.top_keys.add(k)
        ti = len(self.transfers)
        if kind != _T_UNION or t[3] or t[5]:
            self.seeds.append(ti)
        self.transfers.append(t)
        for k in srcs:
            u = self.users.get(k)
            if u is None:
                self.users[k] = [ti]
            elif u[-1] != ti:
                u.append(ti)

    def _classify(self, idx: int, ins) -> None:
        op = ins.opcode
        ops = ins.operands
        sid = ins.scope
        mods = ins.modifiers
        if op in ("ld", "ldu"):
            self._classify_load(idx, ins)
            return
        if op == "st":
            self._classify_store(idx, ins)
            return
        if op in ("atom", "red"):
            self._classify_atom(idx, ins)
            return
        if op == "call":
            self._classify_call(idx, ins)
            return
        if op == "cp":
            self._classify_cp(idx, ins)
            return
        if op == "multimem":
            self._classify_multimem(idx, ins)
            return
        if op in ("tex", "tld4", "suld", "sust", "sured", "txq", "suq"):
            self._classify_tex(idx, ins)
            return
        if op in _NONE_ACCESS or op == "discard" or op == "tensormap" or (op == "wmma" and mods and
                                                                          mods[0] in ("load", "store")):
            self._classify_misc_mem(idx, ins)
            return
        if op in _NO_PROV or op in _SHARED_ONLY or not ops:
            return
        for o in ops:
            if o and o[0] == "[":
                # an unrecognised instruction with a memory operand: conservative
                self.mem.append((idx, "unknown", None))
                dsts = self._dst_keys(ops[0], sid) if ops[0][0] != "[" else []
                if dsts:
                    self._add_transfer((_T_UNKNOWN, dsts), [])
                return
        dsts = self._dst_keys(ops[0], sid)
        if not dsts:
            return
        plain: list = []
        consts: set = set()
        scaled: list = []
        sconsts: set = set()
        strong = False
        srcs = ops[1:]
        if op in _SCALED:
            for o in srcs:
                self._src(o, sid, scaled, sconsts)
        elif op in _MAD:
            for o in srcs[:2]:
                self._src(o, sid, scaled, sconsts)
            for o in srcs[2:]:
                self._src(o, sid, plain, consts)
        elif op == "selp" or op == "slct":
            for o in srcs[:2]:
                self._src(o, sid, plain, consts)
        elif op == "cvt" and self.narrow and len(mods) >= 2 and TYPE_SIZES.get(mods[-2], 0) == 8 \
                and TYPE_SIZES.get(mods[-1], 8) < 8:
            for o in srcs:
                self._src(o, sid, scaled, sconsts)
        else:
            for o in srcs:
                self._src(o, sid, plain, consts)
            if op == "cvta" and len(mods) > 1 and mods[0] == "to" and mods[1] == "global":
                strong = True
        # offsets of parameter/local addresses: add/sub/mad shift them by the other operand's range;
        # mov/cvta/cvt/selp keep them; anything else forgets them
        adjk = _ADJ.get(op, 2)
        if adjk == 1 and "hi" in mods:
            adjk = 2
        ranged = op in _RANGE_OPS and bool(mods) and _int_type(mods[-1] if op != "cvt" else mods[-2])
        t = (_T_UNION, dsts, tuple(plain), frozenset(consts), tuple(scaled),
             frozenset(_with_flag(sconsts, 2)) if sconsts else _EMPTY, strong, adjk, idx)
        self._add_transfer(t, plain + scaled if scaled else plain, ranged=ranged)

    def _addr_srcs(self, op: str, sid: int):
        """(register keys, constant origins, immediate offset) of a bracketed address operand."""
        base, off = _addr_parts(op)
        keys: list = []
        consts: set = set()
        if base is not None:
            self._src(base, sid, keys, consts)
        return keys, frozenset(consts), off

    def _classify_load(self, idx: int, ins) -> None:
        ops = ins.operands
        if len(ops) < 2 or not ops[1].startswith("["):
            self.mem.append((idx, "unknown", None))
            return
        sid = ins.scope
        space, vec, size = _mem_info(ins)
        d0 = ops[0]
        if d0[0] == "%" and sid == 0 and "|" not in d0 and (d0, 0) not in self.fn.decls:
            dsts = [[d0]]
        else:
            dsts = [self._dst_keys(e, sid) for e in _elems(d0)]
        a = ops[1]
        if a[1:2] == "%" and "+" not in a and "," not in a and "-" not in a:
            base, off = a[1:-1], 0                  # the common `[%rd5]`
        else:
            base, off = _addr_parts(a)
        if space == "param" and base is not None:
            r = self._resolve(base, sid)
            if r[0] == "fparam":
                i = r[1]
                self.loaded_params.add(i)
                for k, d in enumerate(dsts):
                    if d:
                        o = ("P", i, off + k * size, self.pflag[i])
                        self._add_transfer((_T_UNION, d, (), frozenset({o}), (), _EMPTY, False, 0, -1), [])
                return
            if r[0] in ("cell", "fret"):
                key = r[1] if r[0] == "cell" else ("ret", r[1])
                for k, d in enumerate(dsts):
                    if d:
                        cells = [("c", key, off + k * size), ("c", key, None)]
                        self._add_transfer((_T_UNION, d, tuple(cells), _EMPTY, (), _EMPTY, False, 0, -1), cells)
                return
        keys: list = []
        if base is None:
            consts = _EMPTY
        elif sid == 0 and base[0] == "%" and base not in self.local_regs:
            keys.append(base)
            consts = _EMPTY
        else:
            cs: set = set()
            self._src(base, sid, keys, cs)
            consts = frozenset(cs)
        if space == "global" or space == "generic":
            srcs = keys + ["$local", "$shared"]
            self.mem.append((idx, "ld", 1))
            self.addr_cache[idx] = (keys, consts)
        elif space == "local":
            srcs = keys + ["$local"]
        elif space == "shared":
            srcs = keys + ["$shared"]
        else:
            srcs = keys
        # inline _add_transfer: loads define no integer range
        for d in dsts:
            for k in d:
                self.defined.add(k)
                self.top_keys.add(k)
        ti = len(self.transfers)
        self.seeds.append(ti)
        self.transfers.append((_T_LOAD, dsts, space, tuple(keys), consts, off, size))
        users = self.users
        for k in srcs:
            users[k].append(ti)

    def _classify_store(self, idx: int, ins) -> None:
        ops = ins.operands
        if len(ops) < 2 or not ops[0].startswith("["):
            self.mem.append((idx, "unknown", None))
            return
        sid = ins.scope
        space, vec, size = _mem_info(ins)
        if space == "global":
            # a global store cannot put a value into local or shared memory: only the site matters
            self.mem.append((idx, "st", 0))
            return
        if "async" in ins.modifiers:
            space = "shared"            # st.async writes remote shared memory of the cluster
        vals = []
        for e in _elems(ops[1]):
            ks: list = []
            cs: set = set()
            self._src(e, sid, ks, cs)
            vals.append((tuple(ks), frozenset(cs)))
        base, off = _addr_parts(ops[0])
        if space == "param" and base is not None:
            r = self._resolve(base, sid)
            if r[0] in ("cell", "fret"):
                key = r[1] if r[0] == "cell" else ("ret", r[1])
                offs = self.cell_offsets.setdefault(key, set())
                for k, (ks, cs) in enumerate(vals):
                    offs.add(off + k * size)
                    cell = ("c", key, off + k * size)
                    self._add_transfer((_T_UNION, [cell], ks, cs, (), _EMPTY, False, 0, -1), list(ks))
            return
        keys, consts, aoff = self._addr_srcs(ops[0], sid)
        allk = [k for ks, _ in vals for k in ks]
        allc = frozenset(c for _, cs in vals for c in cs)
        t = (_T_STORE, space, tuple(keys), consts, tuple(allk), allc, aoff, vec * size)
        self._add_transfer(t, list(keys) + allk)
        if space in ("global", "generic"):
            self.mem.append((idx, "st", 0))

    def _classify_atom(self, idx: int, ins) -> None:
        ops = ins.operands
        sid = ins.scope
        space = _space_of(ins.modifiers)
        if "async" in ins.modifiers:
            space = "shared"
        ai = 1 if ins.opcode == "atom" else 0
        if len(ops) <= ai or not ops[ai].startswith("["):
            self.mem.append((idx, "unknown", None))
            return
        keys, consts, off = self._addr_srcs(ops[ai], sid)
        vk: list = []
        vc: set = set()
        for o in ops[ai + 1:]:
            self._src(o, sid, vk, vc)
        if ai == 1:
            dsts = [self._dst_keys(e, sid) for e in _elems(ops[0])]
            srcs = list(keys) + ["$local", "$shared"]
            self._add_transfer((_T_LOAD, dsts, space, tuple(keys), consts, off, 0), srcs)
        if vk or vc:
            vec, size = _type_info(ins.modifiers)
            self._add_transfer((_T_STORE, space, tuple(keys), consts, tuple(vk), frozenset(vc), off, vec * size),
                               list(keys) + vk)
        if space in ("global", "generic"):
            self.mem.append((idx, ins.opcode, ai))

    def _classify_cp(self, idx: int, ins) -> None:
        mods = ins.modifiers
        ops = ins.operands
        sid = ins.scope
        if "global" not in mods or not ops:
            return
        if "tensor" in mods:
            self.mem.append((idx, "cp-tensor", None))
            if "shared" in "".join(mods) and "prefetch" not in mods and "reduce" not in mods \
                    and self._first_space(mods) != "global":
                self._add_transfer((_T_CPASYNC, ("L", None), ()), [])
            return
        if "prefetch" in mods:
            return
        self.mem.append((idx, "cp", None))
        if self._first_space(mods) != "global" and len(ops) > 1 and ops[1].startswith("["):
            keys, consts, off = self._addr_srcs(ops[1], sid)
            self._add_transfer((_T_CPASYNC, keys, consts), list(keys) + ["$local", "$shared"])

    @staticmethod
    def _first_space(mods: list[str]) -> str | None:
        for m in mods:
            if m == "global":
                return "global"
            if m.startswith("shared"):
                return "shared"
        return None

    def _classify_multimem(self, idx: int, ins) -> None:
        mods = ins.modifiers
        sid = ins.scope
        ops = ins.operands
        kind = mods[0] if mods else ""
        if kind == "ld_reduce" and len(ops) >= 2:
            dsts = [self._dst_keys(e, sid) for e in _elems(ops[0])]
            keys, consts, off = self._addr_srcs(ops[1], sid)
            self._add_transfer((_T_LOAD, dsts, "global", tuple(keys), consts, off, 0), list(keys))
        self.mem.append((idx, "multimem", None))

    def _classify_tex(self, idx: int, ins) -> None:
        ops = ins.operands
        sid = ins.scope
        if ins.opcode in ("tex", "tld4", "suld") and ops:
            dsts = [self._dst_keys(e, sid) for e in _elems(ops[0].split("|")[0])]
            self._add_transfer((_T_UNKNOWN, [k for d in dsts for k in d]), [])
            # texel values come from memory behind a descriptor: treat them as loaded
        if ins.opcode in ("txq", "suq"):
            return
        self.mem.append((idx, "tex", None))

    def _classify_misc_mem(self, idx: int, ins) -> None:
        op = ins.opcode
        if op == "wmma":
            sid = ins.scope
            ops = ins.operands
            if ins.modifiers[0] == "load" and len(ops) >= 2:
                dsts = [self._dst_keys(e, sid) for e in _elems(ops[0])]
                keys, consts, off = self._addr_srcs(ops[1], sid)
                self._add_transfer((_T_LOAD, dsts, _space_of(ins.modifiers), tuple(keys), consts, off, 0),
                                   list(keys) + ["$local", "$shared"])
        self.mem.append((idx, op, None))

    def _classify_call(self, idx: int, ins) -> None:
        ops = ins.operands
        sid = ins.scope
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
        summary = self.ctx.summary_for(callee, self._resolve(callee, sid))
        argspecs = []
        srcs: list = ["$local", "$shared"]
        for a in args:
            if _is_imm(a):
                argspecs.append(("imm",))
                continue
            r = self._resolve(a, sid)
            if r[0] == "cell":
                offs = sorted(self.cell_offsets.get(r[1], set()))
                cells = [(o, ("c", r[1], o)) for o in offs]
                argspecs.append(("cells", cells))
                srcs.extend(c for _, c in cells)
            elif r[0] == "reg":
                argspecs.append(("reg", r[1]))
                srcs.append(r[1])
            elif r[0] == "fparam":
                argspecs.append(("const", {("A", r[1], 0, 1)}))
            elif r[0] == "orig":
                argspecs.append(("const", {r[1]}))
            else:
                argspecs.append(("imm",))
        retspecs = []
        for rname in rets:
            r = self._resolve(rname, sid)
            if r[0] == "cell":
                retspecs.append(("cell", r[1]))
            elif r[0] == "reg":
                retspecs.append(("reg", r[1]))
        callee_reg = None
        if summary.unknown is not None:
            rc = self._resolve(callee, sid)
            if rc[0] == "reg":
                callee_reg = rc[1]
        self.has_ac = True                  # argument values may carry parameter or local addresses
        t = (_T_CALL, summary, argspecs, retspecs, ins.line, callee_reg)
        self._add_transfer(t, srcs)
        self.calls.append((idx, t))

    # ------------------------------------------------------------------ dataflow
    def _get(self, key) -> set:
        s = self.prov.get(key)
        return s if s is not None else _EMPTY

    def _add(self, key, origins, owned: bool = False) -> bool:
        """Join `origins` into the set of `key`; True if it grew. A set that grows past _COLLAPSE_AT
        forgets byte offsets for good (so pointer increments in loops cannot grow it forever)."""
        if not origins:
            return False
        prov = self.prov
        s = prov.get(key)
        if s is None:
            if len(origins) > _COLLAPSE_AT:
                origins = _collapse(origins)
                self.collapsed.add(key)
            elif not owned:
                origins = set(origins)
            prov[key] = origins
            return True
        if key in self.collapsed:
            origins = _collapse(origins)
        n = len(s)
        s |= origins
        if len(s) == n:
            return False
        if len(s) > _COLLAPSE_AT and key not in self.collapsed:
            c = _collapse(s)
            s.clear()
            s |= c
            self.collapsed.add(key)
        return True

    # ------------------------------------------------------------------ local memory
    def _local_read(self, spans) -> set:
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

    def _load_result(self, addr: set, off: int, size: int, k: int = 0) -> set:
        """Origins of the value an access at addr+off (+k elements of `size` bytes) may load."""
        out = set()
        local_spans = None
        for o in _select_base(addr):
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
                out |= self._get("$shared")
            elif kind in ("G", "H", "SH"):
                out.add(_LNONE)
            else:
                out.add(_U)
        if local_spans:
            out |= self._local_read(local_spans)
        if not addr:
            out.add(_U)
        return out

    # ------------------------------------------------------------------ integer ranges
    def _rng_of(self, spec):
        """Range (lo, hi) of an operand, None when unbounded. Register ranges are computed on demand
        from all their definitions (flow-insensitive; a cycle through a loop is unbounded)."""
        t = spec[0]
        if t == "i":
            v = spec[1]
            return (v, v) if -_RMAX <= v <= _RMAX else None
        if t != "k":
            return None
        k = spec[1]
        if k in self.rmemo:
            return self.rmemo[k]
        if k in self.top_keys or k not in self.defined:
            return None
        self.rmemo[k] = None            # a cycle back to k is unbounded
        lo = hi = None
        for idx in self.rdefs.get(k, ()):
            r = self._range(self._rspec(idx))
            if r is None:
                lo = None
                break
            lo = r[0] if lo is None else min(lo, r[0])
            hi = r[1] if hi is None else max(hi, r[1])
        res = None if lo is None else (lo, hi)
        self.rmemo[k] = res
        return res

    def _psize_of(self, i) -> int:
        return self.psize[i] if i is not None and 0 <= i < len(self.psize) else 0

    def _specs(self, idx: int) -> list:
        """Operand specs of the sources of instruction `idx` (computed on demand, cached)."""
        r = self.spec_cache.get(idx)
        if r is None:
            ins = self.fn.body[idx]
            r = self.spec_cache[idx] = [self._operand(o, ins.scope) for o in ins.operands[1:]]
        return r

    def _rspec(self, idx: int):
        ins = self.fn.body[idx]
        return ins.opcode, _int_size(ins.modifiers), self._specs(idx)

    def _range(self, rspec):
        """Range of an integer result, or None (unbounded). Only non-wrapping cases are bounded."""
        op, size, specs = rspec
        r = [self._rng_of(x) for x in specs]
        res = None
        if op in ("mov", "cvt"):
            res = r[0] if r else None
        elif op == "and":
            his = [x[1] for x in r if x is not None and x[0] >= 0]
            if his:
                res = (0, min(his))
        elif op in ("add", "sub", "shl", "shr", "mul", "mad", "or", "rem", "min", "max", "selp", "bfe"):
            if op == "rem":
                if len(r) > 1 and r[1] is not None and r[1][0] > 0 and (r[0] is None or r[0][0] >= 0):
                    res = (0, r[1][1] - 1) if r[0] is None else (0, min(r[0][1], r[1][1] - 1))
            elif op == "bfe":
                if len(r) > 2 and r[2] is not None and r[2][0] == r[2][1] and 0 <= r[2][0] < 40:
                    res = (0, (1 << r[2][0]) - 1)
            elif op == "selp":
                if len(r) > 1 and r[0] is not None and r[1] is not None:
                    res = (min(r[0][0], r[1][0]), max(r[0][1], r[1][1]))
            elif len(r) < 2 or r[0] is None or r[1] is None:
                res = None
            else:
                (a, b), (c, d) = r[0], r[1]
                if op == "add":
                    res = (a + c, b + d)
                elif op == "sub":
                    res = (a - d, b - c)
                elif op == "shl":
                    res = (a << c, b << d) if a >= 0 and c >= 0 and d < 40 else None
                elif op == "shr":
                    res = (a >> d, b >> c) if a >= 0 and c >= 0 else None
                elif op in ("mul", "mad"):
                    if a >= 0 and c >= 0:
                        res = (a * c, b * d)
                        if op == "mad":
                            e = r[2] if len(r) > 2 else None
                            res = None if e is None else (res[0] + e[0], res[1] + e[1])
                elif op == "or":
                    if a >= 0 and c >= 0:
                        res = (max(a, c), (1 << max(b, d).bit_length()) - 1)
                elif op == "min":
                    res = (min(a, c), min(b, d))
                elif op == "max":
                    res = (max(a, c), max(b, d))
        if res is None:
            return None
        lo, hi = res
        if size == 4 and (lo < -(1 << 31) or hi >= (1 << 31)) or lo < -_RMAX or hi > _RMAX:
            return None
        return res

    def _offsets(self, res: set, adjk: int, idx: int) -> set:
        """Shift (adjk 1: add/sub/mad by the other operand's range) or forget (adjk 2) the offsets of
        parameter (A) and local (C) addresses after arithmetic."""
        if not any(o[0] in ("A", "C") for o in res):
            return res
        out = {o for o in res if o[0] not in ("A", "C")}
        if adjk == 2:
            for o in res:
                if o[0] in ("A", "C"):
                    out.add((o[0], o[1], None, o[3]) if o[0] == "A" else _C)
            return out
        op, specs = self.fn.body[idx].opcode, self._specs(idx)
        for idx, sp in enumerate(specs):
            if sp[0] == "k":
                origs = self._get(sp[1])
            elif sp[0] == "c":
                origs = (sp[1],)
            else:
                continue
            delta = None
            if op == "add" and idx < 2 and len(specs) > 1:
                delta = self._rng_of(specs[1 - idx])
            elif op == "sub" and idx == 0 and len(specs) > 1:
                d = self._rng_of(specs[1])
                delta = None if d is None else (-d[1], -d[0])
            elif op == "mad" and idx == 2:
                a, b = self._rng_of(specs[0]), self._rng_of(specs[1])
                if a is not None and b is not None and a[0] >= 0 and b[0] >= 0:
                    delta = (a[0] * b[0], a[1] * b[1])
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
                        out.add(_C)
        return out

    # ------------------------------------------------------------------ transfer functions
    def _apply(self, t) -> list:
        kind = t[0]
        changed = []
        if kind == _T_UNION:
            _, dsts, plain, consts, scaled, sconsts, strong, adjk, idx = t
            prov = self.prov
            res = set(consts)
            for k in plain:
                s = prov.get(k)
                if s:
                    res |= s
            for k in scaled:
                s = prov.get(k)
                if s:
                    res |= _with_flag(s, 2)
            if sconsts:
                res |= sconsts
            if res:
                if strong:
                    res = _with_flag(res, 1)
                if adjk and self.has_ac:
                    res = self._offsets(res, adjk, idx)
                if len(dsts) == 1:
                    if self._add(dsts[0], res, True):
                        changed.append(dsts[0])
                else:
                    for d in dsts:
                        if self._add(d, res):
                            changed.append(d)
            return changed
        if kind == _T_LOAD:
            _, dsts, space, keys, consts, off, size = t
            addr = set(consts)
            for k in keys:
                addr |= self._get(k)
            if space == "shared":
                res = set(self._get("$shared"))
                for d in dsts:
                    for k in d:
                        if self._add(k, res):
                            changed.append(k)
                return changed
            if space == "local":
                addr = {o for o in addr if o[0] == "C"} or {_C}
            elif space == "const" and not any(o[0] == "A" for o in addr):
                addr = {_G}
            for j, d in enumerate(dsts):
                if not d:
                    continue
                res = self._load_result(addr, off, size, j)
                for k in d:
                    if self._add(k, res):
                        changed.append(k)
            return changed
        if kind == _T_STORE:
            _, space, keys, consts, vkeys, vconsts, off, width = t
            val = set(vconsts)
            for k in vkeys:
                val |= self._get(k)
            if not val:
                return changed
            if space == "shared":
                if self._add("$shared", val):
                    changed.append("$shared")
                return changed
            if space not in ("generic", "global", "local"):
                return changed
            addr = set(consts)
            for k in keys:
                addr |= self._get(k)
            if space == "local":
                addr = {o for o in addr if o[0] == "C"} or {_C}
            else:
                addr = set(_select_base(addr))
            kinds = {o[0] for o in addr}
            spans = self._spans(addr, off, width) if "C" in kinds or space == "local" else []
            unknown = not addr or bool(kinds & {"U", "L", "SH"})
            if unknown:
                spans = [(None, None)]
            if spans:
                cell = {(a, b, o) for a, b in spans for o in val}
                if self._add("$local", cell):
                    changed.append("$local")
            if ("S" in kinds or unknown) and self._add("$shared", val):
                changed.append("$shared")
            return changed
        if kind == _T_CPASYNC:
            _, keys, consts = t
            if keys == ("L", None):
                res = {_LNONE}
            else:
                addr = set(consts)
                for k in keys:
                    addr |= self._get(k)
                res = self._load_result(addr, 0, 0)
            if self._add("$shared", res):
                changed.append("$shared")
            return changed
        if kind == _T_UNKNOWN:
            for k in t[1]:
                if self._add(k, {_U}):
                    changed.append(k)
            return changed
        if kind == _T_CALL:
            return self._apply_call(t)
        return changed

    # ------------------------------------------------------------------ calls
    def _argvals(self, argspecs) -> list[dict]:
        vals = []
        for a in argspecs:
            if a[0] == "cells":
                d = {}
                for off, c in a[1]:
                    s = self._get(c)
                    if s:
                        d[off] = set(s)
                vals.append(d)
            elif a[0] == "reg":
                vals.append({0: set(self._get(a[1]))})
            elif a[0] == "const":
                vals.append({0: set(a[1])})
            else:
                vals.append({})
        return vals

    def _map(self, origins, args: list[dict]) -> set:
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
                    out.add(_U)
                    continue
                av = args[j]
                if k == "P" and o[2] is not None and o[2] in av:
                    vals = set(av[o[2]])
                else:
                    vals = set()
                    for v in av.values():
                        vals |= v
                if k == "L":
                    vals = self._load_result(vals, 0, 0) if vals else set()
                if o[3] == 2:
                    vals = _with_flag(vals, 2)
                elif o[3] == 1 and k != "L":
                    vals = _with_flag(vals, 1)
                out |= vals
            elif k == "SH":
                out |= self._get("$shared")
            else:
                out.add(o)
        return out

    def _apply_call(self, t) -> list:
        _, summary, argspecs, retspecs, line, _reg = t
        changed = []
        if summary.unknown is not None:
            args = self._argvals(argspecs)
            kinds = {o[0] for a in args for v in a.values() for o in v}
            res = set(summary.extern_ret) if summary.name in _KNOWN_EXTERNS else {_U}
            if summary.name not in _KNOWN_EXTERNS:
                if "C" in kinds and self._add("$local", {(None, None, _U)}):
                    changed.append("$local")
                if "S" in kinds and self._add("$shared", {_U}):
                    changed.append("$shared")
            for r in retspecs:
                keys = [("c", r[1], None)] if r[0] == "cell" else [r[1]]
                for k in keys:
                    if self._add(k, res):
                        changed.append(k)
            return changed
        args = self._argvals(argspecs)
        # return values
        for ri, r in enumerate(retspecs):
            for (j, off), s in summary.ret.items():
                if j != ri:
                    continue
                mapped = self._map(s, args)
                key = ("c", r[1], off) if r[0] == "cell" else r[1]
                if self._add(key, mapped):
                    changed.append(key)
        # pointers stored by the callee into memory the caller can see
        for addr, val in summary.ptr_stores:
            maddr = self._map(addr, args)
            mval = self._map(val, args)
            kinds = {o[0] for o in maddr}
            targets = []
            if "C" in kinds:
                targets.append("$local")
            if "S" in kinds:
                targets.append("$shared")
            if not maddr or kinds & {"U", "L"}:
                targets = ["$local", "$shared"]
            for c in targets:
                v = {(None, None, o) for o in mval} if c == "$local" else mval
                if self._add(c, v):
                    changed.append(c)
        if summary.shared_values:
            mval = self._map(summary.shared_values, args)
            if self._add("$shared", mval):
                changed.append("$shared")
        return changed

    def fixpoint(self) -> None:
        """Chaotic iteration in program order: only transfers that can produce origins by themselves
        (constants, loads, calls) start dirty; a change makes the users of the changed key dirty."""
        ts = self.transfers
        users = self.users
        n = len(ts)
        dirty = bytearray(n)
        for ti in self.seeds:
            dirty[ti] = 1
        steps = 0
        limit = 100 * (n + 10)
        pos = dirty.find(1)
        while pos >= 0:
            dirty[pos] = 0
            steps += 1
            if steps > limit:
                raise RuntimeError(f"PTX dataflow did not converge in {self.fn.name}")
            for k in self._apply(ts[pos]):
                for u in users.get(k, ()):
                    dirty[u] = 1
            nxt = dirty.find(1, pos + 1)
            pos = nxt if nxt >= 0 else dirty.find(1)

    # ------------------------------------------------------------------ collection
    def _addr_origins(self, op: str, sid: int) -> set:
        keys, consts, _ = self._addr_srcs(op, sid)
        s = set(consts)
        for k in keys:
            s |= self._get(k)
        return s

    @staticmethod
    def _opname(ins) -> str:
        return ins.name or ".".join([ins.opcode, *ins.modifiers])

    def collect(self, with_sites: bool = False) -> _Summary:
        fn = self.fn
        effects: list[_Effect] = []
        seen: dict = {}
        sites: list[AccessSite] = []
        ptr_stores: list = []

        def effect(mode, origins, role, reason, line):
            key = (frozenset(origins), role)
            e = seen.get(key)
            if e is None:
                seen[key] = e = _Effect(mode, key[0], role, reason, line)
                effects.append(e)
            elif mode & ~e.mode:
                e.mode |= mode
                e.reason = f"{e.reason}; {reason}"

        for idx, what, ai in self.mem:
            ins = fn.body[idx]
            for site in self._sites_of(idx, ins, what, ai):
                mode, space, opi, origins, width, role, why = site
                name = self._opname(ins)
                reason = f"{name} at line {ins.line}"
                if role == "addr":
                    kinds = {o[0] for o in origins}
                    if origins and kinds <= _NONGLOBAL:
                        continue            # provably shared/local/param memory
                if not origins and role != "escape":
                    origins = {_U}
                if mode or role != "escape":
                    effect(mode, origins, role, reason, ins.line)
                if with_sites and role in ("addr", "tmap") and space is not None:
                    base = _select_base(origins) if role == "addr" else origins
                    plist = sorted({o[1] for o in base if o[0] in ("P", "A") and o[1] is not None})
                    instr = width > 0 and space != "bulk-tensor" and mode != 0 and what not in ("unknown",)
                    if not instr:
                        why = why or ("no data access" if mode == 0 else "unrecognised instruction")
                    else:
                        why = _describe(base, fn)
                    sites.append(AccessSite(fn.name, ins.line, name, space, ACCESSES[mode],
                                            _addr_text(ins.operands[opi]) if opi is not None else "", width,
                                            plist, ins.predicate, instr, why, idx,
                                            opi if opi is not None else -1))
            # stores of pointer-carrying values through parameter-derived addresses (for callers)
            if not fn.is_entry and what in ("st", "atom", "red"):
                vals = set()
                for o in ins.operands[(ai + 1):]:
                    ks: list = []
                    cs: set = set()
                    self._src(o, ins.scope, ks, cs)
                    vals |= cs
                    for k in ks:
                        vals |= self._get(k)
                if vals:
                    addr = self._addr_origins(ins.operands[ai], ins.scope)
                    if not addr or not {o[0] for o in addr} <= {"C", "S"}:
                        ptr_stores.append((frozenset(addr), frozenset(vals)))
        # calls: callee effects mapped into this function, unknown callees as escapes
        for idx, t in self.calls:
            ins = fn.body[idx]
            _, summary, argspecs, retspecs, line, _reg = t
            args = self._argvals(argspecs)
            if summary.unknown is not None:
                mode = summary.extern_mode
                if not mode:
                    continue
                esc = set()
                for a in args:
                    for v in a.values():
                        esc |= {o for o in v if o[3] != 2}
                kinds = {o[0] for o in esc}
                if "C" in kinds:
                    esc |= self._local_read([(None, None)])
                if "S" in kinds:
                    esc |= self._get("$shared")
                esc = {o for o in esc if o[3] != 2}
                if esc:
                    effect(mode, esc, "escape", f"passed to {summary.unknown} at line {line}", line)
                continue
            merged: dict = {}
            for e in summary.effects:
                mo = self._map(e.origins, args)
                if e.role != "escape" and not mo:
                    mo = {_U}
                key = (frozenset(mo), e.role)
                m = merged.get(key)
                if m is None:
                    merged[key] = [e.mode, [e]]
                else:
                    m[0] |= e.mode
                    m[1].append(e)
            for (mo, role), (mode, es) in merged.items():
                effect(mode, mo, role, self._call_reason(summary.name, mode, es, line), line)
            for addr, val in summary.ptr_stores:
                if not fn.is_entry:
                    ptr_stores.append((frozenset(self._map(addr, args)), frozenset(self._map(val, args))))
        shared_values = set(self._get("$shared")) - {_SH}
        ret: dict = {}
        for key, offs in self.cell_offsets.items():
            if isinstance(key, tuple) and key[0] == "ret":
                for off in offs:
                    s = self._get(("c", key, off))
                    if s:
                        ret[(key[1], off)] = set(s)
        return _Summary(fn.name, effects, ret, ptr_stores, shared_values, sites=sites, has_sites=with_sites)

    @staticmethod
    def _call_reason(callee: str, mode: int, es: list, line: int) -> str:
        for e in es:
            js = sorted({o[1] for o in e.origins if o[0] in ("P", "A") and o[1] is not None})
            if e.role != "escape" and js and not any(o[0] in ("L", "U") for o in e.origins):
                return f"passed to .func {callee} at line {line} ({_VERB[mode]} its param {js[0]})"
        return f"{es[0].reason} in .func {callee} (called at line {line})"

    def _sites_of(self, idx: int, ins, what: str, ai):
        """Yield (mode, space, operand index, address origins, width, role, why) per global operand."""
        mods = ins.modifiers
        ops = ins.operands
        sid = ins.scope
        space, vec, size = _mem_info(ins)
        site_space = "global" if space == "global" else "generic"
        if what == "ld":
            cached = self.addr_cache.get(idx)
            if cached is not None:
                addr = set(cached[1])
                for k in cached[0]:
                    addr |= self._get(k)
            else:
                addr = self._addr_origins(ops[1], sid)
            yield _R, site_space, 1, addr, vec * size, "addr", ""
        elif what == "st":
            yield _W, site_space, 0, self._addr_origins(ops[0], sid), vec * size, "addr", ""
        elif what in ("atom", "red"):
            yield _RW, site_space, ai, self._addr_origins(ops[ai], sid), vec * size, "addr", ""
        elif what == "multimem":
            kind = mods[0] if mods else ""
            mode = {"ld_reduce": _R, "st": _W, "red": _RW}.get(kind, _RW)
            oi = 1 if kind == "ld_reduce" else 0
            if oi < len(ops) and ops[oi].startswith("["):
                yield mode, "generic", oi, self._addr_origins(ops[oi], sid), vec * size, "addr", \
                    "" if kind in ("ld_reduce", "st", "red") else "unrecognised multimem instruction"
        elif what == "cp":
            reduce = "reduce" in mods
            first = self._first_space(mods)
            if first == "global":
                mode = _RW if reduce else _W
                oi = 0
            else:
                mode = _R
                oi = 1
            if oi < len(ops) and ops[oi].startswith("["):
                width = 0
                if len(ops) > 2:
                    w = parse_int(ops[2]) if _is_imm(ops[2]) else None
                    width = w or 0
                why = "" if width else "copy size is not a constant"
                yield mode, "global", oi, self._addr_origins(ops[oi], sid), width, "addr", why
        elif what == "cp-tensor":
            reduce = "reduce" in mods
            if "prefetch" in mods:
                mode, oi = 0, 0
            elif self._first_space(mods) == "global":
                mode, oi = (_RW if reduce else _W), 0
            else:
                mode, oi = _R, 1
            if oi < len(ops) and ops[oi].startswith("["):
                yield mode, "bulk-tensor", oi, self._addr_origins(ops[oi], sid), 0, "tmap", \
                    "bulk tensor copy through a tensor map"
        elif what == "tex":
            mode = {"tex": _R, "tld4": _R, "suld": _R, "sust": _W, "sured": _RW}.get(ins.opcode, _RW)
            for oi, o in enumerate(ops):
                if o.startswith("["):
                    yield mode, None, oi, self._addr_origins(o, sid), 0, "tex", "texture/surface access"
                    break
        elif what in ("prefetch", "prefetchu", "applypriority"):
            if ops and ops[0].startswith("["):
                if "tensormap" in mods:
                    yield 0, None, 0, self._addr_origins(ops[0], sid), 0, "tmap", "prefetch of a tensor map"
                else:
                    # no data access, but evidence that the address is a pointer
                    yield 0, None, 0, self._addr_origins(ops[0], sid), 0, "addr", "prefetch"
        elif what == "discard":
            if ops and ops[0].startswith("["):
                yield _W, _site_space(mods), 0, self._addr_origins(ops[0], sid), 0, "addr", \
                    "discard makes the line's contents undefined"
        elif what == "tensormap":
            # tensormap.replace [addr], v  /  tensormap.cp_fenceproxy [dst], [src], size
            if ops and ops[0].startswith("[") and (mods and mods[0] == "replace" and "global" in mods
                                                   or mods and mods[0] == "cp_fenceproxy"
                                                   and self._first_space(mods) == "global"
                                                   or "shared" not in "".join(mods)):
                yield _W, "global", 0, self._addr_origins(ops[0], sid), 0, "addr", "tensor map update"
        elif what == "wmma":
            kind = mods[0]
            oi = 1 if kind == "load" else 0
            sp = _space_of(mods)
            if sp in ("global", "generic") and oi < len(ops) and ops[oi].startswith("["):
                yield (_R if kind == "load" else _W), sp, oi, self._addr_origins(ops[oi], sid), 0, "addr", \
                    "wmma fragment access"
        elif what == "unknown":
            for oi, o in enumerate(ops):
                if o.startswith("["):
                    org = self._addr_origins(o, sid)
                    if any(x[0] in ("P", "L", "U") for x in org):
                        yield _RW, "generic", oi, org, 0, "addr", \
                            f"unrecognised instruction {self._opname(ins)}"


def _site_space(mods: list[str]) -> str:
    return "global" if _space_of(mods) == "global" else "generic"


def _select_base(origins) -> list:
    """The origins that may be the base pointer of an address (see the module docstring)."""
    plain = [o for o in origins if o[3] != 2]
    if plain:
        strong = [o for o in plain if o[3] == 1]
        return strong or plain
    return list(origins)


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


# --------------------------------------------------------------------------------------------------


class _ModuleCtx:
    def __init__(self, module: Module) -> None:
        self.module = module
        self.by_name = {f.name: f for f in module.functions}
        self.summaries: dict[int, _Summary] = {}
        self.in_progress: set[str] = set()

    def summary_for(self, callee: str, resolved) -> _Summary:
        if resolved[0] == "reg":
            return _unknown_summary("?", f"indirect call through {callee}")
        name = callee
        fn = self.by_name.get(name)
        if fn is None:
            kind = self.module.symbols.get(name)
            if name in _KNOWN_EXTERNS:
                mode, ret, _ = _KNOWN_EXTERNS[name]
                s = _unknown_summary(name, f"extern .func {name}")
                s.extern_mode = mode
                s.extern_ret = ret
                return s
            if kind == "bad-func":
                return _unknown_summary(name, f".func {name} (its body failed to parse)")
            return _unknown_summary(name, f"extern .func {name} (no body)")
        if name in self.in_progress:
            return _unknown_summary(name, f"recursive .func {name}")
        return self.analyze(fn)

    def analyze(self, fn: Function, with_sites: bool = False) -> _Summary:
        s = self.summaries.get(id(fn))
        if s is not None and (s.has_sites or not with_sites):
            return s
        self.in_progress.add(fn.name)
        try:
            a = _FnAnalysis(self, fn)
            a.build()
            if not fn.is_entry:
                a.prov["$shared"] = {_SH}
            a.fixpoint()
            s = a.collect(with_sites)
            s.loaded_params = a.loaded_params
        finally:
            self.in_progress.discard(fn.name)
        self.summaries[id(fn)] = s
        return s


def _unknown_summary(name: str, reason: str) -> _Summary:
    return _Summary(name, [], {}, [], set(), unknown=reason)


# --------------------------------------------------------------------------------------------------
# attribution for an entry


class _PState:
    __slots__ = ("mode", "reasons", "indirect", "ind_reason", "ind_mode", "fields", "tmap", "tmap_reason",
                 "used", "hint")

    def __init__(self) -> None:
        self.mode = 0
        self.reasons: list[tuple[int, str]] = []
        self.indirect = False
        self.ind_reason = ""
        self.ind_mode = 0
        self.fields: dict[int, _PState] = {}
        self.tmap = False
        self.tmap_reason = ""
        self.used = False
        self.hint = ""

    def add(self, mode: int, reason: str) -> None:
        self.used = True
        if mode & ~self.mode:
            self.reasons.append((mode & ~self.mode, reason))
            self.mode |= mode

    def reason(self) -> str:
        return "; ".join(r for _, r in self.reasons)


class _Attribution:
    """Turns an entry's effects into per-parameter accesses (see the module docstring's rules)."""

    def __init__(self, module: Module, fn: Function, summary: _Summary) -> None:
        self.module = module
        self.fn = fn
        self.summary = summary
        self.params = fn.params
        self.st = [_PState() for _ in fn.params]
        self.alias: list[tuple[int, str]] = []     # accesses through addresses that no parameter explains
        self.is_agg = [p.array is not None and p.type not in _OPAQUE for p in fn.params]

    def target(self, i, off) -> list[_PState]:
        """The state(s) an origin (parameter i, byte offset off) stands for: the parameter, or fields."""
        if i is None or i >= len(self.params):
            return []
        s = self.st[i]
        if not self.is_agg[i]:
            return [s]
        if off is None:
            return [s.fields.setdefault(o, _PState()) for o in range(0, max(self.params[i].size - 7, 1), 8)]
        # a narrower piece belongs to the 8-byte slot holding it (pointers are 8-byte aligned)
        return [s.fields.setdefault(off - off % 8, _PState())]

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

    def _address(self, e: _Effect) -> None:
        base = _select_base(e.origins)
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
                self.alias.append((e.mode, f"{e.reason} through an address loaded from memory"))
            elif k == "U":
                self.alias.append((e.mode, f"{e.reason} through an address of unknown origin"))
        for o in e.origins:
            if o[0] == "L" and o not in base and o[1] is not None:
                self.mark_ind(o[1], o[2], 0, f"values loaded from it index {e.reason}")

    def _descriptor(self, e: _Effect) -> None:
        for o in e.origins:
            k, i = o[0], o[1]
            if k in ("A", "P") and i is not None and i < len(self.params):
                s = self.st[i]
                s.tmap = True
                s.tmap_reason = s.tmap_reason or e.reason
                s.used = True
                if e.mode:
                    s.add(e.mode, e.reason)
                if k == "P" and not self.is_agg[i] and e.role == "tmap":
                    # a pointer to a tensor map in memory: the map is read from the parameter's memory, and
                    # the tensor it describes is chosen by memory contents
                    s.add(_R, f"{e.reason} (tensor map read from memory)")
                    self.mark_ind(i, None, e.mode, f"tensor map loaded from it ({e.reason})")
                    if e.mode:
                        self.alias.append((e.mode, f"{e.reason} through a tensor map in memory"))
            elif k in ("L", "U", "G"):
                if k == "L":
                    self.mark_ind(i, o[2], e.mode, f"tensor map address loaded from it ({e.reason})")
                if e.mode or k != "L":
                    self.alias.append((e.mode, f"{e.reason} through a descriptor that is not an argument"))

    def _escape(self, e: _Effect) -> None:
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
                self.alias.append((e.mode, f"pointer loaded from memory {e.reason}"))
            elif k == "U":
                self.alias.append((e.mode, f"pointer of unknown origin {e.reason}"))

    def _kind(self, i: int, triton_style: bool) -> str:
        p, s = self.params[i], self.st[i]
        if p.type in _OPAQUE or s.tmap:
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
        p, s = self.params[i], self.st[i]
        kind = self._kind(i, triton_style)
        if alias_loaded and self.alias and (kind != "scalar" or (self.is_agg[i] and p.size >= 8)
                                            or (p.size == 8 and not triton_style)):
            if kind == "scalar":
                kind = "struct" if self.is_agg[i] else "pointer"
            for mode, reason in self.alias:
                s.add(mode, f"{reason} (may alias any argument)")
                for f in s.fields.values():
                    f.add(mode, f"{reason} (may alias any argument)")
        fields = []
        if kind == "struct":
            for off in sorted(s.fields):
                f = s.fields[off]
                s.mode |= f.mode
                for r in f.reasons:
                    if r not in s.reasons:
                        s.reasons.append(r)
                fields.append(FieldAccess(off, ACCESSES[f.mode], f.indirect,
                                          f.reason() or f.ind_reason or "never dereferenced"))
        if kind == "scalar":
            reason = f"scalar .{p.type}" + (f"[{p.array}]" if p.array is not None else "")
            return ParamAccess(i, p.name, kind, "none", s.indirect, reason, fields, ACCESSES[s.ind_mode])
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
        return ParamAccess(i, p.name, kind, ACCESSES[s.mode], s.indirect, reason, fields, ACCESSES[s.ind_mode])


def _kernel_access(module: Module, fn: Function, summary: _Summary, alias_loaded: bool) -> KernelAccess:
    att = _Attribution(module, fn, summary)
    att.run()
    triton_style = any(p.ptr for p in fn.params)
    out = [att.param(i, triton_style, alias_loaded) for i in range(len(fn.params))]
    unexplained = 0
    for mode, _ in att.alias:
        unexplained |= mode
    return KernelAccess(fn.name, module.file, bool(att.alias) or any(p.indirect for p in out), out, module.target,
                        fn.start_line, ACCESSES[unexplained], [r for _, r in att.alias[:8]])


def _give_up(module: Module, fn: Function, reason: str) -> KernelAccess:
    """The conservative answer for a kernel that could not be analysed."""
    params = []
    for i, p in enumerate(fn.params):
        if p.type in _OPAQUE:
            params.append(ParamAccess(i, p.name, "descriptor", "read-write", True, reason))
        elif p.array is not None and p.size >= 8:
            params.append(ParamAccess(i, p.name, "struct", "read-write", True, reason,
                                      [FieldAccess(o, "read-write", True, reason) for o in range(0, p.size - 7, 8)]))
        elif p.size >= 8 or p.ptr:
            params.append(ParamAccess(i, p.name, "pointer", "read-write", True, reason))
        else:
            params.append(ParamAccess(i, p.name, "scalar", "none", False, f"scalar .{p.type}"))
    return KernelAccess(fn.name, module.file, True, params, module.target, fn.start_line, "read-write", [reason])


# --------------------------------------------------------------------------------------------------
# public API


def analyze_module(module: Module, *, alias_loaded: bool = False) -> list[KernelAccess]:
    """Analyse every `.entry` of a parsed module: one `KernelAccess` per kernel, in module order.
    Should the analysis of a kernel fail (a bug), that kernel gets the conservative answer (every
    parameter that may hold a pointer read-write, indirect) and the failure is added to
    `module.errors`.

    Accesses through addresses loaded from memory belong to no parameter: they set `indirect` on the
    parameter the pointer was loaded from (and on the kernel) and are summarised in
    `KernelAccess.indirect_access`. With `alias_loaded=True` they are also given to every parameter
    that may hold a pointer (the loaded pointer may alias any argument)."""
    ctx = _ModuleCtx(module)
    out = []
    enabled = gc.isenabled()
    gc.disable()            # many small sets and tuples, no cycles worth collecting
    try:
        for fn in module.functions:
            if fn.is_entry:
                try:
                    out.append(_kernel_access(module, fn, ctx.analyze(fn), alias_loaded))
                except Exception as e:  # noqa: BLE001 - a bug must not make other kernels, or this one, unsafe
                    ctx.in_progress.clear()
                    message = (f"internal error analysing .entry {fn.name} ({type(e).__name__}: {e}); "
                               f"every parameter that may hold a pointer is reported read-write")
                    module.errors.append(PtxSyntaxError(module.file, fn.start_line, message))
                    out.append(_give_up(module, fn, message))
    finally:
        if enabled:
            gc.enable()
    return out


def access_sites(module: Module, function: str) -> list[AccessSite]:
    """The global/generic memory access sites of one function, in body order. `params` of a site are
    indices of that function's own parameters (entry parameters for a kernel) the address may
    derive from; accesses proven to hit only shared, local or parameter memory are left out."""
    ctx = _ModuleCtx(module)
    fn = module.function(function)
    if fn is None:
        raise KeyError(f"no function {function!r} in {module.file}")
    return list(ctx.analyze(fn, with_sites=True).sites)


def analyze_ptx(text: str, file: str = "<ptx>", *, alias_loaded: bool = False
                ) -> tuple[list[KernelAccess], list[PtxSyntaxError]]:
    """Parse and analyse PTX text: the kernels that could be analysed, and the errors found (syntax
    errors, and internal errors for which a kernel got the conservative all-read-write answer)."""
    enabled = gc.isenabled()
    gc.disable()  # parse and analysis create no cycles; freeing the module before collecting saves a scan
    try:
        module = parse_ptx(text, file)
        kernels = analyze_module(module, alias_loaded=alias_loaded)
        errors = list(module.errors)
        del module
    finally:
        if enabled:
            gc.enable()
    return kernels, errors
