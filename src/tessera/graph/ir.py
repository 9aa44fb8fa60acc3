"""The KernelGraph: kernels in program order, the buffers they touch, exact accesses and edges.

This is the contract between capture and everything after it (cost model, planner, programs,
runtime, simulator). It is plain data, serialisable to a versioned JSON object.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from tessera.graph.overlap import Region

GRAPH_VERSION = 1

BufferKind = Literal["weight", "activation", "state", "input", "output", "constant"]
AccessMode = Literal["read", "write"]
EdgeKind = Literal["RAW", "WAR", "WAW"]


class GraphFormatError(ValueError):
    """A graph file is not a Tessera KernelGraph of a supported version."""


@dataclass
class Buffer:
    """A storage region with a stable name (weights by state-dict name, state as cache.layer{i}.k...)."""

    name: str
    kind: BufferKind
    nbytes: int
    dtype: str  # dtype of the tensor the buffer was first seen as
    shape: list[int]  # shape of that tensor
    aliases: list[str] = field(default_factory=list)  # other names of the same storage (tied weights)
    values: str | None = None  # constants only: base64 of the raw bytes

    @property
    def is_weight(self) -> bool:
        return self.kind == "weight"


@dataclass
class TensorRef:
    """A strided view of a buffer: what a kernel argument or output is."""

    buffer: str
    dtype: str
    offset: int  # storage offset, in elements of dtype
    sizes: list[int]
    strides: list[int]

    def to_json(self) -> list:
        return [self.buffer, self.dtype, self.offset, self.sizes, self.strides]

    @classmethod
    def from_json(cls, v: list) -> TensorRef:
        return cls(v[0], v[1], int(v[2]), list(v[3]), list(v[4]))


@dataclass
class Kernel:
    """One device launch as eager runs it; identified by (scope, op, ordinal)."""

    index: int
    op: str  # e.g. "aten.mm.default", "tessera.decode_attention.default"
    scope: str  # module path, e.g. "model.layers.3.mlp.down_proj"
    ordinal: int  # count of earlier kernels with the same (scope, op)
    layer: int | None
    op_class: str
    args: list[Any]  # encoded by tessera.graph.codec
    kwargs: dict[str, Any]
    outputs: list[Any]  # encoded TensorRefs (or None) in return order
    shapes: list[list[int]]  # shapes of the tensor arguments
    dtypes: list[str]
    flops: int
    bytes_read: int
    bytes_written: int
    indirect: bool = False  # its PTX derives addresses from loaded values: keep it with its neighbours

    @property
    def id(self) -> str:
        return f"{self.scope}:{self.op}#{self.ordinal}"


@dataclass
class Access:
    """A kernel reading or writing a strided byte region of a buffer."""

    kernel: int
    buffer: str
    mode: AccessMode
    offset: int  # elements
    sizes: list[int]
    strides: list[int]
    itemsize: int

    @property
    def region(self) -> Region:
        return Region(self.offset, tuple(self.sizes), tuple(self.strides), self.itemsize)


@dataclass
class Edge:
    """An ordering constraint from a real byte overlap between two kernels' accesses."""

    src: int
    dst: int
    kind: EdgeKind
    buffer: str


@dataclass
class KernelGraph:
    """Kernels in program order, buffers, accesses and RAW/WAR/WAW edges of one model step."""

    model: str
    phase: str
    meta: dict[str, Any]  # batch, seq, ctx, dtype, device the trace ran on, trace time...
    kernels: list[Kernel]
    buffers: dict[str, Buffer]
    accesses: list[Access]
    edges: list[Edge]
    inputs: list[str]  # buffer names of the step inputs, in call order
    state: list[str]  # buffer names of engine-owned state
    outputs: dict[str, Any]  # output name -> encoded TensorRef
    version: int = GRAPH_VERSION
    _hash: str | None = field(default=None, repr=False, compare=False)

    @property
    def hash(self) -> str:
        """Content hash over what determines execution (ops, arguments, buffers, outputs)."""
        if self._hash is None:
            payload = {
                "kernels": [[k.op, k.scope, k.args, k.kwargs, k.outputs] for k in self.kernels],
                "buffers": [[b.name, b.kind, b.nbytes, b.dtype, b.shape, b.values] for b in
                            sorted(self.buffers.values(), key=lambda b: b.name)],
                "inputs": self.inputs,
                "state": self.state,
                "outputs": self.outputs,
            }
            blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
            self._hash = hashlib.sha256(blob).hexdigest()[:16]
        return self._hash

    def weight_names(self) -> list[str]:
        return [b.name for b in self.buffers.values() if b.kind == "weight"]

    def accesses_of(self, kernel: int) -> list[Access]:
        return [a for a in self.accesses if a.kernel == kernel]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "hash": self.hash,
            "model": self.model,
            "phase": self.phase,
            "meta": self.meta,
            "inputs": self.inputs,
            "state": self.state,
            "outputs": self.outputs,
            "kernels": [asdict(k) | {"id": k.id} for k in self.kernels],
            "buffers": [asdict(b) for b in self.buffers.values()],
            "accesses": [asdict(a) for a in self.accesses],
            "edges": [asdict(e) for e in self.edges],
        }

    def to_json(self) -> str:
        """The JSON text of :meth:`to_dict` (written from the graph's own lists, without copying them)."""
        names = {cls: [f.name for f in fields(cls)] for cls in (Kernel, Buffer, Access, Edge)}

        def plain(obj) -> dict[str, Any]:
            return {name: getattr(obj, name) for name in names[type(obj)]}

        return json.dumps({
            "version": self.version, "hash": self.hash, "model": self.model, "phase": self.phase, "meta": self.meta,
            "inputs": self.inputs, "state": self.state, "outputs": self.outputs,
            "kernels": [plain(k) | {"id": k.id} for k in self.kernels],
            "buffers": [plain(b) for b in self.buffers.values()],
            "accesses": [plain(a) for a in self.accesses],
            "edges": [plain(e) for e in self.edges],
        }, separators=(",", ":"))

    def save(self, path: str | Path) -> None:
        """Write the versioned JSON graph."""
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "<dict>", check_hash: bool = True) -> KernelGraph:
        """Rebuild a graph from its JSON object; checks version and hash (``check_hash`` False: takes the
        recorded hash as the graph's, for a reader whose file is checked otherwise, as a cache's is)."""
        if not isinstance(d, dict) or "version" not in d or "kernels" not in d:
            raise GraphFormatError(f"{source}: not a Tessera kernel graph (no 'version'/'kernels')")
        if d["version"] != GRAPH_VERSION:
            raise GraphFormatError(
                f"{source}: graph version {d['version']} is not supported (expected {GRAPH_VERSION}); "
                "re-run `tessera trace`")
        try:
            kernels = [Kernel(**{k: v for k, v in kd.items() if k != "id"}) for kd in d["kernels"]]
            buffers = {bd["name"]: Buffer(**bd) for bd in d["buffers"]}
            g = cls(model=d["model"], phase=d["phase"], meta=d["meta"], kernels=kernels, buffers=buffers,
                    accesses=[Access(**a) for a in d["accesses"]], edges=[Edge(**e) for e in d["edges"]],
                    inputs=d["inputs"], state=d["state"], outputs=d["outputs"])
        except (KeyError, TypeError) as e:
            raise GraphFormatError(f"{source}: malformed kernel graph ({e})") from e
        if not check_hash and d.get("hash"):
            g._hash = d["hash"]
        elif d.get("hash") and d["hash"] != g.hash:
            raise GraphFormatError(f"{source}: content hash {g.hash} differs from the recorded {d['hash']} "
                                   "(the file was edited or corrupted)")
        return g

    @classmethod
    def load(cls, path: str | Path) -> KernelGraph:
        """Read a graph written by :meth:`save`."""
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except OSError as e:
            raise GraphFormatError(f"{p}: cannot read graph file ({e.strerror})") from e
        except json.JSONDecodeError as e:
            raise GraphFormatError(f"{p}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from e
        return cls.from_dict(d, source=str(p))
