"""Reading the JSON and YAML files Tessera takes as input, with errors that name the file and the fault."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


def _text(path: Path, what: str, error: type[Exception]) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise error(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: the {what} is not text ({e.reason} at byte {e.start})") from None


def read_json(path: str | Path, what: str, error: type[Exception], hint: str = "") -> Any:
    """The parsed JSON of ``path`` (``what`` names it in messages); failures raise ``error``."""
    p = Path(path)
    text = _text(p, what, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{p}: not a JSON file (line {e.lineno}, column {e.colno}: {e.msg})"
                    + (f"; {hint}" if hint else "")) from None


def read_yaml(path: str | Path, what: str, error: type[Exception]) -> Any:
    """The parsed YAML of ``path`` (``what`` names it in messages); failures raise ``error``."""
    p = Path(path)
    text = _text(p, what, error)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise error(f"{p}: not valid YAML: {e}") from None
