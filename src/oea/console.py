"""Console helpers shared by the command-line front ends (rich is imported on use)."""

from __future__ import annotations

from typing import Any


def wide_console() -> Any:
    """A rich console; when output is not a terminal, wide enough that tables do not wrap."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)
