"""Where Tessera keeps what it derives once per machine (converted weights, host measurements, fits), and
how every cache file is written: atomically, so a reader sees the old file or the new one, never half."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def default_cache_dir() -> Path:
    """Tessera's cache folder: ``$TESSERA_CACHE``, else ``~/.cache/tessera``."""
    env = os.environ.get("TESSERA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tessera"


def fsync_path(path: str | Path) -> None:
    """Flush a file's (or a folder's entries') contents to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path, mode: int = 0o644) -> Iterator[Path]:
    """A temporary path next to ``path`` to write in full; on a clean exit it is synced and renamed onto
    ``path`` (``os.replace``), on an exception deleted, so ``path`` keeps its old content or stays absent.

    Creates ``path``'s folder if needed. For writers that take a file name (``safetensors.save_file``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, mode)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # the rename itself is durable once the folder is synced
        fsync_path(path.parent)


def atomic_write(path: str | Path, data: str | bytes, mode: int = 0o644) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically (see `atomic_path`); returns ``path``."""
    with atomic_path(path, mode) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)
