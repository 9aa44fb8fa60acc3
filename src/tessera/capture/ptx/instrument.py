"""Range instrumentation of PTX: record, per access site, the lowest and highest byte each launch touched.

The technique of the Tessera paper. For every `.entry` kernel:

1. an extra parameter `.param .u64 __tessera_ranges` is appended (a device pointer to `16 x sites`
   bytes that the launcher initialises to (UINT64_MAX, 0) per slot);
2. it is loaded once at the top of the body (`ld.param.u64` + `cvta.to.global.u64`);
3. before each global or generic access site k, under the same predicate as the access,
   `atom.global.min.u64 [buf + 16k]` records the site's first byte address and
   `atom.global.max.u64 [buf + 16k + 8]` its last byte address (first + width - 1; `width` is the
   vector count x element size of the access, or the copy size of a `cp.async`).

Slots are numbered per kernel from 0, in body order; `InstrumentResult.sites` maps them back to lines.
Generic accesses are recorded with their generic address. `.shared`, `.local`, `.const` and `.param`
accesses are not instrumented. Sites that cannot be instrumented are listed in `skipped` and must be
treated conservatively (the whole buffer): bulk tensor copies through tensor maps (their addresses
are computed by the TMA unit from a descriptor), address forms that are not `[reg]`/`[reg+imm]`/
`[symbol+imm]`, and every access inside a `.func` (only entries are instrumented; a callee's accesses
are attributed to the caller's parameters by the analysis, conservatively).

A `cp.async` with a `src-size` operand records `src-size` bytes (none when it is 0, as in masked
copies), and one with an `ignore-src` predicate records nothing when the predicate is set.

Which instructions are access sites, their mode, width and the entry parameters their address derives
from come from the analysis (`tessera.capture.ptx.analyze.access_sites`); what the rewrite needs
besides (where each statement is in the text, its address operand, copy sizes held in registers) is
read here from the statement text. A site of a copy whose size is a register reports width 0: its
size is only known at run time, and the recorded range uses it. A function the parser cannot read
is left as it is and reported in `skipped`.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from tessera.capture.ptx.analyze import access_sites
from tessera.capture.ptx.parse import Module, parse_int, parse_ptx, split_operands

BUFFER_PARAM = "__tessera_ranges"
SLOT_BYTES = 16

_SPACES = ("global", "shared", "local", "const", "param")

_COMMENT_OR_STRING_RE = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:[^"\\\n]|\\.)*"', re.DOTALL)
_FUNCTION_RE = re.compile(r"\.(entry|func)\b")
_IDENT_RE = re.compile(r"[A-Za-z_$%][\w$]*")
_LABEL_RE = re.compile(r"[A-Za-z_$%][\w$]*\s*:(?!:)")
_PRED_RE = re.compile(r"@\s*(!?\s*%?[\w$]+)\s+")
_TOKEN_RE = re.compile(r"[\w.:$]+")
_PARAM_NAME_RE = re.compile(r"([A-Za-z_$%][\w$]*)\s*(?:\[\s*\d*\s*\]\s*)*$")
_ADDRESS_RE = re.compile(r"^(%?[A-Za-z_$][\w$]*)(?:([+-])(-?(?:0[xX][0-9a-fA-F]+|\d+)))?$")
_REG_RANGE_RE = re.compile(r"^(.*?)<(\d+)>$")


@dataclass
class InstrumentResult:
    """Instrumented PTX and what was done to it.

    `sites`: {"function", "line", "slot", "mode", "width", "params"} per instrumented site (slot k uses
    bytes [16k, 16k+16) of the ranges buffer: min, then max). `skipped`: {"function", "line",
    "reason"} per access that is not recorded and must be treated conservatively. `buffer_param`: the
    name of the appended `.u64` parameter (the last parameter of every entry).
    """

    text: str
    sites: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    buffer_param: str = BUFFER_PARAM


def instrument_ptx(text: str, file: str = "<ptx>") -> InstrumentResult:
    """Instrument every `.entry` of a PTX module to record per-site [first, last] byte addresses."""
    masked = _mask(text)
    source = _Source(text, masked)
    buffer_param = _unique_name(masked, BUFFER_PARAM, prefix="")
    regs = _Registers(_unique_name(masked, "%tsr", prefix="%"))
    analysis = _Analysis(parse_ptx(text, file))
    result = InstrumentResult(text=text, buffer_param=buffer_param)
    edits: list[tuple[int, str]] = []
    for fn in _functions(source):
        found = analysis.sites(fn)
        if isinstance(found, str):  # the analysis could not parse this function
            result.skipped.append({"function": fn.name, "line": fn.line, "reason": found})
            continue
        if not fn.is_entry:
            for site in found:
                result.skipped.append({"function": fn.name, "line": site.line, "reason":
                                       f"in .func {fn.name}: callees are not instrumented; the analysis "
                                       "attributes this access to the caller's parameters conservatively"})
            continue
        edits.extend(_instrument_entry(source, fn, found, buffer_param, regs, result))
    # from the end backwards; edits at one offset keep their order (the later one is applied first)
    for _, offset, insert in sorted(((i, o, t) for i, (o, t) in enumerate(edits)), key=lambda e: (e[1], e[0]),
                                    reverse=True):
        text = text[:offset] + insert + text[offset:]
    result.text = text
    return result


# ------------------------------------------------------------------------------------ source model


@dataclass
class _Stmt:
    """One statement of a function body: offsets into the text, its first line, and its parts."""

    start: int
    end: int
    line: int
    end_line: int
    text: str  # comments blanked, without the `;`
    predicate: str | None
    token: str  # opcode with its modifiers, e.g. "ld.global.nc.v4.f32"
    operands: list[str]

    @property
    def opcode(self) -> str:
        return self.token.split(".", 1)[0]

    @property
    def modifiers(self) -> list[str]:
        return self.token.split(".")[1:]


@dataclass
class _Fn:
    """A function of the module as far as instrumentation needs it: where to insert, and what it has."""

    name: str
    is_entry: bool
    line: int
    end_line: int
    params: list[str]
    params_close: int | None  # offset of the `)` closing the parameter list (None: no list)
    name_end: int
    body_open: int
    body_close: int
    stmts: list[_Stmt]
    reg_types: dict[str, str]
    reg_ranges: dict[str, tuple[str, int]]

    def reg_type(self, name: str) -> str | None:
        """The declared type of a register (e.g. "b64", "pred"), or None if it is not declared here."""
        if name in self.reg_types:
            return self.reg_types[name]
        match = re.match(r"^(.*?)(\d+)$", name)
        if match and match.group(1) in self.reg_ranges:
            type_, count = self.reg_ranges[match.group(1)]
            if int(match.group(2)) < count:
                return type_
        return None

    def is_register(self, name: str) -> bool:
        return name.startswith("%") or self.reg_type(name) is not None


@dataclass
class _Source:
    text: str
    masked: str
    line_starts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", self.text)]

    def line(self, offset: int) -> int:
        return bisect.bisect_right(self.line_starts, offset)

    def indent(self, offset: int) -> str:
        """Whitespace before `offset` on its line if only whitespace precedes it there, else a tab."""
        start = self.line_starts[self.line(offset) - 1]
        before = self.text[start:offset]
        return before if before.strip() == "" else "\t"


def _mask(text: str) -> str:
    """The text with comments and string literals blanked out (same length, newlines kept)."""
    return _COMMENT_OR_STRING_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _unique_name(masked: str, name: str, prefix: str) -> str:
    """`name`, or `name` with a suffix, such that no identifier of the module starts with it.

    Register prefixes get letter suffixes (`%tsr_a`): ptxas rejects `%x_1<4>`-style declarations of a
    prefix that ends in a digit.
    """
    candidate, n = name, 0
    while re.search(re.escape(candidate) + (r"[\w$<]" if prefix else r"\b"), masked):
        n += 1
        candidate = f"{name}_{_letters(n)}" if prefix else f"{name}_{n}"
    return candidate


def _letters(n: int) -> str:
    """1 -> "a", 26 -> "z", 27 -> "aa", ..."""
    out = ""
    while n > 0:
        n, r = divmod(n - 1, 26)
        out = chr(ord("a") + r) + out
    return out


def _skip_space(masked: str, i: int) -> int:
    while i < len(masked) and masked[i].isspace():
        i += 1
    return i


def _matching(masked: str, i: int, open_: str, close: str) -> int:
    """Offset of the bracket closing the one at `i` (len(masked) if it is never closed)."""
    depth = 0
    for j in range(i, len(masked)):
        if masked[j] == open_:
            depth += 1
        elif masked[j] == close:
            depth -= 1
            if depth == 0:
                return j
    return len(masked)


def _functions(src: _Source) -> list[_Fn]:
    """Every `.entry` and `.func` with a body, in text order."""
    masked, functions, resume = src.masked, [], 0
    for match in _FUNCTION_RE.finditer(masked):
        if match.start() < resume:
            continue
        i = _skip_space(masked, match.end())
        if match.group(1) == "func" and i < len(masked) and masked[i] == "(":  # return parameters
            i = _skip_space(masked, _matching(masked, i, "(", ")") + 1)
        name = _IDENT_RE.match(masked, i)
        if not name:
            continue
        i = _skip_space(masked, name.end())
        params_close, params = None, []
        if i < len(masked) and masked[i] == "(":
            params_close = _matching(masked, i, "(", ")")
            params = _param_names(masked[i + 1:params_close])
            i = params_close + 1
        brace, semi = masked.find("{", i), masked.find(";", i)
        if brace < 0 or 0 <= semi < brace:  # a declaration (`.extern .func f(...);`), no body
            continue
        body_close = _matching(masked, brace, "{", "}")
        resume = body_close
        stmts = _statements(src, brace + 1, body_close)
        reg_types, reg_ranges = _declared_registers(stmts)
        functions.append(_Fn(name.group(0), match.group(1) == "entry", src.line(match.start()),
                             src.line(body_close), params,
                             params_close, name.end(), brace, body_close, stmts, reg_types, reg_ranges))
    return functions


def _param_names(params_text: str) -> list[str]:
    names = []
    for part in split_operands(params_text):
        match = _PARAM_NAME_RE.search(part.strip())
        if match:
            names.append(match.group(1))
    return names


def _statements(src: _Source, start: int, end: int) -> list[_Stmt]:
    """Statements of a body (labels, scope braces and `.loc`/`.file` lines left out)."""
    masked, stmts, i = src.masked, [], start
    while i < end:
        c = masked[i]
        if c.isspace() or c in "{}":
            i += 1
            continue
        if re.match(r"\.(loc|file)\b", masked[i:i + 6]):
            newline = masked.find("\n", i, end)
            i = end if newline < 0 else newline
            continue
        label = _LABEL_RE.match(masked, i)
        if label:
            i = label.end()
            continue
        j = masked.find(";", i, end)
        j = end if j < 0 else j
        stmts.append(_parse_statement(src, i, j))
        i = j + 1
    return stmts


def _parse_statement(src: _Source, start: int, end: int) -> _Stmt:
    text = " ".join(src.masked[start:end].split())
    predicate, rest = None, text
    pred = _PRED_RE.match(text)
    if pred:
        predicate, rest = pred.group(1).replace(" ", ""), text[pred.end():]
    token = _TOKEN_RE.match(rest)
    token_text = token.group(0) if token else ""
    operands = [o.strip() for o in split_operands(rest[len(token_text):]) if o.strip()]
    return _Stmt(start, end, src.line(start), src.line(end), text, predicate, token_text, operands)


def _declared_registers(stmts: list[_Stmt]) -> tuple[dict[str, str], dict[str, tuple[str, int]]]:
    types: dict[str, str] = {}
    ranges: dict[str, tuple[str, int]] = {}
    for stmt in stmts:
        if stmt.token != ".reg":
            continue
        words = stmt.text.split(None, 1)[1] if " " in stmt.text else ""
        type_ = next((w[1:] for w in words.replace(",", " ").split() if w.startswith(".") and
                      not w.startswith(".v")), "")
        names = re.sub(r"(\.[\w]+\s*)+", "", words, count=1)
        for name in (n.strip() for n in names.split(",")):
            ranged = _REG_RANGE_RE.match(name)
            if ranged:
                ranges[ranged.group(1)] = (type_, int(ranged.group(2)))
            elif name:
                types[name] = type_
    return types, ranges


# ------------------------------------------------------------------------------------ access sites


@dataclass
class _Site:
    """An access site ready to instrument: the analysis's site, its statement, and its copy size."""

    function: str
    line: int
    stmt: _Stmt | None
    space: str
    mode: str
    address: str
    width: int
    params: list[int]
    predicate: str | None
    instrumentable: bool = True
    reason: str = ""
    size_operand: str | None = None  # a cp.async src-size or bulk copy size held in a register
    ignore_src: str | None = None  # a cp.async ignore-src predicate


def _space_of(modifier: str) -> str | None:
    base = modifier.split("::", 1)[0]
    return base if base in _SPACES else None


def _read_copy(stmt: _Stmt, fn: _Fn) -> _Site | None:
    """What the text says of a `cp.async` (non-bulk or bulk, not tensor) or `cp.reduce.async.bulk`
    touching global memory: its address operand and how many bytes it copies (a constant, or a
    `src-size`/bulk size register, or an `ignore-src` predicate)."""
    mods = stmt.modifiers
    reduce_ = mods[:2] == ["reduce", "async"]
    if not (mods[:1] == ["async"] or reduce_) or "prefetch" in mods:
        return None
    spaces = [s for s in map(_space_of, mods) if s]
    if "global" not in spaces:
        return None
    ops = list(stmt.operands)
    to_global = spaces[0] == "global"
    mode = "read-write" if reduce_ else ("write" if to_global else "read")
    if "tensor" in mods or len(ops) < 3:  # tensor copies: addresses from a tensor map, not instrumented
        return None
    address = "".join(ops[0 if to_global else 1].strip("[]").split())
    site = _Site(fn.name, stmt.line, stmt, "global", mode, address, 0, [], stmt.predicate)
    if "L2::cache_hint" in mods:
        ops = ops[:-1]
    if "bulk" in mods:
        _set_size(site, ops[2], fn)
    else:
        site.width = parse_int(ops[2]) or 0
        if len(ops) > 3:
            extra = ops[3].lstrip("!")
            if fn.reg_type(extra) == "pred" or (fn.reg_type(extra) is None and extra.startswith("%p")):
                site.ignore_src = ops[3]
            else:
                _set_size(site, ops[3], fn)
    return site


def _set_size(site: _Site, operand: str, fn: _Fn) -> None:
    """A copy size: an immediate becomes the width, a register is read at run time."""
    value = parse_int(operand)
    if value is not None:
        site.width = value
        if value == 0:
            site.instrumentable, site.reason = False, "copies 0 bytes: accesses nothing"
    elif fn.is_register(operand):
        site.size_operand = operand
    else:
        site.instrumentable = False
        site.reason = f"copy size {operand!r} not understood; treated conservatively"


class _Analysis:
    """Access sites from the analysis (`tessera.capture.ptx.analyze.access_sites`), tied to statements."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self.functions = {f.name for f in module.functions}

    def sites(self, fn: _Fn) -> list[_Site] | str:
        """The analysis's sites of `fn`, each tied to its statement; a reason string if it has none."""
        if fn.name not in self.functions:
            errors = [str(e) for e in self.module.errors if fn.line <= e.line <= fn.end_line] + ["no body"]
            return f"not instrumented: the function could not be parsed ({errors[0]})"
        sites, used = [], set()
        for a in access_sites(self.module, fn.name):
            stmt = self._statement(fn, a, used)
            predicate = a.predicate.lstrip("@").replace(" ", "") if a.predicate else None
            site = _Site(fn.name, a.line, stmt, a.space, a.mode, "".join(a.address.split()), a.width,
                         list(a.params), predicate, a.instrumentable, a.reason)
            if stmt is None:
                if site.instrumentable:
                    site.instrumentable, site.reason = False, "the access statement could not be located"
            else:
                self._refine(site, _read_copy(stmt, fn) if stmt.opcode == "cp" else None)
            sites.append(site)
        return sites

    @staticmethod
    def _refine(site: _Site, own: _Site | None) -> None:
        """Copy sizes from the statement itself: a src-size or bulk size register is read at run time
        (so such a copy is instrumentable after all), an immediate src-size narrows the copy, and a
        copy of 0 bytes accesses nothing."""
        if own is None or own.space != site.space or site.space == "bulk-tensor":
            return
        site.size_operand, site.ignore_src = own.size_operand, own.ignore_src
        if own.width and (not site.width or own.width < site.width):
            site.width = own.width
        if not own.instrumentable:
            site.instrumentable, site.reason = False, own.reason
        elif not site.instrumentable and own.size_operand is not None:
            site.instrumentable, site.reason = True, ""

    @staticmethod
    def _statement(fn: _Fn, site, used: set[tuple[int, str]]) -> _Stmt | None:
        """The statement of a site: on its line, with its address operand, not yet taken."""
        wanted = "[" + "".join(site.address.split()) + "]"
        for i, stmt in enumerate(fn.stmts):
            if (i, wanted) in used or not stmt.line <= site.line <= stmt.end_line:
                continue
            if wanted in stmt.text.replace(" ", ""):
                used.add((i, wanted))
                return stmt
        return None


# ------------------------------------------------------------------------------------- rewriting


@dataclass
class _Registers:
    """Names of the registers the instrumentation declares (a prefix no identifier of the module has)."""

    prefix: str

    @property
    def buffer(self) -> str:
        return f"{self.prefix}0"

    @property
    def first(self) -> str:
        return f"{self.prefix}1"

    @property
    def last(self) -> str:
        return f"{self.prefix}2"

    @property
    def old(self) -> str:
        return f"{self.prefix}3"

    @property
    def word(self) -> str:
        return f"{self.prefix}w0"

    @property
    def pred(self) -> str:
        return f"{self.prefix}p0"

    def declarations(self) -> list[str]:
        p = self.prefix
        return [f".reg .b64 {p}<4>;", f".reg .b32 {p}w<1>;", f".reg .pred {p}p<1>;"]


def _instrument_entry(src: _Source, fn: _Fn, sites: list[_Site], buffer_param: str, regs: _Registers,
                      result: InstrumentResult) -> list[tuple[int, str]]:
    """Edits (offset, text to insert) for one entry; records its sites and skips in `result`."""
    edits = _param_edits(src, fn, buffer_param)
    slot = 0
    for site in sites:
        reason = site.reason if not site.instrumentable else _uninstrumentable(site, fn)
        if reason:
            result.skipped.append({"function": fn.name, "line": site.line, "reason": reason})
            continue
        lines = _site_code(site, slot, fn, regs)
        indent = src.indent(site.stmt.start)
        edits.append((site.stmt.start, "".join(f"{line}\n{indent}" for line in lines)))
        result.sites.append({"function": fn.name, "line": site.line, "slot": slot, "mode": site.mode,
                             "width": site.width, "params": list(site.params)})
        slot += 1
    if slot:
        body = [*regs.declarations(), f"ld.param.u64 {regs.buffer}, [{buffer_param}];",
                f"cvta.to.global.u64 {regs.buffer}, {regs.buffer};"]
        edits.append((fn.body_open + 1, "".join(f"\n\t{line}" for line in body)))
    return edits


def _param_edits(src: _Source, fn: _Fn, buffer_param: str) -> list[tuple[int, str]]:
    """Append the ranges buffer to the parameter list: a comma after the last parameter, the new one on
    its own line before the `)` (a comment after the last parameter stays with it)."""
    decl = f".param .u64 {buffer_param}"
    if fn.params_close is None:
        return [(fn.name_end, f"(\n\t{decl}\n)")]
    after_last = len(src.masked[:fn.params_close].rstrip())
    gap = src.masked[after_last:fn.params_close]
    edits = [(after_last, ",")] if fn.params else []
    if "\n" in gap:
        return [*edits, (after_last + gap.rindex("\n"), f"\n\t{decl}")]
    return [*edits, (fn.params_close, f" {decl}")]


def _uninstrumentable(site: _Site, fn: _Fn) -> str:
    """Why a site cannot be instrumented, or "" if it can."""
    if site.space == "bulk-tensor":
        return "bulk tensor copy through a tensor map; treated conservatively"
    if site.stmt is None:
        return "the access statement could not be located in the text"
    base = _ADDRESS_RE.match(site.address)
    if not base:
        return f"address form [{site.address}] not understood; treated conservatively"
    if fn.is_register(base.group(1)) and fn.reg_type(base.group(1)) not in (None, "b64", "u64", "s64"):
        return f"address register {base.group(1)} is not 64-bit; treated conservatively"
    if site.width <= 0 and site.size_operand is None:
        return "access width unknown; treated conservatively"
    return ""


def _site_code(site: _Site, slot: int, fn: _Fn, regs: _Registers) -> list[str]:
    """The statements recording one site: first/last byte address, then min/max atomics under its guard."""
    base = _ADDRESS_RE.match(site.address)
    name, sign, offset = base.group(1), base.group(2), base.group(3)
    offset_value = (int(offset, 0) * (-1 if sign == "-" else 1)) if offset else 0
    lines = [f"// tessera range slot {slot}: {site.mode} [{site.address}], {site.width} B"]
    if fn.is_register(name):
        lines.append(f"add.s64 {regs.first}, {name}, {offset_value};")
    else:
        lines += [f"mov.u64 {regs.first}, {name};", f"add.s64 {regs.first}, {regs.first}, {offset_value};"]
    guard = site.predicate
    size = site.size_operand
    if site.ignore_src is not None:  # bytes read: width when the ignore-src predicate is clear, else 0
        ignore = site.ignore_src.lstrip("!")
        when_set, when_clear = (site.width, 0) if site.ignore_src.startswith("!") else (0, site.width)
        lines.append(f"selp.u32 {regs.word}, {when_set}, {when_clear}, {ignore};")
        size = regs.word
    if size is not None:  # a size known at run time: last = first + size - 1, nothing when size is 0
        wide = fn.reg_type(size) in ("b64", "u64", "s64")
        lines += [f"mov.b64 {regs.last}, {size};" if wide else f"cvt.u64.u32 {regs.last}, {size};",
                  f"add.s64 {regs.last}, {regs.last}, {regs.first};",
                  f"add.s64 {regs.last}, {regs.last}, -1;"]
        type_ = "u64" if wide else "u32"
        lines.append(f"setp.ne.and.{type_} {regs.pred}, {size}, 0, {guard};" if guard
                     else f"setp.ne.{type_} {regs.pred}, {size}, 0;")
        guard = regs.pred
    else:
        lines.append(f"add.s64 {regs.last}, {regs.first}, {site.width - 1};")
    at = f"@{guard} " if guard else ""
    lines.append(f"{at}atom.global.min.u64 {regs.old}, [{regs.buffer}+{SLOT_BYTES * slot}], {regs.first};")
    lines.append(f"{at}atom.global.max.u64 {regs.old}, [{regs.buffer}+{SLOT_BYTES * slot + 8}], {regs.last};")
    return lines
