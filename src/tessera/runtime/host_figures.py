"""How a host probe's figures are measured on first use and cached (`tessera.runtime.overhead_probe`,
`.contention_probe`, `.step_excess_probe`): the file per key (this CPU, threads, torch, a digest of the code
they time, the probe's own shapes), the host's load watched while measuring, and figures measured on a busy
host used until a use on a quiet host measures them again."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tessera.paths import default_cache_dir

T = TypeVar("T")


def code_digest(sources: tuple[str, ...]) -> str:
    """A digest of the sources (paths under the ``tessera`` package, files or folders of ``.py`` files) whose
    speed a probe's figures are of."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for rel in sources:
        path = root / rel
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def figures_path(kind: str, threads: int, key: dict[str, Any], cache_dir: Path | None = None) -> Path:
    """The cache file of ``kind``'s figures for ``key``: ``<cache>/host/<kind>-<threads>t-<digest>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (cache_dir or default_cache_dir() / "host") / f"{kind}-{threads}t-{digest}.json"


class LoadWatch:
    """The host's load average from the start of a measurement: ``peak()`` is the highest seen so far."""

    def __init__(self) -> None:
        self._peak = os.getloadavg()[0]

    def peak(self) -> float:
        """The highest one-minute load average seen since the start, read now too."""
        self._peak = max(self._peak, os.getloadavg()[0])
        return self._peak


def cached_or_measured(path: Path, key: dict[str, Any], read: Callable[[Path, dict[str, Any], bool], T | None],
                       write: Callable[[Path, dict[str, Any], T, bool], None], measure: Callable[[LoadWatch], T],
                       what: str, log: Callable[[str], None] = lambda s: None) -> T:
    """The figures cached at ``path`` for ``key`` (``read``; those measured on a busy host only while the host is
    busy too), else ``measure``'s, written with ``write`` and marked busy where the load average reached the
    host's cores while measuring."""
    from tessera.hardware.host import host_cores

    cached = read(path, key, os.getloadavg()[0] < host_cores())
    if cached is not None:
        return cached
    log(f"measuring {what} (cached in {path.parent})")
    watch = LoadWatch()
    figures = measure(watch)
    load = watch.peak()
    busy = load >= host_cores()
    if busy:
        log(f"the host was busy (load average {load:.1f}): these figures are measured again once it is quiet")
    write(path, key, figures, busy)
    return figures
