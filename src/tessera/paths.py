"""Where Tessera keeps what it derives once per machine (converted weights, host measurements, fits)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """Tessera's cache folder: ``$TESSERA_CACHE``, else ``~/.cache/tessera``."""
    env = os.environ.get("TESSERA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tessera"
