"""Shared CLI plumbing: a user's mistake is one readable line and exit code 2."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.markup import escape

err_console = Console(stderr=True)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn the ValueErrors flexpipe raises for bad input into `error: ...` and exit 2."""
    try:
        yield
    except (ValueError, FileNotFoundError) as exc:
        err_console.print(
            f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(2) from None


def parse_overrides(items: list[str]) -> dict[str, str]:
    """`--set key=value` items to a mapping."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad --set {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def console() -> Console:
    """Standard output; wide enough for flexpipe's tables when it is not a terminal (pipes,
    `make run` logs), where rich would otherwise squeeze them to 80 columns."""
    out = Console()
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(width=160)
    return out
