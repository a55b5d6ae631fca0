"""Instance names that say which instance they are for the life of a deployment."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["gather_names", "unique_name"]


def unique_name(name: str, taken: set[str]) -> str:
    """`name`, or `name.2`, `name.3`, ... : the first no earlier instance had. The planner
    names instances `<model>-<n>` per plan, so two plans reuse names; an instance's name
    must say which one it is for the life of the deployment."""
    out, k = name, 1
    while out in taken:
        k += 1
        out = f"{name}.{k}"
    return out


def gather_names(running: Mapping[str, Any]) -> set[str]:
    """The names of the instances running now (a deployment adopted after a restart)."""
    return {i.planned.name for i in running.values()}
