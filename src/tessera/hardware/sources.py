"""Per-figure citations of the device catalog: which document each figure comes from, as printed there.

`devices.yaml` lists the documents once (`documents:`, key -> title, public URL, the stored copies read
for the audit) and gives every figure of every row a citation (`sources:`, figure -> citation). A citation says
how the figure is known (`status`), quotes the document (`printed`), gives the number as printed (`number`,
in the document's unit) and the named conversions that turn it into the catalog's unit (`convert`). Where a
number is quoted, the catalog's value must equal it after the conversions: `Citation.expected` is what the
loader and the tests compare against.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# How a figure is known:
#   printed      the document prints it (after the named conversions)
#   derived      computed from printed figures or a standard (the note gives the arithmetic)
#   unconfirmed  not found in the stored copies of a vendor document; the note says where the value is from
#   estimate     an estimate (prices, launch latency); the note says how it was made
#   measured     measured on this host (the `cpu` row)
STATUSES = ("printed", "derived", "unconfirmed", "estimate", "measured")

# GeForce parts print FP16-accumulate tensor rates and run FP32 accumulate (what the kernels use) at half of them.
HALF_RATE = "FP16 accumulate to FP32 accumulate"

# Named conversions from a printed number to the catalog's unit, and their factors.
CONVERSIONS = {
    "sparse to dense": 0.5,  # tensor figures printed with 2:4 sparsity (marked * on NVIDIA datasheets)
    HALF_RATE: 0.5,
    "bidirectional to per direction": 0.5,
    "8 GPUs to one": 1 / 8,
    "GB/s to TB/s": 1e-3,
    "TB/s to GB/s": 1e3,
    "PFLOPS to TFLOPS": 1e3,
    "GHz to MHz": 1e3,
    "KB to MiB": 1 / 1024,
    "MB of 1000 KB to MiB": 1000 / 1024,  # 98.3 MB printed for 98,304 KB = 96 MiB
    "MB as MiB": 1.0,  # cache sizes are printed in MB and are powers of two: 40 MB is 40 MiB
}

# Printed figures are rounded (1,513 TFLOPS sparse -> 756.5 dense, printed elsewhere as 756): the relative
# difference a quoted number may have from the catalog's value.
TOLERANCE = 1e-3

CITATION_FIELDS = frozenset({"status", "doc", "printed", "number", "convert", "note"})


@dataclass(frozen=True)
class Document:
    """A document figures are cited from: its title, public URL, and the stored copies read for the audit."""

    key: str
    title: str
    url: str | None  # the public document, where known
    copies: tuple[str, ...]  # where the audit read it: stored copies (often third-party reproductions)


@dataclass(frozen=True)
class Citation:
    """Where one figure of one catalog row comes from."""

    figure: str  # the YAML field: "memory_gb", "tflops.bf16", "prices", ...
    status: str  # one of STATUSES
    doc: Document | None
    printed: str | None  # the figure as the document prints it
    number: float | None  # the number in `printed`, in the document's unit
    convert: tuple[str, ...]  # names from CONVERSIONS, applied in order
    note: str | None

    def factor(self) -> float:
        """The product of the conversions' factors (1 without conversions)."""
        return math.prod(CONVERSIONS[c] for c in self.convert)

    def expected(self) -> float | None:
        """The catalog value the quoted number gives after the conversions; None without a number."""
        return None if self.number is None else self.number * self.factor()

    def matches(self, value: float | None) -> bool:
        """Whether a catalog value (in the YAML's unit) equals the quoted number after the conversions."""
        want = self.expected()
        if want is None or value is None:
            return want is None and (value is None or self.status != "printed")
        return math.isclose(value, want, rel_tol=TOLERANCE)

    def to_dict(self) -> dict:
        """Plain data for JSON output: status, document (title, url), printed, number, convert, note."""
        doc = None if self.doc is None else {"title": self.doc.title, "url": self.doc.url, "copies": list(self.doc.copies)}
        return {"status": self.status, "document": doc, "printed": self.printed, "number": self.number,
                "convert": list(self.convert), "note": self.note}

    def text(self) -> str:
        """The figure as printed with its conversions, then the note: one line for audit tables."""
        text = self.printed or ""
        if self.convert:
            text += f" ({'; '.join(self.convert)})"
        if self.note:
            text = f"{text}; {self.note}" if text else self.note
        return text


class CitationError(ValueError):
    """A citation that breaks the schema (the message says what; the catalog adds the row and the figure)."""


def number_pattern(number: float) -> str:
    """A regex matching a quoted number in printed text: 2039 matches '2,039' and '2039.0', 9.0 matches '9.0'."""
    text = f"{number:g}"
    tail = r"0*" if "." in text else r"(?:\.0+)?"
    return rf"(?<![\d.]){re.escape(text)}{tail}(?!\.?\d)"


def parse_document(key: str, data: object) -> Document:
    """One entry of the `documents:` mapping."""
    if not isinstance(data, dict) or not isinstance(data.get("title"), str) or not data["title"].strip():
        raise CitationError(f"document {key!r}: expected a mapping with a non-empty 'title', got {data!r}")
    extra = sorted(set(data) - {"title", "url", "copies"}, key=str)
    if extra:
        raise CitationError(f"document {key!r}: unknown field {extra[0]!r} (allowed: title, url, copies)")
    copies = data.get("copies", [])
    urls = [data.get("url")] if data.get("url") is not None else []
    if not isinstance(copies, list) or not all(isinstance(u, str) and u.startswith("http") for u in urls + copies):
        raise CitationError(f"document {key!r}: 'url' and 'copies' must be http(s) URLs, got {data!r}")
    return Document(key=key, title=data["title"].strip(), url=data.get("url"), copies=tuple(copies))


def parse_citation(figure: str, data: object, documents: dict[str, Document]) -> Citation:
    """One entry of a row's `sources:` mapping, checked for completeness (not yet against the value)."""
    if not isinstance(data, dict):
        raise CitationError(f"expected a mapping with status, doc, printed, number, convert, note; got {data!r}")
    extra = sorted(set(data) - CITATION_FIELDS, key=str)
    if extra:
        raise CitationError(f"unknown field {extra[0]!r} (allowed: {', '.join(sorted(CITATION_FIELDS))})")
    status = data.get("status", "printed")
    if status not in STATUSES:
        raise CitationError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
    doc = None
    if data.get("doc") is not None:
        if data["doc"] not in documents:
            raise CitationError(f"unknown document {data['doc']!r} (listed: {', '.join(sorted(documents))})")
        doc = documents[data["doc"]]
    printed, note = _text(data, "printed"), _text(data, "note")
    number = data.get("number")
    if number is not None and (isinstance(number, bool) or not isinstance(number, int | float)):
        raise CitationError(f"'number' must be a number, got {number!r}")
    convert = data.get("convert", [])
    if not isinstance(convert, list) or any(c not in CONVERSIONS for c in convert):
        raise CitationError(f"'convert' must be a list of {', '.join(repr(c) for c in CONVERSIONS)}; got {convert!r}")
    if status == "printed" and doc is None:
        raise CitationError("a printed figure names its document ('doc')")
    if status == "printed" and printed is None:
        raise CitationError("a printed figure quotes the document ('printed')")
    if status != "printed" and note is None:
        raise CitationError(f"a {status} figure says how it was obtained ('note')")
    if number is not None:
        if printed is None:
            raise CitationError("'number' needs the 'printed' text it is quoted from")
        if not re.search(number_pattern(number), printed.replace(",", "")):
            raise CitationError(f"number {number:g} does not appear in the printed text {printed!r}")
    return Citation(figure=figure, status=status, doc=doc, printed=printed,
                    number=None if number is None else float(number), convert=tuple(convert), note=note)


def _text(data: dict, field: str) -> str | None:
    value = data.get(field)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise CitationError(f"'{field}' must be a non-empty string, got {value!r}")
    return " ".join(value.split())
