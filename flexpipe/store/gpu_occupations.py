"""The admin's GPU occupations (`flexpipe cluster occupy`), kept in the store so that a
restarted controller (kill -9, `flexpipe up` starts it again) does not plan onto a GPU a
tenant holds.

Table `gpu_occupations`: one row per deployment, its occupations as the JSON of
`control.core.resources.Overrides.to_json()` (GPU id -> owner, since, until in UTC epoch seconds),
rewritten on every change. The store keeps the document; what it means is the controller's.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import DateTime, String, Text
from sqlalchemy.orm import Mapped, Session, mapped_column

from flexpipe.store.schema import Base
from flexpipe.store.store import Store, StoreError

__all__ = ["GpuOccupationRow", "GpuOccupations"]


class GpuOccupationRow(Base):
    __tablename__ = "gpu_occupations"

    deployment: Mapped[str] = mapped_column(String(300), primary_key=True)
    overrides_json: Mapped[str] = mapped_column(Text)  # GPU id -> {owner, since_s, until_s}
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class GpuOccupations:
    """The occupations of each deployment in a store (creates the table when opened)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        store.ensure_table(GpuOccupationRow, "the GPU occupations")

    def load(self, deployment: str) -> dict[str, Any]:
        """The document last saved for `deployment` ({} when none)."""
        with Session(self.store.engine) as session:
            row = session.get(GpuOccupationRow, deployment)
            if row is None:
                return {}
            doc = json.loads(row.overrides_json)
        if not isinstance(doc, dict):
            raise StoreError(f"gpu_occupations of {deployment!r}: not a JSON object")
        return doc

    def save(self, deployment: str, doc: dict[str, Any], at: datetime | None = None) -> None:
        """Replace the document of `deployment`."""
        with Session(self.store.engine) as session, session.begin():
            row = session.get(GpuOccupationRow, deployment, with_for_update=True)
            text = json.dumps(doc, sort_keys=True)
            stamp = at or datetime.now(UTC)
            if row is None:
                session.add(
                    GpuOccupationRow(deployment=deployment, overrides_json=text, updated_at=stamp)
                )
            else:
                row.overrides_json, row.updated_at = text, stamp
