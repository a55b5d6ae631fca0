"""Shared CLI plumbing: a user's mistake is one readable line and exit code 2."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
import yaml
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from flexpipe.policies.shift import ShiftParams

err_console = Console(stderr=True)

_YAML_SYNTAX = "YAML syntax error:"


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A PyYAML error in one line: `line L, column C: YAML syntax error: context; problem`
    (PyYAML's own message spans up to seven lines, with the source quoted)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        reason = "; ".join(str(p) for p in (exc.context, exc.problem) if p)
        return f"{where}{_YAML_SYNTAX} {reason}"
    return f"{_YAML_SYNTAX} {' '.join(str(exc).split())}"


def one_line(exc: BaseException) -> str:
    """The message of a user error. A YAML syntax error wrapped by a loader that quoted
    PyYAML's several lines (`raise X(f"{path}: YAML syntax error: {exc}") from None`) is put
    back into one line, from the PyYAML error it wrapped."""
    text = str(exc)
    if isinstance(exc, yaml.YAMLError):
        return yaml_problem(exc)
    inner = exc.__context__
    if "\n" in text and isinstance(inner, yaml.YAMLError) and _YAML_SYNTAX in text:
        head = text.split(_YAML_SYNTAX, 1)[0]
        return head + yaml_problem(inner)
    return text


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn the ValueErrors flexpipe raises for bad input (and YAML syntax errors) into
    `error: ...` and exit 2."""
    try:
        yield
    except (ValueError, FileNotFoundError, yaml.YAMLError) as exc:
        err_console.print(
            f"[bold red]error:[/] {escape(one_line(exc))}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(2) from None


def read_yaml(path: Path) -> Any:
    """A YAML file's document; an unreadable file or a syntax error is one ValueError line
    naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"{path}: cannot read the file: {reason}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: {yaml_problem(exc)}") from None


def load_shift_params(path: Path) -> ShiftParams:
    """`--shift-config`: a YAML file with a `shift:` section (docs/shift-policy.md), checked
    whole (syntax, unknown keys, values) with one ValueError line for the first mistake."""
    from flexpipe.policies.shift import ShiftParams

    doc = read_yaml(path) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping with a `shift:` section")
    section = doc.get("shift", doc)
    if not isinstance(section, dict):
        raise ValueError(f"{path}: `shift:` must be a mapping")
    try:
        return ShiftParams.from_mapping(section)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


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
