"""The admin's occupations (`flexpipe cluster occupy|release`) kept in the store, and read back
when a controller starts, before its first plan and the adoption of what a previous controller
left running: a controller killed and restarted does not plan onto, or stay on, a GPU a
tenant holds (docs/controller.md).

Written on every change of the overrides (the admin API, an occupation running out); an
occupation whose `until` passed while no controller ran is dropped when read back. The ones
the command line gives (`--occupy`: the demo's tenant) are the command line's, laid over at
every start, and not written. A store that fails is logged: the controller serves on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from flexpipe.control.core.resources import Occupation, Overrides
from flexpipe.store import Store, StoreError
from flexpipe.store.gpu_occupations import GpuOccupations

__all__ = ["OccupationMemory", "persisted", "restored"]

log = logging.getLogger("flexpipe.controller")


def restored(doc: Mapping[str, Any], now_s: float) -> tuple[Overrides, list[str]]:
    """The occupations of a saved document still in force at `now_s` (unix s), and the GPU
    ids of those that ran out meanwhile."""
    saved = Overrides.from_json(doc)
    kept = saved.expired(now_s)
    return kept, sorted(set(saved.occupied) - set(kept.occupied))


def persisted(overrides: Overrides, pinned: Mapping[str, Occupation]) -> Overrides:
    """What the store keeps: the overrides without the command line's occupations (`pinned`,
    as the controller made them at start; one the admin replaced or released is the admin's)."""
    return Overrides({g: o for g, o in overrides.occupied.items() if pinned.get(g) != o})


class OccupationMemory:
    def __init__(self, table: GpuOccupations, deployment: str) -> None:
        self.table = table
        self.deployment = deployment
        self._written: dict[str, Any] | None = None  # the document in the store

    @classmethod
    def of(cls, store: Store | None, deployment: str) -> OccupationMemory | None:
        return None if store is None else cls(GpuOccupations(store), deployment)

    def restore(self, now_s: float, say: Callable[[str], None] | None = None) -> Overrides:
        """The occupations saved for this deployment, still in force at `now_s`."""
        try:
            doc = self.table.load(self.deployment)
            kept, dropped = restored(doc, now_s)
        except (SQLAlchemyError, StoreError, KeyError, TypeError, ValueError) as exc:
            log.warning("GPU occupations not read back from the store: %s", exc)
            return Overrides()
        self._written = doc
        if say is not None and kept.occupied:
            held = ", ".join(f"{g} ({o.owner})" for g, o in sorted(kept.occupied.items()))
            say(f"controller: GPU(s) occupied before the restart, still held: {held}")
        if say is not None and dropped:
            say(f"controller: occupation(s) of {', '.join(dropped)} ran out while stopped")
        return kept

    def keep(self, overrides: Overrides, pinned: Mapping[str, Occupation]) -> bool:
        """Write the overrides (less `pinned`) when they differ from the store's; True if
        written."""
        doc = persisted(overrides, pinned).to_json()
        if doc == self._written:
            return False
        try:
            self.table.save(self.deployment, doc)
        except SQLAlchemyError as exc:
            log.warning("GPU occupations not written to the store: %s", exc)
            return False
        self._written = doc
        return True
