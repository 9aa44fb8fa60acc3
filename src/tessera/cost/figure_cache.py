"""The cache files of a host probe's figures (`HostOverhead`, `HostContention`, a step's in-step excess): one
JSON object per key, marked ``busy`` when measured on a busy host, so that a use on a quiet host measures
again."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tessera.errors import TesseraError
from tessera.paths import atomic_write

T = TypeVar("T")


def read_figures(path: Path, key: dict[str, Any], parse: Callable[[dict[str, Any], str], T],
                 quiet: bool = False) -> T | None:
    """The figures ``parse`` rebuilds from the file at ``path`` if it was written for ``key``; None when absent,
    for another key, unreadable, malformed, or (``quiet``: the host is quiet now) measured while it was busy."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or d.get("key") != key or (quiet and d.get("busy", True)):
        return None
    try:
        return parse(d, str(path))
    except (TesseraError, TypeError, KeyError, ValueError, AttributeError):
        return None


def write_figures(path: Path, record: dict[str, Any], busy: bool = False) -> None:
    """Write ``record`` (holding its ``key``) at ``path`` atomically; ``busy``: measured on a busy host."""
    atomic_write(path, json.dumps({**record, "busy": busy}, indent=2, sort_keys=True))
