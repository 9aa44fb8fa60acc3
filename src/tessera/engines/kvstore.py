"""The example KV connector's shared folder: where it lives and how it is kept small.

vLLM's ``ExampleConnector`` writes each prompt's KV (every layer, one file each) into a folder named by a
hash of the prompt's tokens and never deletes it; the decode engine reads it within moments. The store is
put in shared memory (``/dev/shm``) where the host has it, and `StoreCleaner` removes entries older than five
minutes, so a long run neither fills the memory nor slows down on it.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

MAX_AGE_S = 300.0  # far longer than a decode call waits behind its prefill
SHM = Path("/dev/shm")


def new_store(fallback_parent: Path) -> Path:
    """A new, empty store folder: in shared memory where the host has it, else under ``fallback_parent``."""
    parent = SHM if SHM.is_dir() else fallback_parent
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="tessera-kv-", dir=parent))


class StoreCleaner:
    """A thread removing the store's entries older than ``max_age_s`` (every ``max_age_s / 4``); ``stop``
    removes the store itself."""

    def __init__(self, store: Path, max_age_s: float = MAX_AGE_S):
        self.store, self.max_age_s = store, max_age_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tessera-kv-cleaner", daemon=True)

    def start(self) -> StoreCleaner:
        self._thread.start()
        return self

    def sweep(self, now: float | None = None) -> int:
        """Remove the entries older than ``max_age_s``; how many were removed."""
        now = time.time() if now is None else now
        removed = 0
        for entry in list(self.store.iterdir()) if self.store.is_dir() else []:
            try:
                if now - entry.stat().st_mtime > self.max_age_s:
                    shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
                    removed += 1
            except FileNotFoundError:  # removed meanwhile
                continue
        return removed

    def stop(self) -> None:
        self._stop.set()
        shutil.rmtree(self.store, ignore_errors=True)

    def _run(self) -> None:
        while not self._stop.wait(self.max_age_s / 4):
            self.sweep()


__all__ = ["StoreCleaner", "new_store"]
