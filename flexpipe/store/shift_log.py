"""The shift log in the store: every decision, taken or not, and what became of it.

Append-only: `append` writes an entry once; `update_outcome` is the one way to add what is
known later (outcome, rehearsal, phases, requests migrated, performance after), and it only
fills in: a fact already written is never changed (writing the same value again is a no-op,
so a restarted controller may replay), and an outcome moves only from `pending`.

Table `shift_log`: the facts one filters or aggregates on are columns (time, kind, trigger,
outcome, score, rehearsal pass/fail, each phase, each migration method, the performance after,
the deployment that wrote it); the lists (signals, plans, alternatives, rehearsal checks, the
price's terms) are JSON columns read back into the typed records of shift_entry.py.
The schema grows by new nullable columns (see migrate.py).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Boolean, DateTime, Float, Integer, String, Text, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column
from sqlalchemy.sql import Select

from flexpipe.policies.shift.snapshot import ShiftRecord
from flexpipe.store.schema import Base
from flexpipe.store.shift_entry import (
    FINAL_OUTCOMES,
    FIXED_OUTCOMES,
    KINDS,
    METHODS,
    PHASES,
    After,
    Alternative,
    Kind,
    Migrated,
    Outcome,
    Phases,
    PlanInstance,
    PriceTerms,
    RehearsalCheck,
    ShiftEntry,
    SignalValues,
)
from flexpipe.store.store import Store

__all__ = ["SHIFT_KINDS", "ShiftLog", "ShiftLogError", "ShiftLogRow"]

# kinds the shift policy's history counts: changes it decided (the first plan is not one; a
# rollback is the end of a shift, recorded as that shift's outcome)
SHIFT_KINDS: frozenset[Kind] = frozenset({"shift", "reclaim", "emergency"})


class ShiftLogError(ValueError):
    """An entry that does not exist, or an update that would rewrite a written fact."""


class ShiftLogRow(Base):
    __tablename__ = "shift_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    kind: Mapped[str] = mapped_column(String(20), index=True)
    trigger: Mapped[str] = mapped_column(String(40))
    reason: Mapped[str] = mapped_column(Text)
    outcome: Mapped[str] = mapped_column(String(20), index=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    score: Mapped[float | None] = mapped_column(Float, nullable=True)
    rehearsal_passed: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    warm_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    rehearse_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    switch_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    drain_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    migrate_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    release_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    sleep_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    wake_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # requests migrated by method (NULL: not known yet)
    num_kv_moved: Mapped[int | None] = mapped_column(Integer, nullable=True)
    num_recomputed: Mapped[int | None] = mapped_column(Integer, nullable=True)
    num_finished_in_place: Mapped[int | None] = mapped_column(Integer, nullable=True)
    num_rerun: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # performance measured after (NULL: not yet)
    after_window_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    after_requests_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    after_goodput_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    after_ttft_p99_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    after_tpot_p99_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    after_num_failed: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # lists, as JSON
    signals_json: Mapped[str] = mapped_column(Text)
    current_json: Mapped[str] = mapped_column(Text)
    target_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    price_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    alternatives_json: Mapped[str] = mapped_column(Text)
    rehearsal_json: Mapped[str] = mapped_column(Text)
    notes_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    # the deployment whose controller wrote it (NULL: written without one)
    deployment: Mapped[str | None] = mapped_column(String(300), nullable=True)


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _utc(at: datetime | None) -> datetime | None:
    if at is None:
        return None
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at  # SQLite drops the zone


def _set_migrated(row: ShiftLogRow, migrated: Migrated) -> None:
    for method in METHODS:
        setattr(row, f"num_{method}", getattr(migrated, method))


def _set_after(row: ShiftLogRow, after: After) -> None:
    for name, value in after.to_dict().items():
        setattr(row, f"after_{name}", value)


def _to_row(entry: ShiftEntry) -> ShiftLogRow:
    row = ShiftLogRow(
        at=entry.at,
        kind=entry.kind,
        trigger=entry.trigger,
        reason=entry.reason,
        outcome=entry.outcome,
        error=entry.error,
        finished_at=entry.finished_at,
        score=entry.score,
        rehearsal_passed=entry.rehearsal_passed,
        signals_json=_dump([s.to_dict() for s in entry.signals]),
        current_json=_dump([i.to_dict() for i in entry.current]),
        target_json=None if entry.target is None else _dump([i.to_dict() for i in entry.target]),
        price_json=None if entry.price is None else _dump(entry.price.to_dict()),
        alternatives_json=_dump([a.to_dict() for a in entry.alternatives]),
        rehearsal_json=_dump([c.to_dict() for c in entry.rehearsal]),
        notes_json=_dump(list(entry.notes)),
        **entry.phases.to_dict(),
    )
    if entry.migrated is not None:
        _set_migrated(row, entry.migrated)
    if entry.after is not None:
        _set_after(row, entry.after)
    return row


def _from_row(row: ShiftLogRow) -> ShiftEntry:
    counts = [getattr(row, f"num_{m}") for m in METHODS]
    migrated = None if all(c is None for c in counts) else Migrated(*(int(c or 0) for c in counts))
    after = None
    if row.after_window_s is not None:
        after = After(
            window_s=row.after_window_s,
            requests_per_s=row.after_requests_per_s or 0.0,
            goodput_per_s=row.after_goodput_per_s,
            ttft_p99_s=row.after_ttft_p99_s,
            tpot_p99_s=row.after_tpot_p99_s,
            num_failed=row.after_num_failed or 0,
        )
    target = None if row.target_json is None else json.loads(row.target_json)
    return ShiftEntry(
        id=row.id,
        at=_utc(row.at) or row.at,
        kind=row.kind,  # type: ignore[arg-type]  # written from a Kind
        trigger=row.trigger,
        reason=row.reason,
        signals=tuple(SignalValues.from_dict(s) for s in json.loads(row.signals_json)),
        current=tuple(PlanInstance.from_dict(i) for i in json.loads(row.current_json)),
        target=None if target is None else tuple(PlanInstance.from_dict(i) for i in target),
        score=row.score,
        price=None if row.price_json is None else PriceTerms.from_dict(json.loads(row.price_json)),
        alternatives=tuple(Alternative.from_dict(a) for a in json.loads(row.alternatives_json)),
        notes=tuple(json.loads(row.notes_json or "[]")),
        outcome=row.outcome,  # type: ignore[arg-type]  # written from an Outcome
        error=row.error,
        finished_at=_utc(row.finished_at),
        rehearsal=tuple(RehearsalCheck.from_dict(c) for c in json.loads(row.rehearsal_json)),
        migrated=migrated,
        phases=Phases(**{f"{p}_s": getattr(row, f"{p}_s") for p in PHASES}),
        after=after,
        deployment=row.deployment,
    )


def _fill(entry_id: int, what: str, old: Any, new: Any) -> Any:
    """`new` if `old` is unset or equal; a written fact is never changed."""
    if new is None or old is None or old == new:
        return old if new is None else new
    raise ShiftLogError(f"shift log entry {entry_id}: {what} is already {old!r}, not {new!r}")


class ShiftLog:
    """The shift log of a store (creates its table, and grows it, when opened)."""

    def __init__(self, store: Store, deployment: str | None = None) -> None:
        """`deployment`: entries are written as its, and `pending` and `history` read only its
        (a controller's cooldown and aborted changes are its own); None: every entry."""
        self.store = store
        self.deployment = deployment
        store.ensure_table(ShiftLogRow, "the shift log")

    def append(self, entry: ShiftEntry) -> ShiftEntry:
        """Write `entry`; returns it with its id."""
        if entry.id is not None:
            raise ShiftLogError(f"entry already has id {entry.id}: append writes new entries")
        with Session(self.store.engine) as session, session.begin():
            row = _to_row(entry)
            row.deployment = self.deployment
            session.add(row)
            session.flush()
            return replace(entry, id=int(row.id), deployment=self.deployment)

    def get(self, entry_id: int) -> ShiftEntry:
        with Session(self.store.engine) as session:
            row = session.get(ShiftLogRow, entry_id)
            if row is None:
                raise ShiftLogError(f"no shift log entry {entry_id}")
            return _from_row(row)

    def update_outcome(
        self,
        entry_id: int,
        *,
        outcome: Outcome | None = None,
        at: datetime | None = None,
        error: str | None = None,
        rehearsal: tuple[RehearsalCheck, ...] | None = None,
        phases: Phases | None = None,
        migrated: Migrated | None = None,
        after: After | None = None,
        notes: tuple[str, ...] = (),
    ) -> ShiftEntry:
        """Fill in what became of an entry. A final outcome stamps `finished_at` with `at`
        (default: now). Each phase, the migrated counts, the rehearsal and `after` are written
        once; the outcome moves only from pending; `notes` are added after the entry's own
        (a line it has already is not added again). Returns the entry as now stored."""
        with Session(self.store.engine) as session, session.begin():
            row = session.get(ShiftLogRow, entry_id, with_for_update=True)
            if row is None:
                raise ShiftLogError(f"no shift log entry {entry_id}")
            old = _from_row(row)
            if outcome is not None and outcome != old.outcome:
                if outcome not in FINAL_OUTCOMES or outcome in FIXED_OUTCOMES.values():
                    raise ShiftLogError(
                        f"shift log entry {entry_id}: outcome {outcome!r} is not a final "
                        "outcome of a change (succeeded, failed, rolled_back, refused, aborted)"
                    )
                if old.outcome != "pending":
                    raise ShiftLogError(
                        f"shift log entry {entry_id}: outcome is already {old.outcome!r}, "
                        f"not {outcome!r}"
                    )
                row.outcome = outcome
                row.finished_at = at or datetime.now(UTC)
            row.error = _fill(entry_id, "error", old.error, error)
            if rehearsal is not None:
                checks = _fill(entry_id, "rehearsal", old.rehearsal or None, rehearsal)
                row.rehearsal_json = _dump([c.to_dict() for c in checks])
                row.rehearsal_passed = all(c.passed for c in checks) if checks else None
            if phases is not None:
                for phase in PHASES:
                    name = f"{phase}_s"
                    value = _fill(
                        entry_id, f"phase {phase}", getattr(old.phases, name), getattr(phases, name)
                    )
                    setattr(row, name, value)
            if migrated is not None:
                _set_migrated(row, _fill(entry_id, "migrated", old.migrated, migrated))
            if after is not None:
                _set_after(row, _fill(entry_id, "after", old.after, after))
            new_notes = [n for n in dict.fromkeys(notes) if n not in old.notes]
            if new_notes:
                row.notes_json = _dump([*old.notes, *new_notes])
            session.flush()
            return _from_row(row)

    def _query(
        self,
        since: datetime | None,
        until: datetime | None,
        kinds: Collection[str] | None,
        deployment: str | None = None,
    ) -> Select[ShiftLogRow]:
        query = select(ShiftLogRow)
        if deployment is not None:
            query = query.where(ShiftLogRow.deployment == deployment)
        if since is not None:
            query = query.where(ShiftLogRow.at >= since.astimezone(UTC))
        if until is not None:
            query = query.where(ShiftLogRow.at < until.astimezone(UTC))
        if kinds is not None:
            unknown = sorted(set(kinds) - set(KINDS))
            if unknown:
                raise ShiftLogError(
                    f"unknown shift log kind {', '.join(unknown)}: expected {', '.join(KINDS)}"
                )
            query = query.where(ShiftLogRow.kind.in_(list(kinds)))
        return query

    def _own(self, query: Select[ShiftLogRow]) -> Select[ShiftLogRow]:
        if self.deployment is None:
            return query
        return query.where(ShiftLogRow.deployment == self.deployment)

    def entries(
        self,
        since: datetime | None = None,
        until: datetime | None = None,
        kinds: Collection[str] | None = None,
        limit: int | None = None,
        deployment: str | None = None,
    ) -> list[ShiftEntry]:
        """Entries with since <= at < until of the given kinds, oldest first; with `limit`,
        the newest `limit` of them. `deployment`: only the entries it wrote (None: every
        deployment's, whatever this log writes as)."""
        query = self._query(since, until, kinds, deployment)
        if limit is not None:
            query = query.order_by(ShiftLogRow.at.desc(), ShiftLogRow.id.desc()).limit(limit)
        else:
            query = query.order_by(ShiftLogRow.at, ShiftLogRow.id)
        with Session(self.store.engine) as session:
            out = [_from_row(r) for r in session.scalars(query)]
        return out[::-1] if limit is not None else out

    def count(
        self,
        since: datetime | None = None,
        until: datetime | None = None,
        kinds: Collection[str] | None = None,
        deployment: str | None = None,
    ) -> int:
        sub = self._query(since, until, kinds, deployment).subquery()
        with Session(self.store.engine) as session:
            return int(session.scalar(select(func.count()).select_from(sub)) or 0)

    def newest_deployment(self) -> str | None:
        """The deployment that wrote the newest entry (the running one, or the last to run):
        what `flexpipe shifts` shows by default. None: an empty log, or written without one."""
        query = (
            select(ShiftLogRow.deployment)
            .order_by(ShiftLogRow.at.desc(), ShiftLogRow.id.desc())
            .limit(1)
        )
        with Session(self.store.engine) as session:
            return session.scalar(query)

    def pending(self) -> list[ShiftEntry]:
        """Changes not finished: after a controller restart, ones it must close (aborted)."""
        query = (
            self._own(select(ShiftLogRow))
            .where(ShiftLogRow.outcome == "pending")
            .order_by(ShiftLogRow.at, ShiftLogRow.id)
        )
        with Session(self.store.engine) as session:
            return [_from_row(r) for r in session.scalars(query)]

    def history(self, since: datetime | None = None) -> tuple[ShiftRecord, ...]:
        """The shift policy's history (cooldown, blacklist) rebuilt from the log, with times
        as Unix seconds: a restarted controller hands it back to the policy. A rolled-back
        or failed change counts as not succeeded; a refused one too, marked refused (no
        failure of its target: it does not count towards the blacklist)."""
        query = self._own(self._query(since, None, SHIFT_KINDS))
        with Session(self.store.engine) as session:
            rows = session.scalars(query.order_by(ShiftLogRow.at, ShiftLogRow.id))
            own = [_from_row(r) for r in rows]
        out = []
        for e in own:
            succeeded = None if e.outcome == "pending" else e.outcome == "succeeded"
            current = {i.key for i in e.current}
            added = tuple(i.key for i in e.target or () if i.key not in current)
            out.append(
                ShiftRecord(
                    started_s=e.at.timestamp(),
                    finished_s=None if e.finished_at is None else e.finished_at.timestamp(),
                    succeeded=succeeded,
                    target_keys=added,
                    refused=e.outcome == "refused",
                )
            )
        return tuple(out)
