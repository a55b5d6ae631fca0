"""The layout shows what is pure, and a test keeps it so: the simulator, the pure cores
(`*/core/`) and the policies import no I/O module, directly or through any flexpipe module
they import (HTTP, asyncio servers and tasks, sockets, subprocesses, the store's database
engine). Imports under `if TYPE_CHECKING:` are annotations only and do not count.

Read from the source with `ast`, not by importing: what a module would import at run time,
whatever else the test process has loaded.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "flexpipe"

# Modules that do I/O or run an event loop; a pure module reaches none of them.
IO_MODULES = (
    "asyncio",
    "socket",
    "selectors",
    "ssl",
    "subprocess",
    "multiprocessing",
    "http",
    "urllib.request",
    "sqlalchemy",
    "uvloop",
    "httptools",
    "ray",
    "pynvml",
)

# The simulator stands the live system's I/O shells in by its own; it may import these
# packages only through their pure parts.
PURE_ROOTS = ("flexpipe.sim", "flexpipe.control.core", "flexpipe.gateway.core", "flexpipe.policies")


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _path_of(module: str) -> Path | None:
    base = ROOT / Path(*module.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    walk(sub)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.append(child)
            walk(child)

    walk(tree)
    return found


@cache
def _imports(module: str) -> frozenset[str]:
    """Every module `module` imports at run time (a `from pkg import name` counts both `pkg`
    and `pkg.name` when the latter is a module)."""
    path = _path_of(module)
    if path is None:
        return frozenset()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in _runtime_imports(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif node.level == 0 and node.module:
            names.add(node.module)
            for alias in node.names:
                if _path_of(f"{node.module}.{alias.name}") is not None:
                    names.add(f"{node.module}.{alias.name}")
    # importing a.b.c runs a/__init__.py and a/b/__init__.py too
    for name in list(names):
        parts = name.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(names)


def _io_path(start: str) -> list[str] | None:
    """The chain of imports from `start` to an I/O module, or None when there is none."""
    seen = {start}
    stack: list[tuple[str, list[str]]] = [(start, [start])]
    while stack:
        module, chain = stack.pop()
        for name in sorted(_imports(module)):
            if name.split(".")[0] in IO_MODULES or name in IO_MODULES:
                return [*chain, name]
            if name.startswith("flexpipe") and name not in seen:
                seen.add(name)
                stack.append((name, [*chain, name]))
    return None


def _pure_modules() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_of(path)
        if module.startswith(PURE_ROOTS):
            out.append(module)
    return out


@pytest.mark.parametrize("module", _pure_modules())
def test_a_pure_module_reaches_no_io_module(module: str) -> None:
    chain = _io_path(module)
    assert chain is None, " -> ".join(chain or [])


def test_the_check_finds_an_io_import() -> None:
    """The check itself: the live gateway's app reaches asyncio, the simulator's loop does not."""
    assert _io_path("flexpipe.gateway.app") is not None
    assert _io_path("flexpipe.sim.loop") is None


def test_type_checking_imports_do_not_count() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import asyncio\nimport math\n"
    )
    assert [n.names[0].name for n in _runtime_imports(tree) if isinstance(n, ast.Import)] == [
        "math"
    ]
