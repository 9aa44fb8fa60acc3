"""How much two of Tessera's CPU workers on one host slow each other when their steps run at the same time:
each worker has a core of its own, but the cores share the last-level cache and the memory bandwidth (and on
a virtual machine whatever the hypervisor shares); other processes taking a core away are not in it (the probe
times its steps by their thread's CPU seconds). Measured by a probe (`tessera.runtime.contention_probe`),
cached per host, threads, model and version of the code it times; carried by the host's
:class:`~tessera.cost.profile.Profile` into the request simulator, which stretches a step by its factor for
exactly the time another step runs beside it on the host's CPU (`tessera.sim.contention`).

A factor is per kind of step and kind of neighbour: ``decode`` (the model's repeated phase, at a few rows:
bound by reading the weights from memory) and ``prefill`` (a prompt: bound by compute on cached weights), as
the probe found them to differ.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tessera.cost.figure_cache import read_figures, write_figures
from tessera.errors import TesseraError

CONTENTION_KIND = "tessera-host-contention"
CONTENTION_VERSION = 1
KINDS = ("decode", "prefill")  # the step kinds a factor is measured for


class HostContentionError(TesseraError, ValueError):
    """Contention figures that cannot be used: an unknown kind, a factor below 1 or not finite, a damaged file."""


@dataclass(frozen=True)
class HostContention:
    """Per (step kind, neighbour kind): the factor by which a step's time grows while a neighbour's step
    computes on another worker of the host (1: no slowdown). ``threads``: each worker's threads when
    measured; ``source`` says how and when."""

    factors: tuple[tuple[str, str, float], ...]
    threads: int = 1
    source: str = ""

    def __post_init__(self) -> None:
        seen = set()
        for row in self.factors:
            if len(row) != 3:
                raise HostContentionError(f"contention factors must be (kind, neighbour kind, factor) rows, got {row!r}")
            kind, other, f = row
            bad = [k for k in (kind, other) if k not in KINDS]
            if bad:
                raise HostContentionError(f"contention kind {bad[0]!r} is not one of {', '.join(KINDS)}")
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f < 1.0:
                raise HostContentionError(f"contention factor for {kind} beside {other} must be a finite number "
                                          f">= 1 (a neighbour never speeds a step up), got {f!r}")
            if (kind, other) in seen:
                raise HostContentionError(f"contention factor for {kind} beside {other} given twice")
            seen.add((kind, other))
        missing = [(a, b) for a in KINDS for b in KINDS if (a, b) not in seen]
        if missing:
            raise HostContentionError(f"contention factors lack {', '.join(f'{a} beside {b}' for a, b in missing)}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise HostContentionError(f"contention threads must be a whole number >= 1, got {self.threads!r}")

    @classmethod
    def uniform(cls, factor: float, threads: int = 1, source: str = "") -> HostContention:
        """The same ``factor`` for every pair of kinds."""
        return cls(tuple((a, b, factor) for a in KINDS for b in KINDS), threads, source)

    def factor(self, kind: str, neighbour: str) -> float:
        """How many times longer a ``kind`` step takes while a ``neighbour`` step runs beside it."""
        for a, b, f in self.factors:
            if a == kind and b == neighbour:
                return float(f)
        raise HostContentionError(f"no contention factor for {kind!r} beside {neighbour!r} (kinds: {', '.join(KINDS)})")

    def describe(self) -> str:
        pairs = ", ".join(f"{a} beside {b} x{f:.2f}" for a, b, f in self.factors)
        return f"two workers at once: {pairs} ({self.threads} thread{'s' if self.threads != 1 else ''} each)"

    def to_dict(self, key: dict[str, Any]) -> dict[str, Any]:
        """The versioned JSON object of these figures, for the cache ``key``."""
        return {"kind": CONTENTION_KIND, "version": CONTENTION_VERSION, "key": key, **asdict(self)}

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> HostContention:
        """Rebuild from :meth:`to_dict`'s object (kind, version and every field checked)."""
        if not isinstance(d, dict) or d.get("kind") != CONTENTION_KIND or d.get("version") != CONTENTION_VERSION:
            raise HostContentionError(f"{source}: not a version-{CONTENTION_VERSION} {CONTENTION_KIND} file; delete "
                                      "it and it is measured again")
        missing = [n for n in ("factors", "threads", "source") if n not in d]
        if missing:
            raise HostContentionError(f"{source}: lacks field(s) {', '.join(missing)}; delete it and it is measured again")
        try:
            rows = tuple((str(a), str(b), float(f)) for a, b, f in d["factors"])
        except (TypeError, ValueError):
            raise HostContentionError(f"{source}: factors must be [kind, neighbour kind, factor] rows; delete it and "
                                      "it is measured again") from None
        return cls(rows, d["threads"], d["source"])


def read_cached(path: Path, key: dict[str, Any], quiet: bool = False) -> HostContention | None:
    """The figures cached at ``path`` if measured for ``key`` (`tessera.cost.figure_cache.read_figures`)."""
    return read_figures(path, key, HostContention.from_dict, quiet)


def write_cached(path: Path, key: dict[str, Any], figures: HostContention, busy: bool = False) -> None:
    """Cache ``figures`` at ``path`` for ``key`` (atomically); ``busy``: measured on a busy host."""
    write_figures(path, figures.to_dict(key), busy)
