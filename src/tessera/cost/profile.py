"""Measured kernel times of one model step on one device: the Profile and its versioned JSON file.

A profile keys every kernel by a signature of what determines its time (op, argument sizes, strides,
dtypes and scalars), not by buffer names, so a measured time serves every equal-shape kernel: the
same projection in each layer, or in another model with the same sizes.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tessera.cost.contention import HostContention
from tessera.cost.host_overhead import HostOverhead
from tessera.cost.positions import PositionModel
from tessera.documents import read_json
from tessera.errors import TesseraError
from tessera.graph.dtypes import dtype_itemsize
from tessera.graph.ir import Kernel
from tessera.paths import atomic_write

PROFILE_KIND = "tessera-profile"
PROFILE_VERSION = 1
_ALIGN_BYTES = 16  # vectorised loads care whether a view starts on this boundary, not where exactly
_REDO = "re-create it with `tessera profile MODEL --device ... -o FILE`"


class ProfileFormatError(TesseraError, ValueError):
    """A profile file is unreadable, not a Tessera profile, of another version, or lacks fields."""


def _layout(ref: list) -> list:
    """An encoded TensorRef without its buffer name: dtype, sizes, strides and start alignment."""
    _, dtype, offset, sizes, strides = ref
    align = (int(offset) * dtype_itemsize(dtype)) % _ALIGN_BYTES
    # the stride of a size-1 dimension is never followed (and differs between meta and device traces)
    return [dtype, list(sizes), [0 if n == 1 else st for n, st in zip(sizes, strides, strict=True)], align]


def _timing_view(value: Any) -> Any:
    """An encoded argument with each buffer view reduced to what matters for time (no buffer name)."""
    if isinstance(value, list):
        return [_timing_view(v) for v in value]
    if isinstance(value, dict):
        if "$t" in value:
            return {"$t": _layout(value["$t"])}
        return {k: _timing_view(v) for k, v in sorted(value.items())}
    return value


def kernel_signature(kernel: Kernel) -> str:
    """A stable hash of what determines a kernel's time, independent of buffer names and model.

    Covers the op, every tensor argument's sizes, strides, dtype and alignment, the non-tensor
    arguments (scalars, lists, dtypes) and the outputs' layouts. Equal-shape kernels of different
    layers or models get the same signature.
    """
    payload = [kernel.op, _timing_view(kernel.args), _timing_view(dict(sorted(kernel.kwargs.items()))),
               [None if o is None else _layout(o) for o in kernel.outputs]]
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class KernelTiming:
    """The measured time of one kernel of the profiled graph (seconds)."""

    index: int
    id: str
    signature: str
    op: str
    op_class: str
    median_s: float
    min_s: float
    repeats: int


_TIMING_TYPES: dict[str, tuple[type, ...]] = {
    "index": (int,), "id": (str,), "signature": (str,), "op": (str,), "op_class": (str,),
    "median_s": (int, float), "min_s": (int, float), "repeats": (int,),
}


@dataclass
class Profile:
    """Per-kernel times of one model step measured on one device."""

    device: str  # canonical device id ("cpu", "A100", ...)
    device_name: str  # e.g. the CPU model string or torch.cuda.get_device_name
    threads: int | None  # CPU threads the kernels ran with (None on a GPU)
    model: str
    phase: str
    graph_hash: str
    shape: dict[str, Any]
    warmup: int
    repeats: int
    created: str  # ISO time
    kernels: list[KernelTiming] = field(default_factory=list)
    version: int = PROFILE_VERSION
    # this host's costs of Tessera's engine beyond the kernels (measured apart, cached apart, never in the file):
    # set on the host's profile for a run (`tessera.runtime.session.host_profile`), charged by the cost model
    overhead: HostOverhead | None = field(default=None, compare=False, repr=False)
    # decode kernels whose time follows the cache position, fitted on the decode step profiled at two positions
    # (never in the file: the two profiles are): set by `host_profile` given the planned decode position
    positions: PositionModel | None = field(default=None, compare=False, repr=False)
    # how two of the host's CPU workers slow each other (`tessera.cost.contention`), for the request simulator
    contention: HostContention | None = field(default=None, compare=False, repr=False)

    @property
    def total_s(self) -> float:
        """Sum of the kernels' median times: the step run kernel after kernel, without overlap."""
        return sum(k.median_s for k in self.kernels)

    def by_signature(self) -> dict[str, float]:
        """Signature -> median seconds (the median over the kernels sharing that signature)."""
        groups: dict[str, list[float]] = {}
        for k in self.kernels:
            groups.setdefault(k.signature, []).append(k.median_s)
        return {sig: statistics.median(times) for sig, times in groups.items()}

    def by_op_class(self) -> dict[str, tuple[int, float]]:
        """Op class -> (kernels, total median seconds), the most expensive class first."""
        rows: dict[str, list[float]] = {}
        for k in self.kernels:
            rows.setdefault(k.op_class, []).append(k.median_s)
        out = {cls: (len(t), sum(t)) for cls, t in rows.items()}
        return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))

    def to_dict(self) -> dict[str, Any]:
        """The versioned JSON object of this profile."""
        d = asdict(self)
        d.pop("version")
        d.pop("overhead")
        d.pop("positions")
        d.pop("contention")
        return {"kind": PROFILE_KIND, "version": self.version, **d}

    def save(self, path: str | Path) -> None:
        """Write the versioned JSON profile (atomically: an interrupted write leaves the old file or none)."""
        atomic_write(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> Profile:
        """Rebuild a profile from its JSON object; checks kind, version and every field."""
        if not isinstance(d, dict) or d.get("kind") != PROFILE_KIND:
            found = d.get("kind") if isinstance(d, dict) else type(d).__name__
            raise ProfileFormatError(f"{source}: not a Tessera profile (kind is {found!r}, expected "
                                     f"{PROFILE_KIND!r}); give a file written by `tessera profile`")
        if d.get("version") != PROFILE_VERSION:
            raise ProfileFormatError(f"{source}: profile version {d.get('version')!r} is not supported (expected "
                                     f"{PROFILE_VERSION}); {_REDO}")
        names = [f.name for f in fields(cls) if f.name not in ("kernels", "version", "overhead", "positions",
                                                               "contention")]
        missing = [n for n in [*names, "kernels"] if n not in d]
        if missing:
            raise ProfileFormatError(f"{source}: profile lacks field(s) {', '.join(missing)}; {_REDO}")
        if not isinstance(d["kernels"], list):
            raise ProfileFormatError(f"{source}: 'kernels' must be a list, not {type(d['kernels']).__name__}")
        kernels = [_timing_from_dict(row, i, source) for i, row in enumerate(d["kernels"])]
        if not isinstance(d["shape"], dict):
            raise ProfileFormatError(f"{source}: 'shape' must be an object, not {type(d['shape']).__name__}")
        return cls(**{n: d[n] for n in names}, kernels=kernels)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile written by :meth:`save`."""
        d = read_json(path, "profile file", ProfileFormatError, hint=_REDO)
        return cls.from_dict(d, source=str(path))


def cached_profile(path: Path, measure: Callable[[], Profile], graph_hash: str | None = None,
                   log: Callable[[str], None] = lambda s: None, repeats: int | None = None) -> Profile:
    """The profile cached at ``path``, else ``measure()``'d and cached there.

    A cached file that cannot be read as a profile (truncated, damaged, another version), that was measured
    for another graph than ``graph_hash`` or with fewer timed calls per kernel than ``repeats`` is measured again
    and replaced, with a line to ``log`` saying why.
    """
    if path.is_file():
        try:
            prof = Profile.load(path)
        except ProfileFormatError as e:
            log(f"cached profile unusable: {e}; measuring again")
        else:
            if graph_hash is not None and prof.graph_hash != graph_hash:
                log(f"cached profile {path} is for graph {prof.graph_hash[:16]}, not {graph_hash[:16]}; measuring "
                    "again")
            elif repeats is not None and prof.repeats < repeats:
                log(f"cached profile {path} timed each kernel {prof.repeats} times, fewer than {repeats}; measuring "
                    "again")
            else:
                return prof
    prof = measure()
    prof.save(path)
    return prof


def _timing_from_dict(row: Any, i: int, source: str) -> KernelTiming:
    if not isinstance(row, dict):
        raise ProfileFormatError(f"{source}: kernels[{i}] must be an object, not {type(row).__name__}")
    missing = [n for n in _TIMING_TYPES if n not in row]
    if missing:
        raise ProfileFormatError(f"{source}: kernels[{i}] lacks field(s) {', '.join(missing)}; {_REDO}")
    for name, types in _TIMING_TYPES.items():
        value = row[name]
        if not isinstance(value, types) or isinstance(value, bool):
            raise ProfileFormatError(f"{source}: kernels[{i}].{name} must be {' or '.join(t.__name__ for t in types)}"
                                     f", not {value!r}")
    if row["median_s"] < 0 or row["min_s"] < 0:
        raise ProfileFormatError(f"{source}: kernels[{i}] has a negative time; {_REDO}")
    return KernelTiming(**{n: row[n] for n in _TIMING_TYPES})
