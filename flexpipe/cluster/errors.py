"""The one error type of cluster descriptions, and the wording shared by its sources."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flexpipe.hardware import GiB, GpuSpec

__all__ = ["ClusterError", "exceeds", "unknown"]


class ClusterError(ValueError):
    """A cluster file (or a change to a cluster) that does not make sense.

    `errors` holds one line per problem: `file: place: reason`; the message is those lines.
    """

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


def unknown(kind: str, name: str, known: Mapping[str, object]) -> str:
    """`unknown GPU 'x'; known: a, b, ...` (the first 16 names)."""
    names = list(known)
    shown = ", ".join(names[:16]) + (f", ... ({len(names)} in all)" if len(names) > 16 else "")
    return f"unknown {kind} {name!r}; known: {shown}"


def exceeds(used_bytes: float, spec: GpuSpec) -> str:
    return (
        f"{used_bytes / GiB:.1f} GiB used exceeds the {spec.name}'s "
        f"{spec.memory_bytes / GiB:.1f} GiB"
    )
