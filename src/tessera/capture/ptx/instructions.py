"""What the PTX analysis knows about instructions: opcode classes, state spaces, operand text.

The tables sort opcodes by what the dataflow does with them (no provenance, a union of the sources,
an index-like result, a tracked integer range, ...); the helpers read state spaces, vector and
element sizes, and addresses out of an instruction's modifiers and operand text. Everything here is
a pure function of the instruction text, and the costlier helpers are cached per string.
"""

from __future__ import annotations

from typing import NamedTuple

from tessera.capture.ptx.parse import TYPE_SIZES, Instruction, parse_int

__all__ = [
    "ALU_CLASS", "ALU_FORMS", "ALU_INDEX", "ALU_NONE", "ALU_SELECT", "ALU_TO_ADDRESS", "ALU_UNION", "INT_TYPES",
    "MAD", "NO_ACCESS", "NO_PROVENANCE", "OFFSET_RULE", "OPAQUE_TYPES", "RANGE_OPS", "SCALED", "SHARED_ONLY",
    "SPECIAL_REGS", "AluForm", "MemoryType", "address_parts", "address_text", "alu_form", "cvt_widens", "elements",
    "first_space", "int_size", "is_immediate", "memory_type", "offset_rule", "opname", "site_space", "space_of",
    "tracks_range", "type_info",
]

OPAQUE_TYPES = ("texref", "samplerref", "surfref")      # parameter types that are handles, not memory

# The fast path of the transfer builder: ALU opcodes with plain operands, by what their result holds.
# Opcodes not listed (memory, calls, anything unknown) go through the general classification.
ALU_NONE, ALU_UNION, ALU_INDEX, ALU_TO_ADDRESS, ALU_SELECT, ALU_MAD = range(6)
ALU_CLASS = {op: ALU_NONE for op in ("setp", "set", "testp", "isspacep", "vote", "activemask", "istypep", "bar",
                                     "barrier", "membar", "fence", "griddepcontrol", "setmaxnreg", "nanosleep",
                                     "pmevent", "trap", "brkpt", "exit", "ret", "bra", "brx", "createpolicy",
                                     "elect", "ldmatrix", "stmatrix", "movmatrix", "wgmma", "tcgen05", "mma",
                                     "match", "mbarrier")}
ALU_CLASS.update({op: ALU_UNION for op in ("mov", "add", "sub", "and", "or", "xor", "not", "neg", "abs", "min",
                                           "max", "shr", "div", "rem", "fma", "rcp", "sqrt", "rsqrt", "ex2",
                                           "lg2", "sin", "cos", "tanh", "copysign", "bfe", "bfi", "prmt", "popc",
                                           "clz", "brev", "bfind", "shf", "addc", "subc", "cnot", "lop3", "fns",
                                           "shfl", "redux")})
# cvt is index-like only when it widens a 32-bit value
ALU_CLASS.update({op: ALU_INDEX for op in ("mul", "mul24", "shl", "dp4a", "dp2a", "cvt")})
ALU_CLASS.update({"cvta": ALU_TO_ADDRESS, "selp": ALU_SELECT, "slct": ALU_SELECT, "mad": ALU_MAD,
                  "mad24": ALU_MAD})
SPECIAL_REGS = {"%laneid", "%warpid", "%nwarpid", "%smid", "%nsmid", "%gridid", "%clock", "%clock64",
                "%globaltimer", "%lanemask_eq", "%lanemask_le", "%lanemask_lt", "%lanemask_ge",
                "%lanemask_gt", "%total_smem_size", "%dynamic_smem_size", "%aggr_smem_size",
                "%is_explicit_cluster", "%cluster_ctarank", "%cluster_nctarank", "%current_graph_exec"}
# What arithmetic does to the offset of a parameter or local address: 0 keeps it, 1 shifts it by the
# other operand's range, 2 (every opcode not listed) forgets it
OFFSET_RULE = {**{op: 0 for op in ("mov", "cvta", "cvt", "selp", "slct")}, "add": 1, "sub": 1, "mad": 1}
# integer operations whose result range is tracked (to bound offsets into local arrays of pointers)
RANGE_OPS = {"mov", "cvt", "and", "or", "add", "sub", "shl", "shr", "mul", "mad", "rem", "min", "max",
             "selp", "bfe"}
NO_PROVENANCE = {"setp", "set", "testp", "isspacep", "vote", "activemask", "istypep", "mbarrier", "bar",
                 "barrier", "membar", "fence", "griddepcontrol", "setmaxnreg", "nanosleep", "pmevent", "trap",
                 "brkpt", "exit", "ret", "bra", "brx", "createpolicy", "getctarank", "elect", "txq", "suq",
                 "ldmatrix", "stmatrix", "movmatrix", "wgmma", "tcgen05", "clusterlaunchcontrol", "alloca",
                 "stacksave", "stackrestore", "mma", "match"}
# instructions whose bracketed addresses can only be shared/tensor memory (never global)
SHARED_ONLY = {"mbarrier", "ldmatrix", "stmatrix", "movmatrix", "wgmma", "tcgen05", "clusterlaunchcontrol",
               "barrier", "bar", "alloca", "stackrestore", "stacksave", "getctarank", "mapa"}
SCALED = {"mul", "mul24", "shl", "dp4a", "dp2a"}
MAD = {"mad", "mad24", "madc", "sad"}
NO_ACCESS = {"prefetch", "prefetchu", "applypriority"}
INT_TYPES = frozenset(t for t in TYPE_SIZES if t[0] in "usb")


def cvt_widens(mods: list[str], wide_addresses: bool) -> bool:
    """Whether a cvt widens a narrower value to 64 bits on a 64-bit target (an index-like result)."""
    return wide_addresses and len(mods) >= 2 and TYPE_SIZES.get(mods[-2], 0) == 8 and TYPE_SIZES.get(mods[-1], 8) < 8


def tracks_range(op: str, mods: list[str]) -> bool:
    """Whether an instruction defines an integer whose value range is tracked."""
    return bool(op in RANGE_OPS and mods and (mods[-1] if op != "cvt" else mods[-2]) in INT_TYPES)


def offset_rule(op: str, mods: list[str]) -> int:
    """What the instruction does to parameter and local address offsets (see OFFSET_RULE)."""
    rule = OFFSET_RULE.get(op, 2)
    return 2 if rule == 1 and "hi" in mods else rule


class AluForm(NamedTuple):
    """What the transfer builder's fast path needs to know of one dotted ALU opcode."""

    cls: int            # its ALU class; a cvt is ALU_INDEX only when it widens (cvt_widens)
    definite: bool      # cvta.to.global: the result is a definite global address
    ranged: bool        # tracks_range
    offset_rule: int    # offset_rule


# dotted opcode -> AluForm, for 32-bit (False) and 64-bit (True) targets
ALU_FORMS: dict[bool, dict[str, AluForm]] = {False: {}, True: {}}


def alu_form(ins: Instruction, wide_addresses: bool) -> AluForm:
    """The AluForm of an instruction of ALU_CLASS (cached per dotted opcode)."""
    op, mods = ins.opcode, ins.modifiers
    cls = ALU_CLASS[op]
    if cls == ALU_INDEX and op == "cvt" and not cvt_widens(mods, wide_addresses):
        cls = ALU_UNION
    definite = cls == ALU_TO_ADDRESS and len(mods) > 1 and mods[0] == "to" and mods[1] == "global"
    form = AluForm(cls, definite, tracks_range(op, mods), offset_rule(op, mods))
    cache = ALU_FORMS[wide_addresses]
    if ins.name and len(cache) < 65536:
        cache[ins.name] = form
    return form


class MemoryType(NamedTuple):
    """The state space, vector count and element size of a memory instruction."""

    space: str
    vector: int
    size: int


def int_size(mods: list[str]) -> int:
    """Byte size of the first type modifier (8 when there is none)."""
    for m in mods:
        if m in TYPE_SIZES:
            return TYPE_SIZES[m]
    return 8


def space_of(mods: list[str]) -> str:
    """The state space named by the modifiers: global, shared, local, const, param or generic."""
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


def site_space(mods: list[str]) -> str:
    """The space an access site reports: global, or generic for anything else."""
    return "global" if space_of(mods) == "global" else "generic"


def first_space(mods: list[str]) -> str | None:
    """The first of global/shared in the modifiers (the destination of a copy), or None."""
    for m in mods:
        if m == "global":
            return "global"
        if m.startswith("shared"):
            return "shared"
    return None


_MEMORY_TYPES: dict[str, MemoryType] = {}


def memory_type(ins: Instruction) -> MemoryType:
    """The state space, vector count and element size of a memory instruction."""
    key = ins.name or ".".join([ins.opcode, *ins.modifiers])
    r = _MEMORY_TYPES.get(key)
    if r is None:
        mods = ins.modifiers
        vec, size = type_info(mods)
        r = MemoryType(space_of(mods), vec, size)
        if len(_MEMORY_TYPES) < 65536:
            _MEMORY_TYPES[key] = r
    return r


def type_info(mods: list[str]) -> tuple[int, int]:
    """(vector count, element size) from modifiers such as ['global', 'nc', 'v4', 'f32']."""
    vec = 1
    size = 0
    for m in mods:
        if m in TYPE_SIZES:
            size = TYPE_SIZES[m]
        elif m in ("v2", "v4", "v8"):
            vec = int(m[1])
    return vec, size


def opname(ins: Instruction) -> str:
    """The dotted opcode as written, e.g. `ld.global.nc.v4.f32`."""
    return ins.name or ".".join([ins.opcode, *ins.modifiers])


_ADDRESS_PARTS: dict[str, tuple[str | None, int]] = {}


def address_parts(op: str) -> tuple[str | None, int]:
    """`[%rd4+16]` -> ('%rd4', 16); `[sym]` -> ('sym', 0); `[%rd1, {%r3, %r4}]` -> ('%rd1', 0)."""
    r = _ADDRESS_PARTS.get(op)
    if r is None:
        r = _address_parts(op)
        if len(_ADDRESS_PARTS) < 65536:
            _ADDRESS_PARTS[op] = r
    return r


def _address_parts(op: str) -> tuple[str | None, int]:
    inner = address_text(op)
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


def address_text(op: str) -> str:
    """The address inside a bracketed operand, without blanks: `[%rd4 + 16]` -> `%rd4+16`."""
    inner = op[1:-1]
    if "," in inner:
        inner = inner.split(",", 1)[0]
    return inner.replace(" ", "").replace("\t", "")


def is_immediate(op: str) -> bool:
    """Whether an operand is an integer literal."""
    c = op[0]
    return c.isdigit() or (c == "-" and len(op) > 1 and (op[1].isdigit()))


def elements(op: str) -> list[str]:
    """Elements of a vector operand `{%f1, %f2}` (a plain operand is one element)."""
    if op and op[0] == "{":
        return [e.strip() for e in op[1:-1].split(",") if e.strip()]
    if "|" in op:
        return [e.strip() for e in op.split("|")]
    return [op]
