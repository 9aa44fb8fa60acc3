"""A converted-weights cache folder that verifies itself: a manifest of every file's sha256 and size, the
source package and version it was converted from and the converter's format, checked when the folder is
used; a stale, damaged or unverifiable folder is rebuilt (with a one-line message saying why).

Hashing SmolLM2-135M's folder (269 MB) takes about 0.2 s on one core; it is done once per process (a file
whose size, mtime and inode are unchanged since it was hashed is not hashed again) unless ``force``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tessera.errors import TesseraError
from tessera.paths import atomic_write, fsync_path

MANIFEST = "manifest.json"
MANIFEST_KIND = "tessera-weight-cache"


class WeightCacheError(TesseraError):
    """A converted-weights cache folder does not match its manifest."""


@dataclass(frozen=True)
class CacheSource:
    """What a cache folder is converted from: a package (its installed ``version``, None when it is not
    installed) and a file in it, by a converter writing ``format``."""

    package: str
    version: str | None
    file: str
    format: int

    def describe(self) -> str:
        return f"{self.package} {self.version}" if self.version else self.package


def package_version(distribution: str) -> str | None:
    """The installed version of a distribution (``importlib.metadata``), None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


# folder -> (manifest text, each listed file's stamp) of the last folder found good in this process
_VERIFIED: dict[Path, tuple[str, dict[str, tuple[int, int, int]]]] = {}


def write_manifest(folder: Path, source: CacheSource) -> Path:
    """Hash every file of ``folder`` (synced to disk first) and write its manifest there."""
    files = {}
    for f in sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST):
        fsync_path(f)
        files[f.name] = {"sha256": file_sha256(f), "bytes": f.stat().st_size}
    manifest = {"kind": MANIFEST_KIND, "format": source.format,
                "source": {"package": source.package, "version": source.version, "file": source.file},
                "files": files}
    return atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def manifest_problem(folder: Path, source: CacheSource, force: bool = False) -> str | None:
    """Why ``folder`` cannot be used as converted from ``source`` (None: every file matches its manifest).

    Checks the manifest's kind and format, the source package's version (skipped when it is not installed),
    and each listed file's size and sha256 (``force``: hash again even if unchanged since the last check).
    """
    path = folder / MANIFEST
    if not path.is_file():
        return f"{MANIFEST} is missing" if folder.is_dir() else "not converted yet"
    try:
        text = path.read_text()
        manifest = json.loads(text)
        files = manifest["files"]
        recorded = manifest["source"]["version"]
        if manifest.get("kind") != MANIFEST_KIND or not isinstance(files, dict):
            raise ValueError("not a Tessera weight-cache manifest")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is damaged ({e})"
    if manifest.get("format") != source.format:
        return f"cache format {manifest.get('format')!r}, this Tessera writes format {source.format}"
    if source.version is not None and recorded != source.version:
        return f"converted from {source.package} {recorded}, installed is {source.version}"
    stamps, digests = {}, {}
    for name, entry in files.items():
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        try:
            size, digests[name] = int(entry["bytes"]), str(entry["sha256"])
        except (KeyError, TypeError, ValueError):
            return f"{MANIFEST} is damaged (entry {name!r})"
        stamps[name] = _stamp(f)
        if stamps[name][0] != size:
            return f"{name} is {stamps[name][0]} bytes, the manifest says {size} (truncated or damaged)"
    known = _VERIFIED.get(folder.resolve())
    if not force and known == (text, stamps):
        return None
    for name, digest in digests.items():
        if file_sha256(folder / name) != digest:
            _VERIFIED.pop(folder.resolve(), None)
            return f"{name} hash mismatch"
    _VERIFIED[folder.resolve()] = (text, stamps)
    return None


def verify_folder(folder: Path, source: CacheSource) -> str:
    """Hash every file of ``folder`` again now and compare with its manifest; returns what was verified.

    Raises:
        WeightCacheError: a file differs from the manifest (or the manifest is missing or damaged).
    """
    problem = manifest_problem(folder, source, force=True)
    if problem is not None:
        raise WeightCacheError(f"{folder}: {problem}; the next run reconverts it from {source.describe()}")
    files = json.loads((folder / MANIFEST).read_text())["files"]
    return (f"{', '.join(files)} re-hashed: sha256 equal to the manifest written when {folder.name} was converted "
            f"from {source.describe()}'s {source.file}")


def verified_folder(target: Path, source: CacheSource, build: Callable[[Path], None],
                    say: Callable[[str], None]) -> Path:
    """``target`` once it matches its manifest: as it is, or rebuilt by ``build`` (which fills an empty
    folder) when stale, damaged or never built; ``say`` gets a line saying why it is rebuilt.

    The new folder is built and hashed beside ``target`` and renamed into place, so an interrupted build
    leaves the old folder (or none); a damaged old folder is moved aside only once the new one is complete.
    """
    problem = manifest_problem(target, source)
    if problem is None:
        return target
    if target.exists():
        say(f"{target}: {problem}: reconverting from {source.describe()}")
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    trash = root / f".{target.name}-old-{os.getpid()}"
    try:
        build(tmp)
        write_manifest(tmp, source)
        # mkdtemp makes a private folder; the cache is an ordinary readable one
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if target.exists():
            if manifest_problem(target, source) is None:  # another process rebuilt it meanwhile
                return target
            target.rename(trash)
        try:
            tmp.rename(target)
        except OSError:  # another process renamed its rebuilt folder into place first
            if manifest_problem(target, source) is not None:
                raise
        fsync_path(root)
    finally:
        for leftover in (tmp, trash):
            if leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
    return target
