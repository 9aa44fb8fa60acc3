"""Value ranges of integer registers, computed on demand, to bound offsets into local memory.

nvcc spills arrays of pointers indexed at run time to local memory; knowing that an index is, say,
`k & 1` lets a load from `ptrs[k & 1]` read back only the pointers stored in that array. A register's
range is the hull of the ranges of all its integer definitions (flow-insensitive, like the rest of
the analysis); a register defined through a loop back to itself, or by anything whose range is not
tracked, is unbounded. Only operations that cannot wrap are bounded.
"""

from __future__ import annotations

from tessera.capture.ptx.classify import FunctionTransfers
from tessera.capture.ptx.instructions import int_size
from tessera.capture.ptx.operands import Operand

__all__ = ["MAX_BOUND", "IntegerRanges", "Range"]

Range = tuple[int, int] | None      # (lo, hi), inclusive; None: unbounded
MAX_BOUND = 1 << 40                 # integer ranges beyond this are treated as unbounded


class IntegerRanges:
    """The ranges of the integer registers and operands of one function."""

    __slots__ = ("body", "names", "rdefs", "top_keys", "memo", "spec_cache")

    def __init__(self, graph: FunctionTransfers) -> None:
        self.body = graph.fn.body
        self.names = graph.names
        self.rdefs = graph.rdefs
        self.top_keys = graph.top_keys
        self.memo: dict[object, Range] = {}
        self.spec_cache: dict[int, list[Operand]] = {}

    def of(self, spec: Operand) -> Range:
        """The range of an operand."""
        if spec.kind == "i":
            v = spec.value
            return (v, v) if -MAX_BOUND <= v <= MAX_BOUND else None
        if spec.kind != "k":
            return None
        k = spec.value
        if k in self.memo:
            return self.memo[k]
        if k in self.top_keys or k not in self.rdefs:     # not defined, or not all by integer instructions
            return None
        self.memo[k] = None             # a cycle back to k is unbounded
        lo = hi = None
        for idx in self.rdefs.get(k, ()):
            r = self._result(idx)
            if r is None:
                lo = None
                break
            lo = r[0] if lo is None else min(lo, r[0])
            hi = r[1] if hi is None else max(hi, r[1])
        res = None if lo is None else (lo, hi)
        self.memo[k] = res
        return res

    def sources(self, idx: int) -> list[Operand]:
        """The source operands of instruction `idx` (cached)."""
        r = self.spec_cache.get(idx)
        if r is None:
            ins = self.body[idx]
            r = self.spec_cache[idx] = [self.names.operand(o, ins.scope) for o in ins.operands[1:]]
        return r

    def _result(self, idx: int) -> Range:
        """The range of the result of integer instruction `idx`."""
        ins = self.body[idx]
        op = ins.opcode
        r = [self.of(x) for x in self.sources(idx)]
        res = _result_range(op, r)
        if res is None:
            return None
        lo, hi = res
        if int_size(ins.modifiers) == 4 and (lo < -(1 << 31) or hi >= (1 << 31)) or lo < -MAX_BOUND \
                or hi > MAX_BOUND:
            return None
        return res


def _result_range(op: str, r: list[Range]) -> Range:
    """The range of `op` applied to operands of ranges `r`, before the bounds checks."""
    if op in ("mov", "cvt"):
        return r[0] if r else None
    if op == "and":
        his = [x[1] for x in r if x is not None and x[0] >= 0]
        return (0, min(his)) if his else None
    if op == "rem":
        if len(r) > 1 and r[1] is not None and r[1][0] > 0 and (r[0] is None or r[0][0] >= 0):
            return (0, r[1][1] - 1) if r[0] is None else (0, min(r[0][1], r[1][1] - 1))
        return None
    if op == "bfe":
        if len(r) > 2 and r[2] is not None and r[2][0] == r[2][1] and 0 <= r[2][0] < 40:
            return (0, (1 << r[2][0]) - 1)
        return None
    if op == "selp":
        if len(r) > 1 and r[0] is not None and r[1] is not None:
            return (min(r[0][0], r[1][0]), max(r[0][1], r[1][1]))
        return None
    if op not in ("add", "sub", "shl", "shr", "mul", "mad", "or", "min", "max"):
        return None
    if len(r) < 2 or r[0] is None or r[1] is None:
        return None
    return _binary_range(op, r[0], r[1], r[2] if len(r) > 2 else None)


def _binary_range(op: str, x: tuple[int, int], y: tuple[int, int], z: Range) -> Range:
    """The range of `x op y` (`x * y + z` for mad)."""
    (a, b), (c, d) = x, y
    if op == "add":
        return (a + c, b + d)
    if op == "sub":
        return (a - d, b - c)
    if op == "shl":
        return (a << c, b << d) if a >= 0 and c >= 0 and d < 40 else None
    if op == "shr":
        return (a >> d, b >> c) if a >= 0 and c >= 0 else None
    if op in ("mul", "mad"):
        if a < 0 or c < 0:
            return None
        if op == "mul":
            return (a * c, b * d)
        return None if z is None else (a * c + z[0], b * d + z[1])
    if op == "or":
        return (max(a, c), (1 << max(b, d).bit_length()) - 1) if a >= 0 and c >= 0 else None
    if op == "min":
        return (min(a, c), min(b, d))
    return (max(a, c), max(b, d))       # max
