"""A fast, forgiving parser for PTX modules as emitted by nvcc, NVRTC and Triton (ISA 7.x-9.x).

The parser is line oriented with a regex fast path for the common "one statement per line" case, and
a character scanner for the rest (several statements on a line, statements spread over lines such
as nvcc's `call.uni` sequences, `{ }` scoping blocks of inline asm and call sequences).

It never raises on malformed input: a function whose header or body cannot be parsed is recorded as
a `PtxSyntaxError` with file and line and skipped, and parsing resumes with the next function.

Names declared inside nested `{ }` blocks (inline-asm temporaries, the `param0`/`retval0` of call
sequences) are scoped: every instruction carries the id of its innermost block (`Instruction.scope`),
and `Function.scope_parent`/`Function.decls` let an analysis resolve a name to its declaration.
"""

from __future__ import annotations

import gc
import re
from dataclasses import dataclass, field

from tessera.errors import TesseraError

__all__ = [
    "TYPE_SIZES", "Function", "Instruction", "Module", "Param", "PtxError", "PtxSyntaxError", "parse_int",
    "parse_ptx", "split_operands",
]


class PtxError(TesseraError):
    """A PTX input that cannot be used at all (unreadable file, no PTX in a binary)."""


TYPE_SIZES: dict[str, int] = {
    "b8": 1, "u8": 1, "s8": 1, "e4m3": 1, "e5m2": 1, "e2m3": 1, "e3m2": 1, "e2m1x2": 1, "pred": 1,
    "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2, "e4m3x2": 2, "e5m2x2": 2, "e2m3x2": 2, "e3m2x2": 2,
    "b32": 4, "u32": 4, "s32": 4, "f32": 4, "f16x2": 4, "bf16x2": 4, "tf32": 4, "e4m3x4": 4, "e5m2x4": 4,
    "b64": 8, "u64": 8, "s64": 8, "f64": 8, "f32x2": 8,
    "b128": 16,
}
_OPAQUE_TYPES = {"texref": 8, "samplerref": 8, "surfref": 8}


@dataclass(slots=True)
class Param:
    """One parameter of an `.entry` or `.func` (or one return parameter of a `.func`)."""

    name: str
    type: str
    size: int
    align: int | None = None
    array: int | None = None
    ptr: bool = False
    ptr_space: str | None = None
    texref_or_tensormap: bool = False
    line: int = 0


@dataclass(slots=True)
class Instruction:
    """One PTX instruction; `scope` is the id of its innermost `{ }` block (0: the function body)."""

    line: int
    text: str
    predicate: str | None
    opcode: str
    modifiers: list[str]
    operands: list[str]
    label: None = None
    scope: int = 0
    name: str = ""          # the dotted opcode as written, e.g. "ld.global.nc.v4.f32"


@dataclass
class Function:
    """An `.entry` (kernel) or `.func` (device function) with a body."""

    name: str
    is_entry: bool
    params: list[Param]
    returns: list[Param]
    body: list[Instruction]
    labels: dict[str, int]
    start_line: int
    end_line: int
    scope_parent: list[int] = field(default_factory=lambda: [0])
    decls: dict[tuple[str, int], str] = field(default_factory=dict)
    range_decls: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    directives: list[str] = field(default_factory=list)


@dataclass
class PtxSyntaxError:
    """A piece of PTX that could not be parsed, located by file and 1-based line."""

    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


@dataclass
class Module:
    """A parsed PTX module. `symbols` maps module-scope names to their kind: a state space
    (`global`, `const`, `shared`, `local`), `texref`/`surfref`/`samplerref`, `func` (a function
    with a body), `extern-func` (declared only) or `bad-func` (its body failed to parse)."""

    file: str
    version: str | None
    target: str | None
    address_size: int | None
    functions: list[Function]
    errors: list[PtxSyntaxError]
    symbols: dict[str, str] = field(default_factory=dict)

    def function(self, name: str) -> Function | None:
        """The function called `name`, or None."""
        for f in self.functions:
            if f.name == name:
                return f
        return None


# --------------------------------------------------------------------------------------------------
# regular expressions (compiled once)

_OPCODE = r"[a-z][a-z0-9_]*(?:\.[\w:]+)*"
# a whole line that is one instruction: optional predicate, opcode with modifiers, operands, ';'
_FAST_RE = re.compile(r"(@!?[%\w$]+\s+)?(" + _OPCODE + r")(?:\s+([^;]*))?;")
_COMMA_RE = re.compile(r"\s*,\s*")
_OPCODE_RE = re.compile(_OPCODE)
_TOP_RE = re.compile(r"(?:[^,{}\[\]()]+|\{[^{}]*\}|\[[^\[\]]*\]|\([^()]*\))+")
_INSTR_RE = re.compile(r"(@!?[%\w$]+\s+)?(" + _OPCODE + r")(?:\s+(.*))?", re.S)
_LABEL_RE = re.compile(r"([A-Za-z_$][\w$]*)\s*:(?!:)")
_LABEL_ONLY_RE = re.compile(r"[A-Za-z_$][\w$]*\s*:")
_HEADER_START_RE = re.compile(r"(?:\.(?:visible|extern|weak|common)\s+)*\.(?:entry|func)\b")
_HEADER_RE = re.compile(
    r"((?:\.(?:visible|extern|weak|common)\s+)*)\.(entry|func)\s*"
    r"(?:\.attribute\s*\([^)]*\)\s*)*"
    r"(?:\((?P<ret>[^()]*)\)\s*)?"
    r"(?:\.attribute\s*\([^)]*\)\s*)*"
    r"(?P<name>[A-Za-z_$%][\w$]*)\s*"
    r"(?:\((?P<params>[^()]*)\))?\s*(?P<rest>.*)", re.S)
_NOSEMI_DIRECTIVES = (".version", ".target", ".address_size", ".file", ".loc", ".maxntid", ".reqntid",
                      ".minnctapersm", ".maxnctapersm", ".maxnreg", ".maxclusterrank", ".reqnctapercluster",
                      ".explicitcluster", ".noreturn", ".blocksareclusters")
_ENDSTMT_RE = re.compile(r"[;{}]")
_NOSEMI_RE = re.compile(r"\.(?:" + "|".join(d[1:] for d in _NOSEMI_DIRECTIVES) + r")\b")
_LOCFILE_RE = re.compile(r"\.(?:loc|file)\b")
_SKIP_BODY_RE = re.compile(r"\.(?:loc|file|pragma)\b")
_RANGE_RE = re.compile(r"(.+)<(\d+)>$")
_ARRAY_RE = re.compile(r"\[\s*(\d*)\s*\]")
_IDENT_RE = re.compile(r"[A-Za-z_$%][\w$]*")
_DIRECTIVE_SPLIT_RE = re.compile(r"(?=\.\w)")


def parse_int(s: str) -> int | None:
    """A PTX integer literal (decimal, 0x hex, 0b binary, leading-0 octal, optional U suffix), or None."""
    s = s.strip().rstrip("Uu")
    try:
        return int(s, 0)
    except ValueError:
        pass
    try:
        neg = s.startswith("-")
        v = int(s.lstrip("+-"), 8)
        return -v if neg else v
    except ValueError:
        return None


def split_operands(s: str) -> list[str]:
    """Split `s` at commas that are not nested in (), [] or {} (one level, as in PTX); stripped parts.
    An empty part (two commas in a row) is kept as "" so that callers can reject it."""
    if ",," in s.replace(" ", "").replace("\t", ""):
        return [""]
    return [t.strip() for t in _TOP_RE.findall(s) if t.strip()] or [""]


_OPINFO: dict[str, tuple[str, tuple[str, ...]] | bool] = {}     # dotted opcode -> (opcode, modifiers)


def _opcode_info(head: str) -> tuple[str, tuple[str, ...]] | bool:
    """(opcode, modifiers) of a dotted opcode such as `ld.global.nc.v4.f32`, or False if it is not one."""
    if not _OPCODE_RE.fullmatch(head):
        return False
    parts = head.split(".")
    return parts[0], tuple(parts[1:])


def _balanced(s: str) -> bool:
    return s.count("[") == s.count("]") and s.count("{") == s.count("}") and s.count("(") == s.count(")")


def _strip_comments(s: str, in_block: bool) -> tuple[str, bool]:
    """Remove `//` and `/* */` comments from one line (not inside strings); tracks open block comments."""
    out = []
    i = 0
    n = len(s)
    while i < n:
        if in_block:
            j = s.find("*/", i)
            if j < 0:
                return "".join(out), True
            i = j + 2
            in_block = False
            out.append(" ")
            continue
        c = s[i]
        if c == '"':
            j = s.find('"', i + 1)
            j = n - 1 if j < 0 else j
            out.append(s[i:j + 1])
            i = j + 1
        elif c == "/" and i + 1 < n and s[i + 1] == "/":
            break
        elif c == "/" and i + 1 < n and s[i + 1] == "*":
            in_block = True
            i += 2
        else:
            j = i + 1
            while j < n and s[j] not in '"/':
                j += 1
            out.append(s[i:j])
            i = j
    return "".join(out), in_block


_PATTR_RE = re.compile(r"\.(\w+)(?:\s+(\d+))?")
_PATTR_CACHE: dict[str, tuple | None] = {}


def _param_attrs(attrs: str) -> tuple | None:
    """(type, element size, align, ptr, ptr space, opaque) of `.param .u64 .ptr .global .align 1`."""
    typ = None
    size = 0
    align = None
    ptr = False
    ptr_space = None
    opaque = False
    rest = _PATTR_RE.sub("", attrs).strip()
    if rest:
        return None
    for w, num in _PATTR_RE.findall(attrs):
        if w == "align":
            if not num:
                return None
            align = int(num)
        elif num:
            return None
        elif w == "ptr":
            ptr = True
        elif w in ("param", "reg"):
            pass
        elif ptr and w in ("global", "const", "local", "shared") and ptr_space is None:
            ptr_space = w
        elif w in TYPE_SIZES:
            typ, size = w, TYPE_SIZES[w]
        elif w in _OPAQUE_TYPES:
            typ, size, opaque = w, _OPAQUE_TYPES[w], True
        else:
            return None
    if typ is None:
        return None
    return typ, size, align, ptr, ptr_space, opaque


def _parse_param(decl: str, line: int) -> Param | None:
    """Parse `.param .align 8 .b8 name[24]`, `.param .u64 .ptr .global .align 1 name`, `.reg .b32 x`..."""
    d = decl.strip()
    array = None
    if d.endswith("]"):
        d, _, num = d[:-1].rpartition("[")
        num = num.strip()
        if not num.isdigit() and num:
            return None
        array = int(num) if num else 0
        d = d.rstrip()
    parts = d.rsplit(None, 1)
    if len(parts) != 2 or not _IDENT_RE.fullmatch(parts[1]):
        return None
    attrs, name = parts
    info = _PATTR_CACHE.get(attrs)
    if info is None:
        info = _param_attrs(attrs)
        if len(_PATTR_CACHE) < 4096:
            _PATTR_CACHE[attrs] = info or ()
    if not info:
        return None
    typ, size, align, ptr, ptr_space, opaque = info
    total = size * (array if array is not None else 1)
    return Param(name, typ, total, align, array, ptr, ptr_space, opaque, line)


def _decl_names(text: str) -> list[str]:
    """Names declared by a `.reg/.local/.shared/.param/...` statement (ranges kept as `%r<4>`)."""
    body = text.split("=", 1)[0]
    parts = [p.strip() for p in body.split(",")]
    names = []
    first = parts[0].replace("[", " [").split()
    cand = [t for t in first if not t.startswith(".") and not t.startswith("[")]
    # the first chunk is `.directive .type [.align N] name`: the name is the last non-number token
    cand = [t for t in cand if not t.isdigit()]
    if cand:
        names.append(cand[-1])
    for p in parts[1:]:
        t = p.split("[", 1)[0].strip()
        if t:
            names.append(t)
    return names


# --------------------------------------------------------------------------------------------------


class _Parser:
    def __init__(self, text: str, file: str) -> None:
        self.text = text
        self.file = file
        self.version: str | None = None
        self.target: str | None = None
        self.address_size: int | None = None
        self.functions: list[Function] = []
        self.errors: list[PtxSyntaxError] = []
        self.symbols: dict[str, str] = {}
        # module-level state
        self.state = "module"   # module | header | body | section | stmt
        self.buf: list[str] = []
        self.buf_line = 0
        self.section_depth = 0
        self.section_open = False
        # function state
        self.fn: Function | None = None
        self.fn_error: PtxSyntaxError | None = None
        self.scope_stack: list[int] = []
        self.pending: list[str] | None = None
        self.pending_line = 0
        self.pending_depth = 0
        self.pending_skip = False
        self.in_block = False
        self.append = None              # body.append while plain instructions can go straight in
        self.scope = 0
        self.opinfo = _OPINFO if len(_OPINFO) < 65536 else {}

    # ------------------------------------------------------------------ driver
    def run(self) -> Module:
        lines = self.text.splitlines()
        self._lines(lines, 1)
        self._eof(len(lines))
        return Module(self.file, self.version, self.target, self.address_size, self.functions, self.errors,
                      self.symbols)

    def _lines(self, lines: list[str], first: int) -> None:
        """Feed whole lines (numbered from `first`) through comment stripping and the state machine."""
        in_block = self.in_block
        locfile = _LOCFILE_RE.match
        opinfo = self.opinfo
        new_instr = Instruction
        label_only = _LABEL_ONLY_RE.fullmatch
        fast = _FAST_RE.fullmatch
        append, scope = self.append, self.scope
        in_section = self.state == "section"
        for lineno, raw in enumerate(lines, first):
            if in_section:
                # debug sections (`.section .debug_info { .b8 ... }`): only their braces matter
                if "{" in raw:
                    self.section_open = True
                    self.section_depth += raw.count("{")
                if "}" in raw:
                    self.section_depth -= raw.count("}")
                if self.section_open and self.section_depth <= 0:
                    self.state = "module"
                    in_section = False
                continue
            if in_block:
                s, in_block = _strip_comments(raw, True)
                s = s.strip()
            else:
                s = raw.strip()
                if not s:
                    continue
                c0 = s[0]
                if c0 == "/" and s[1:2] == "/":
                    continue
                if c0 == "." and s[1:2] in ("l", "f") and locfile(s) and self.pending is None \
                        and self.state != "stmt":
                    continue
                if "/" in s:
                    s, in_block = _strip_comments(s, False)
                    s = s.strip()
                    if not s:
                        continue
                elif append is not None and c0 == "." and scope == 0 and s[1:4] == "reg" and s[4:5] in " \t" \
                        and s.find(";") == len(s) - 1 and "{" not in s and "}" not in s:
                    continue      # function-scope register declarations need no bookkeeping
                elif append is not None and s[-1] == ":" and label_only(s):
                    self._label(s[:-1].rstrip())
                    continue
                # a line that only opens or closes a nested `{ }` block (not the function body)
                elif append is not None and s == "{":
                    fn = self.fn
                    scope = len(fn.scope_parent)
                    fn.scope_parent.append(self.scope_stack[-1])
                    self.scope_stack.append(scope)
                    continue
                elif append is not None and s == "}" and len(self.scope_stack) > 1:
                    self.scope_stack.pop()
                    scope = self.scope_stack[-1]
                    continue
                # one whole instruction on the line (with vector operands: not taken by the regex)
                elif append is not None and s[-1] == ";" and c0 != "." and c0 != "{" and c0 != "}" \
                        and s.find(";") == len(s) - 1 and c0 != ";":
                    body = s[:-1]
                    parts = body.split(None, 1)
                    head = parts[0]
                    pred = None
                    if c0 == "@" and len(parts) == 2:
                        pred = head
                        parts = parts[1].split(None, 1)
                        head = parts[0]
                    info = opinfo.get(head)
                    if info is None:
                        info = opinfo[head] = _opcode_info(head)
                    if info:
                        ops = parts[1] if len(parts) > 1 else ""
                        if "{" not in ops and "(" not in ops and ops.count("[") == ops.count("]"):
                            operands = ops.replace(" ", "").replace("\t", "").split(",") if ops else []
                            if "" not in operands:
                                if body[-1] in " \t":
                                    body = body.rstrip()
                                append(new_instr(lineno, body, pred, info[0], list(info[1]), operands, None,
                                                 scope, head))
                                continue
                    m = fast(s)
                    if m is not None:
                        self._instr_match(m, body.rstrip(), lineno)
                        append, scope = self._fast_target()
                        continue
            if not s:
                continue
            self._line(s, lineno)
            append, scope = self._fast_target()
            in_section = self.state == "section"
        self.in_block = in_block
        self.append, self.scope = self._fast_target()

    def _fast_target(self):
        """(append, scope) for the fast path while in a healthy body with no pending statement."""
        if self.state == "body" and self.pending is None and self.fn_error is None and self.fn is not None:
            return self.fn.body.append, self.scope_stack[-1]
        return None, 0

    def _error(self, line: int, msg: str) -> None:
        self.errors.append(PtxSyntaxError(self.file, line, msg))

    def _line(self, s: str, lineno: int) -> None:
        st = self.state
        if st == "body":
            self._body_line(s, lineno)
        elif st == "module":
            self._module_line(s, lineno)
        elif st == "header":
            self._header_line(s, lineno)
        elif st == "section":
            if "{" in s:
                self.section_open = True
                self.section_depth += s.count("{")
            if "}" in s:
                self.section_depth -= s.count("}")
            if self.section_open and self.section_depth <= 0:
                self.state = "module"
        elif st == "stmt":
            self._stmt_line(s, lineno)

    def _eof(self, lineno: int) -> None:
        if self.state == "body" and self.fn is not None:
            kind = ".entry" if self.fn.is_entry else ".func"
            self._error(lineno, f"unexpected end of input inside the body of {kind} {self.fn.name} "
                                f"(opened at line {self.fn.start_line})")
            self.symbols[self.fn.name] = "bad-func"
        elif self.state == "header":
            self._error(self.buf_line, "unexpected end of input in a function header")
        elif self.state == "stmt":
            self._error(self.buf_line, "unexpected end of input in a module-level statement")

    # ------------------------------------------------------------------ module level
    def _module_line(self, s: str, lineno: int) -> None:
        c0 = s[0]
        if c0 == ".":
            if s.startswith(".version"):
                self.version = s.split()[1] if len(s.split()) > 1 else None
                return
            if s.startswith(".target"):
                self.target = s[len(".target"):].strip().split(",")[0].strip() or None
                return
            if s.startswith(".address_size"):
                parts = s.split()
                self.address_size = parse_int(parts[1]) if len(parts) > 1 else None
                return
            if s.startswith(".section"):
                depth = s.count("{") - s.count("}")
                if depth > 0:
                    self.section_depth = depth
                    self.section_open = True
                    self.state = "section"
                elif "{" not in s:
                    # `.section .debug_info` with the brace on the next line
                    self.section_depth = 0
                    self.section_open = False
                    self.state = "section"
                return
            if _NOSEMI_RE.match(s):
                return
            if _HEADER_START_RE.match(s):
                self.state = "header"
                self.buf = []
                self.buf_line = lineno
                self._header_line(s, lineno)
                return
            self.state = "stmt"
            self.buf = []
            self.buf_line = lineno
            self._stmt_line(s, lineno)
            return
        if c0 == "}" or c0 == "{":
            self._error(lineno, f"unexpected '{c0}' at module level")
            return
        self._error(lineno, f"unexpected text at module level: {s[:60]!r}")

    def _stmt_line(self, s: str, lineno: int) -> None:
        """Accumulate a module-level declaration (`.global ...;`, `.extern .func ...;`) until `;`."""
        if self.buf and (s.startswith(".version") or _HEADER_START_RE.match(s)):
            self._error(self.buf_line, "module-level statement without ';'")
            self.state = "module"
            self.buf = []
            self._module_line(s, lineno)
            return
        self.buf.append(s)
        joined = " ".join(self.buf)
        # a ';' outside braces ends it
        depth = 0
        end = -1
        for i, c in enumerate(joined):
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            elif c == ";" and depth == 0:
                end = i
                break
        if end < 0:
            return
        self.state = "module"
        self.buf = []
        self._module_decl(joined[:end].strip(), self.buf_line)
        rest = joined[end + 1:].strip()
        if rest:
            self._module_line(rest, lineno)

    def _module_decl(self, text: str, line: int) -> None:
        head = text.split("=", 1)[0]
        words = head.replace("[", " [").split()
        spaces = [w[1:] for w in words if w.startswith(".")]
        if not spaces:
            self._error(line, f"unexpected module-level statement: {text[:60]!r}")
            return
        if spaces[0] in ("pragma", "alias"):
            if spaces[0] == "alias":
                names = [p.strip() for p in text[len(".alias"):].split(",")]
                if len(names) == 2:
                    self.symbols[names[0]] = self.symbols.get(names[1], "extern-func")
            return
        kind = None
        for w in spaces:
            if w in ("global", "const", "shared", "local", "tex"):
                kind = "global" if w == "tex" else w
                break
        for w in spaces:
            if w in _OPAQUE_TYPES:
                kind = w
        names = _decl_names(text)
        if kind is None:
            self._error(line, f"unexpected module-level statement: {text[:60]!r}")
            return
        for n in names:
            self.symbols[n.split("<", 1)[0]] = kind

    # ------------------------------------------------------------------ function header
    def _header_line(self, s: str, lineno: int) -> None:
        if self.buf and (s.startswith(".version") or _HEADER_START_RE.match(s)):
            self._error(self.buf_line, "function header without body or ';'")
            self.buf = []
            self.state = "module"
            self._module_line(s, lineno)
            return
        brace = s.find("{")
        semi = s.find(";")
        if brace >= 0 and (semi < 0 or brace < semi):
            self.buf.append(s[:brace])
            self._start_function(" ".join(self.buf), self.buf_line, lineno)
            self.buf = []
            rest = s[brace + 1:].strip()
            if self.state == "body" and rest:
                self._body_line(rest, lineno)
            return
        if semi >= 0:
            self.buf.append(s[:semi])
            self._declare_function(" ".join(self.buf), self.buf_line)
            self.buf = []
            self.state = "module"
            rest = s[semi + 1:].strip()
            if rest:
                self._module_line(rest, lineno)
            return
        self.buf.append(s)

    def _parse_header(self, text: str, line: int):
        m = _HEADER_RE.fullmatch(text.strip())
        if not m:
            return None
        linkage, kind = m.group(1).split(), m.group(2)
        params: list[Param] = []
        returns: list[Param] = []
        for group, dest in (("params", params), ("ret", returns)):
            src = m.group(group)
            if src is None or not src.strip():
                continue
            for d in src.split(","):
                p = _parse_param(d, line)
                if p is None:
                    return ("error", f"cannot parse parameter {d!r}")
                dest.append(p)
        rest = m.group("rest").strip()
        directives = [d.strip() for d in _DIRECTIVE_SPLIT_RE.split(rest) if d.strip()]
        for d in directives:
            if not d.startswith("."):
                return ("error", f"unexpected text in function header: {d[:40]!r}")
        return (kind, m.group("name"), params, returns, directives, linkage)

    def _declare_function(self, text: str, line: int) -> None:
        h = self._parse_header(text, line)
        if h is None or h[0] == "error":
            self._error(line, "cannot parse function declaration" + (f": {h[1]}" if h else ""))
            return
        self.symbols.setdefault(h[1], "extern-func")

    def _start_function(self, text: str, line: int, body_line: int) -> None:
        h = self._parse_header(text, line)
        self.fn_error = None
        if h is None or h[0] == "error":
            msg = "cannot parse function header" + (f": {h[1]}" if h else "")
            self.fn_error = PtxSyntaxError(self.file, line, msg)
            name = "<unknown>"
            mm = re.search(r"\.(?:entry|func)\s*(?:\([^)]*\)\s*)?([A-Za-z_$][\w$]*)", text)
            if mm:
                name = mm.group(1)
            self.fn = Function(name, ".entry" in text, [], [], [], {}, line, line)
        else:
            kind, name, params, returns, directives, linkage = h
            self.fn = Function(name, kind == "entry", params, returns, [], {}, line, line,
                               directives=directives)
        self.state = "body"
        self.scope_stack = [0]
        self.pending = None

    def _end_function(self, lineno: int) -> None:
        fn = self.fn
        assert fn is not None
        fn.end_line = lineno
        if self.fn_error is not None:
            self.errors.append(self.fn_error)
            self.symbols[fn.name] = "bad-func"
        else:
            self.functions.append(fn)
            self.symbols[fn.name] = "func"
        self.fn = None
        self.fn_error = None
        self.state = "module"

    def _fail(self, line: int, msg: str) -> None:
        if self.fn_error is None:
            self.fn_error = PtxSyntaxError(self.file, line, f"{msg} (in {self.fn.name if self.fn else '?'})")

    # ------------------------------------------------------------------ body
    def _body_line(self, s: str, lineno: int) -> None:
        if self.pending is None:
            c0 = s[0]
            if c0 == ".":
                if _SKIP_BODY_RE.match(s):
                    return
                if _HEADER_START_RE.match(s) or s.startswith(".version"):
                    self._unterminated(s, lineno)
                    return
            elif c0 != "{" and c0 != "}" and s[-1] == ";" and s.count(";") == 1:
                m = _FAST_RE.fullmatch(s)
                if m is not None:
                    if self.fn_error is None:
                        self._instr_match(m, s[:-1].rstrip(), lineno)
                    return
        self._scan(s, lineno)

    def _unterminated(self, s: str, lineno: int) -> None:
        fn = self.fn
        assert fn is not None
        kind = ".entry" if fn.is_entry else ".func"
        self.fn_error = PtxSyntaxError(self.file, lineno, f"body of {kind} {fn.name} (opened at line "
                                                         f"{fn.start_line}) is not closed before this line")
        self._end_function(lineno)
        self._module_line(s, lineno)

    def _scan(self, s: str, lineno: int) -> None:
        """General statement scanner for one line of a body."""
        i = 0
        n = len(s)
        while i < n:
            if self.pending is not None:
                j, depth = self._find_end(s, i, self.pending_depth)
                if j == -1:
                    self.pending.append(s[i:])
                    self.pending_depth = depth
                    return
                if j == -2:
                    self._fail(self.pending_line, "statement not terminated by ';'")
                    self.pending = None
                    i = depth  # position of the offending '}'
                    continue
                self.pending.append(s[i:j])
                text = " ".join(self.pending).strip()
                self.pending = None
                self._statement(text, self.pending_line)
                i = j + 1
                continue
            c = s[i]
            if c in " \t\r\f\v":
                i += 1
                continue
            if c == "{":
                fn = self.fn
                sid = len(fn.scope_parent)
                fn.scope_parent.append(self.scope_stack[-1])
                self.scope_stack.append(sid)
                i += 1
                continue
            if c == "}":
                self.scope_stack.pop()
                i += 1
                if not self.scope_stack:
                    self._end_function(lineno)
                    rest = s[i:].strip()
                    if rest:
                        self._line(rest, lineno)
                    return
                continue
            if c == ".":
                if _LOCFILE_RE.match(s, i):
                    return
                if _HEADER_START_RE.match(s, i) or s.startswith(".version", i):
                    self._unterminated(s[i:], lineno)
                    return
            m = _LABEL_RE.match(s, i)
            if m is not None:
                k = m.end()
                while k < n and s[k] in " \t":
                    k += 1
                if s.startswith(".callprototype", k):
                    # `prototype_0 : .callprototype (...) _ (...);` declares a call prototype
                    j, depth = self._find_end(s, k, 0)
                    if j < 0:
                        self.pending = [""]
                        self.pending_line = lineno
                        self.pending_depth = depth if j == -1 else 0
                        self.pending_skip = True
                        return
                    i = j + 1
                    continue
                if self.fn_error is None:
                    self._label(m.group(1))
                i = k
                continue
            j, depth = self._find_end(s, i, 0)
            if j == -1:
                self.pending = [s[i:]]
                self.pending_line = lineno
                self.pending_depth = depth
                return
            if j == -2:
                self._fail(lineno, "statement not terminated by ';'")
                i = depth
                continue
            self._statement(s[i:j].strip(), lineno)
            i = j + 1

    @staticmethod
    def _find_end(s: str, i: int, depth: int) -> tuple[int, int]:
        """Index of the ';' that ends the statement starting at i (braces inside it are operand groups).
        Returns (-1, depth) if the line ends first, (-2, pos) on a '}' that closes an outer block."""
        while True:
            m = _ENDSTMT_RE.search(s, i)
            if m is None:
                return -1, depth
            c = m.group()
            p = m.start()
            if c == ";":
                if depth == 0:
                    return p, 0
            elif c == "{":
                depth += 1
            else:
                depth -= 1
                if depth < 0:
                    return -2, p
            i = p + 1

    def _label(self, name: str) -> None:
        fn = self.fn
        if name not in fn.labels:
            fn.labels[name] = len(fn.body)

    def _statement(self, text: str, lineno: int) -> None:
        if self.pending_skip:
            self.pending_skip = False
            return
        if self.fn_error is not None or not text:
            return
        if text[0] == ".":
            self._body_directive(text, lineno)
            return
        m = _INSTR_RE.fullmatch(text)
        if m is None:
            self._fail(lineno, f"cannot parse statement {text[:60]!r}")
            return
        self._instr_match(m, text, lineno)

    def _instr_match(self, m: re.Match, text: str, lineno: int) -> None:
        pred = m.group(1)
        full = m.group(2)
        ops = m.group(3)
        if ops is None or not ops.strip():
            operands: list[str] = []
        else:
            ops = ops.strip()
            if not _balanced(ops):
                self._fail(lineno, f"unbalanced brackets in {text[:60]!r}")
                return
            if "{" in ops or "(" in ops:
                operands = [o.replace(" ", "").replace("\t", "") for o in split_operands(ops)]
            else:
                operands = ops.replace(" ", "").replace("\t", "").split(",")
            if "" in operands:
                self._fail(lineno, f"empty operand in {text[:60]!r}")
                return
        parts = full.split(".")
        self.fn.body.append(Instruction(lineno, text, pred.strip() if pred else None, parts[0], parts[1:],
                                        operands, None, self.scope_stack[-1], full))

    def _body_directive(self, text: str, lineno: int) -> None:
        word = text.split(None, 1)[0]
        word = word.split(".", 2)[1] if word.count(".") >= 1 else word
        if word in ("loc", "file", "pragma", "maxnreg", "section"):
            return
        if word not in ("reg", "local", "shared", "param", "const", "global", "tex"):
            self._fail(lineno, f"unknown directive {text[:40]!r}")
            return
        sid = self.scope_stack[-1]
        if word == "reg" and sid == 0:
            return  # function-scope registers need no bookkeeping: they are the default
        fn = self.fn
        for name in _decl_names(text):
            r = _RANGE_RE.match(name)
            if r:
                fn.range_decls.setdefault(sid, []).append((r.group(1), int(r.group(2))))
            else:
                fn.decls[(name, sid)] = word


def parse_ptx(text: str, file: str = "<ptx>") -> Module:
    """Parse a PTX module. Never raises on malformed input: errors are collected in `Module.errors`
    (file:line) and the function they occur in is skipped; all other functions are still parsed."""
    enabled = gc.isenabled()
    gc.disable()            # the parse allocates no cycles; collections would dominate on large modules
    try:
        return _Parser(text, file).run()
    finally:
        if enabled:
            gc.enable()
