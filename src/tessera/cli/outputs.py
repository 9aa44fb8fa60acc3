"""The files and folders a command writes: checked before the work starts, missing parent folders created (and
said so), write failures reported as errors; a command writes only what it was asked to."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tessera.console import err
from tessera.errors import TesseraError

T = TypeVar("T")


class OutputPathError(TesseraError):
    """An output path that cannot be written (an existing folder given as a file, a file in the way, no access)."""


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (the current folder for a relative path with none)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path.cwd()


def _check_ancestors(path: Path, option: str) -> None:
    """The closest existing ancestor of ``path``'s parent must be a folder this process may write in."""
    ancestor = _nearest_existing(path.parent)
    if not ancestor.is_dir():
        raise OutputPathError(f"{option} {path}: {ancestor} is a file, not a folder; give a path in a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputPathError(f"{option} {path}: no permission to write in {ancestor}; give a path in a "
                              "folder you can write")


def check_output_file(path: Path | None, option: str, example: str = "out.json") -> Path | None:
    """Refuse, before any work, a file path that cannot be written: an existing folder, a path under a file, or a
    folder without write permission (`OutputPathError` naming the option). None passes (nothing asked)."""
    if path is None:
        return None
    if path.is_dir():
        raise OutputPathError(f"{option} {path}: is an existing folder, not a file; give a file path, e.g. "
                              f"{path / example}")
    _check_ancestors(path, option)
    return path


def check_output_folder(path: Path, option: str) -> Path:
    """Refuse, before any work, a folder path that cannot be written: an existing file, a path under a file, or
    a folder without write permission."""
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{option} {path}: is an existing file, not a folder; give a folder path")
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise OutputPathError(f"{option} {path}: no permission to write in this folder")
        return path
    _check_ancestors(path, option)
    return path


def make_folder(folder: Path, option: str) -> None:
    """Create ``folder`` and its missing parents, saying so on stderr (nothing when it exists)."""
    if folder.is_dir():
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputPathError(f"{option}: cannot create the folder {folder} ({e.strerror})") from None
    err.print(f"[dim]created folder {folder}[/]", highlight=False)


def write_output(path: Path, option: str, write: Callable[[Path], T], example: str = "out.json") -> T:
    """``write(path)`` after checking ``path`` and creating its missing parent folders; an `OSError` while
    writing becomes an `OutputPathError` naming the option and the path."""
    check_output_file(path, option, example)
    make_folder(path.parent, option)
    try:
        return write(path)
    except OSError as e:
        raise OutputPathError(f"{option} {path}: cannot write it ({e.strerror or e})") from None
