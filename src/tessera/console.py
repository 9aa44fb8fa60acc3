"""The consoles every command prints to, and the one way a command reports an error."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # error lines are never wrapped: paths stay greppable


def print_error(message: object) -> None:
    """Print ``error: message`` on stderr (the message is text, never rich markup)."""
    err.print(f"[bold red]error:[/] {escape(str(message))}")


def fail(message: object, code: int = 2) -> NoReturn:
    """Report an error and end the command with ``code`` (2: bad input)."""
    print_error(message)
    raise typer.Exit(code)
