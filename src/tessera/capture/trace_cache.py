"""Traced graphs kept on disk between runs: a catalog model's step traced on ``meta`` is a pure function of
the model's config, the step's shape, the graph kind, the code that captures it and the torch /
transformers / diffusers versions, so a later run (a plan, an estimate) reads the graph instead of tracing
it again (qwen3-235b-a22b's decode: 0.55 s to trace, 0.05 s to read).

The key holds all of those: the catalog configs live in ``tessera/capture/catalog`` and are hashed with the
capture code (every file of ``tessera.capture``, ``tessera.kernels`` and ``tessera.graph``), so any change
to them misses the old entries. A user's local model directory is never cached (its files are not part of
the key). Entries are gzip'd JSON (the key's line, then the graph's) (gzip's CRC catches a damaged file, which then counts as a miss
and is traced again and rewritten), written atomically under ``<cache>/traces``. ``TESSERA_TRACE_CACHE=0``
turns the cache off.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import gzip
import hashlib
import json
import os
import weakref
import zlib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from tessera.capture.models import resolve_model
from tessera.capture.shapes import DEFAULT_GRAPH
from tessera.graph.ir import GRAPH_VERSION, GraphFormatError, KernelGraph
from tessera.paths import atomic_write, default_cache_dir

ENV_SWITCH = "TESSERA_TRACE_CACHE"  # "0" (or "off", "no", "false"): trace every time
_CODE_PACKAGES = ("capture", "kernels", "graph")  # what decides a trace (besides torch and transformers)
_LIBRARIES = ("torch", "transformers", "diffusers")
_ENTRIES: dict[int, tuple[weakref.ref, Path]] = {}  # id(graph) -> (the graph, its entry) for graphs read or written


def cache_folder() -> Path:
    """Where traced graphs are kept: ``<cache>/traces``."""
    return default_cache_dir() / "traces"


def enabled() -> bool:
    """Whether traces are read from and written to the cache (``TESSERA_TRACE_CACHE`` not 0/off)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "no", "false")


@functools.cache
def code_version() -> str:
    """A digest of every file of the packages that decide a trace (their sources and the model catalog)
    and of the installed torch / transformers / diffusers versions."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in _CODE_PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for lib in _LIBRARIES:
        try:
            version = metadata.version(lib)
        except metadata.PackageNotFoundError:
            version = "-"
        digest.update(f"{lib}={version}\0".encode())
    return digest.hexdigest()


def trace_key(model: str, phase: str, *, batch: int | None, seq: int | None, ctx: int | None, image: str | None,
              resolution: str | None, slots: int | None, graph: str) -> dict[str, Any] | None:
    """The cache key of one traced step on ``meta`` (None for a model that is not a catalog entry)."""
    spec = resolve_model(model)
    if spec.local:
        return None
    return {"model": spec.name, "phase": phase, "batch": batch, "seq": seq, "ctx": ctx, "image": image,
            "resolution": resolution, "slots": slots, "graph": graph, "graph_version": GRAPH_VERSION,
            "code": code_version()}


def entry_path(key: dict[str, Any], folder: Path | None = None) -> Path:
    """The file of one key."""
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return (cache_folder() if folder is None else folder) / f"{name}.json.gz"


def _remember(graph: KernelGraph, path: Path) -> KernelGraph:
    gid = id(graph)
    _ENTRIES[gid] = (weakref.ref(graph, lambda _ref: _ENTRIES.pop(gid, None)), path)
    return graph


def entry_of(graph: KernelGraph) -> Path | None:
    """The cache entry this very graph object was read from or written to in this process (None for any
    other graph): facts read off it may be kept beside it (`tessera.capture.trace_facts`)."""
    known = _ENTRIES.get(id(graph))
    return known[1] if known is not None and known[0]() is graph else None


def read(key: dict[str, Any], folder: Path | None = None) -> KernelGraph | None:
    """The cached graph of ``key``, or None (absent, damaged or another key's)."""
    path = entry_path(key, folder)
    collecting = gc.isenabled()
    gc.disable()  # a graph is ~50,000 small objects: collections while parsing them took 10x the parse
    try:
        key_text, _, graph_text = gzip.decompress(path.read_bytes()).partition(b"\n")
        if json.loads(key_text) != key:
            return None
        return _remember(KernelGraph.from_dict(json.loads(graph_text), source=str(path), check_hash=False), path)
    except (OSError, EOFError, zlib.error, gzip.BadGzipFile, ValueError, KeyError, TypeError, GraphFormatError):
        return None
    finally:
        if collecting:
            gc.enable()


def write(key: dict[str, Any], graph: KernelGraph, folder: Path | None = None) -> None:
    """Keep ``graph`` under ``key`` (a cache that cannot be written is skipped: the trace stands)."""
    blob = gzip.compress(json.dumps(key, sort_keys=True).encode() + b"\n" + graph.to_json().encode(), compresslevel=1)
    with contextlib.suppress(OSError):
        _remember(graph, atomic_write(entry_path(key, folder), blob))


def trace_model_cached(model: str, phase: str, *, batch: int | None = None, seq: int | None = None,
                       ctx: int | None = None, image: str | None = None, resolution: str | None = None,
                       slots: int | None = None, graph: str = DEFAULT_GRAPH,
                       on_trace: Callable[[], None] | None = None) -> KernelGraph:
    """`tessera.capture.api.trace_model` on ``meta``, read from the cache when this step was traced before
    by the same code (and written to it otherwise); ``on_trace`` is called before a trace that runs. A hit
    imports neither torch nor the tracer."""
    key = trace_key(model, phase, batch=batch, seq=seq, ctx=ctx, image=image, resolution=resolution, slots=slots,
                    graph=graph) if enabled() else None
    if key is not None:
        hit = read(key)
        if hit is not None:
            return hit
    from tessera.capture.api import trace_model  # on a miss only: it imports torch and transformers

    if on_trace is not None:
        on_trace()
    traced = trace_model(model, phase, batch=batch, seq=seq, ctx=ctx, image=image, resolution=resolution,
                         slots=slots, graph=graph)
    if key is not None:
        write(key, traced)
    return traced
