"""The store: a SQLAlchemy engine over SQLite by default (any SQLAlchemy URL works, e.g.
`postgresql+psycopg://...`). The URL comes from the argument, else `$FLEXPIPE_STORE`, else
`sqlite:///~/.flexpipe/flexpipe.db`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, delete, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session

from flexpipe.gears.point import GearKey, GearPoint
from flexpipe.perf.calibration import Calibration, GpuCalibration, LinkCalibration
from flexpipe.perf.efficiency import Efficiency
from flexpipe.store.migrate import add_missing_columns
from flexpipe.store.schema import Base, CalibrationRow, GearPointRow

STORE_ENV = "FLEXPIPE_STORE"


class StoreError(ValueError):
    """The store cannot be opened or written; the message says which URL and why."""


def default_store_url() -> str:
    env = os.environ.get(STORE_ENV)
    if env:
        return env
    return f"sqlite:///{Path.home() / '.flexpipe' / 'flexpipe.db'}"


def _display(url: str) -> str:
    """The URL without its password (safe to print)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


class Store:
    def __init__(self, url: str | None = None, create: bool = True) -> None:
        """`create=False` (read-only commands such as `flexpipe shifts`): a SQLite file that
        does not exist is a StoreError, not a new store (its folder is not made either)."""
        self.url = url or default_store_url()
        try:
            parsed = make_url(self.url)
        except ArgumentError:
            raise StoreError(f"not a database URL: {self.url!r}") from None
        if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
            path = Path(os.path.expanduser(str(parsed.database)))
            if not create and not path.is_file():
                raise StoreError(
                    f"cannot open store {_display(self.url)}: no such file (a read creates none)"
                )
            path.parent.mkdir(parents=True, exist_ok=True)
            parsed = parsed.set(database=str(path))
        try:
            self.engine: Engine = create_engine(parsed)
            Base.metadata.create_all(self.engine)
            add_missing_columns(self.engine, Base.metadata.sorted_tables)  # see migrate.py
        except (SQLAlchemyError, ModuleNotFoundError) as exc:
            raise StoreError(f"cannot open store {_display(self.url)}: {exc}") from None

    def ensure_table(self, row_class: Any, what: str) -> None:
        """Create the table of `row_class` (a model on `Base`) if missing, with any column a
        newer version added (migrate.py); a StoreError naming `what` if the store cannot."""
        table = row_class.__table__
        try:
            Base.metadata.create_all(self.engine, tables=[table])
            add_missing_columns(self.engine, [table])
        except SQLAlchemyError as exc:
            raise StoreError(f"cannot open {what} in {_display(self.url)}: {exc}") from None

    @property
    def display_url(self) -> str:
        """The URL without its password (safe to print)."""
        return _display(self.url)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- gear table --------------------------------------------------------------------------

    def put_points(self, points: Iterable[GearPoint]) -> int:
        """Insert points; a point with the same key and batch size replaces the old one."""
        num = 0
        with Session(self.engine) as session, session.begin():
            for p in points:
                session.execute(
                    delete(GearPointRow).where(
                        GearPointRow.model == p.model,
                        GearPointRow.gear_key == p.gear_key,
                        GearPointRow.gpu_types == p.gpu_types,
                        GearPointRow.link == p.link,
                        GearPointRow.batch_size == p.batch_size,
                    )
                )
                session.add(GearPointRow(**_point_values(p)))
                num += 1
        return num

    def points(
        self,
        model: str | None = None,
        gear_key: str | None = None,
        gpu_types: str | None = None,
        link: str | None = None,
    ) -> list[GearPoint]:
        """Points matching every filter given, ordered by key then batch size."""
        query = select(GearPointRow)
        for column, value in (
            (GearPointRow.model, model),
            (GearPointRow.gear_key, gear_key),
            (GearPointRow.gpu_types, gpu_types),
            (GearPointRow.link, link),
        ):
            if value is not None:
                query = query.where(column == value)
        query = query.order_by(
            GearPointRow.model,
            GearPointRow.gear_key,
            GearPointRow.gpu_types,
            GearPointRow.link,
            GearPointRow.batch_size,
        )
        with Session(self.engine) as session:
            return [_row_point(r) for r in session.scalars(query)]

    def curves(self, model: str | None = None) -> dict[GearKey, list[GearPoint]]:
        """Points grouped by curve key (each list sorted by batch size)."""
        out: dict[GearKey, list[GearPoint]] = {}
        for p in self.points(model=model):
            out.setdefault(p.key, []).append(p)
        return out

    def delete_points(self, model: str | None = None, gear_key: str | None = None) -> int:
        query = delete(GearPointRow)
        if model is not None:
            query = query.where(GearPointRow.model == model)
        if gear_key is not None:
            query = query.where(GearPointRow.gear_key == gear_key)
        with Session(self.engine) as session, session.begin():
            result = session.execute(query)
            return int(getattr(result, "rowcount", 0) or 0)

    # -- calibrated factor sets (next to the gear table) -----------------------------------

    def put_calibration(self, calibration: Calibration) -> int:
        """Store every GPU type and link class of `calibration`, replacing the same names."""
        now = datetime.now(UTC)
        rows: list[tuple[str, str, dict[str, Any], str]] = [
            ("gpu", g.gpu_type, g.as_dict(), g.source) for g in calibration.gpus
        ]
        rows += [("link", lk.link, lk.as_dict(), lk.source) for lk in calibration.links]
        with Session(self.engine) as session, session.begin():
            for kind, name, doc, source in rows:
                session.execute(
                    delete(CalibrationRow).where(
                        CalibrationRow.kind == kind, CalibrationRow.name == name
                    )
                )
                session.add(
                    CalibrationRow(
                        kind=kind,
                        name=name,
                        factors_json=json.dumps(doc),
                        source=source,
                        measured_at=now,
                    )
                )
        return len(rows)

    def calibration(self) -> Calibration:
        """Every stored factor set (empty when `flexpipe calibrate` never ran here)."""
        with Session(self.engine) as session:
            rows = list(session.scalars(select(CalibrationRow).order_by(CalibrationRow.id)))
        return Calibration(
            gpus=tuple(
                GpuCalibration.from_dict(json.loads(r.factors_json))
                for r in rows
                if r.kind == "gpu"
            ),
            links=tuple(
                LinkCalibration.from_dict(json.loads(r.factors_json))
                for r in rows
                if r.kind == "link"
            ),
            provenance=(("store", self.display_url),) if rows else (),
        )

    def efficiency(self, base: Efficiency | None = None) -> Efficiency:
        """`base` (default factors) with the stored factor sets over its calibration: what
        `plan`, `up`, `sim` and `estimate` hand the performance model."""
        eff = base or Efficiency()
        return eff.with_calibration(eff.calibration.merged(self.calibration()))

    def delete_calibration(self, name: str) -> int:
        with Session(self.engine) as session, session.begin():
            result = session.execute(delete(CalibrationRow).where(CalibrationRow.name == name))
            return int(getattr(result, "rowcount", 0) or 0)


_POINT_NAMES = tuple(f.name for f in fields(GearPoint))


def _point_values(p: GearPoint) -> dict[str, Any]:
    return {name: getattr(p, name) for name in _POINT_NAMES}


def _row_point(row: GearPointRow) -> GearPoint:
    values = {name: getattr(row, name) for name in _POINT_NAMES}
    stamp: datetime = values["measured_at"]
    if stamp.tzinfo is None:  # SQLite drops the zone; we always store UTC
        values["measured_at"] = stamp.replace(tzinfo=UTC)
    return GearPoint(**values)
