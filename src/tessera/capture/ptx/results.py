"""What the PTX analysis reports: per-kernel, per-parameter accesses and per-instruction access sites.

These are the public result records of `tessera.capture.ptx.analyze` (also exported by the package).
An access is named by one of `ACCESSES`; internally it is a bitmask (`READ`, `WRITE`, `READ_WRITE`)
whose value indexes `ACCESSES`. A parameter is classified as one of `KINDS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "ACCESSES", "KINDS", "READ", "READ_WRITE", "WRITE", "AccessSite", "FieldAccess", "KernelAccess",
    "ParamAccess",
]

ACCESSES = ("none", "read", "write", "read-write")
KINDS = ("pointer", "scalar", "descriptor", "struct")

READ, WRITE, READ_WRITE = 1, 2, 3          # access bitmasks; ACCESSES[mask] is the name


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
