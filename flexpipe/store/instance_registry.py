"""Instances in the store, one lifecycle each (flexpipe/lifecycle.py), so that a
controller that crashed can adopt the engines still running.

The controller registers an instance *before* it launches the engine (so nothing runs that the
store does not know), records the pid and process group right after the spawn, and moves it
through starting → rehearsing → active → draining → gone; each move is checked against the
lifecycle and kept, with its time and reason, in `instance_transitions`. After a restart,
`live_instances()` lists what may still run; the controller probes each (pid alive, endpoint
healthy) and `reconcile` marks the ones it could not reach as gone, with the reason.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import DateTime, ForeignKey, Integer, String, Text, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from flexpipe.lifecycle import LIVE_STATES, LifecycleError, State, check_transition
from flexpipe.store.schema import Base, InstanceRow
from flexpipe.store.store import Store, StoreError

__all__ = ["InstanceRecord", "InstanceRegistry", "Transition", "TransitionRow"]


class TransitionRow(Base):
    __tablename__ = "instance_transitions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    instance_id: Mapped[int] = mapped_column(ForeignKey("instances.id"), index=True)
    from_state: Mapped[str | None] = mapped_column(String(20), nullable=True)  # None: registered
    to_state: Mapped[str] = mapped_column(String(20))
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)


@dataclass(frozen=True, slots=True)
class Transition:
    instance_id: int
    from_state: State | None
    to_state: State
    at: datetime
    reason: str | None


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    id: int
    name: str
    model: str
    gear: str
    gpu_ids: tuple[str, ...]
    endpoint: str
    engine: str
    state: State
    started_at: datetime  # registered
    state_at: datetime  # entered `state`
    stopped_at: datetime | None  # gone
    pid: int | None
    pgid: int | None
    plan_id: int | None  # the shift log entry whose target plan it serves
    cold_start_s: float | None
    gone_reason: str | None

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES


def _utc(at: datetime) -> datetime:
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


def _record(row: InstanceRow) -> InstanceRecord:
    started = _utc(row.started_at)
    return InstanceRecord(
        id=row.id,
        name=row.name,
        model=row.model,
        gear=row.gear,
        gpu_ids=tuple(g for g in row.gpu_ids.split(",") if g),
        endpoint=row.endpoint,
        engine=row.engine,
        state=State(row.state),
        started_at=started,
        state_at=started if row.state_at is None else _utc(row.state_at),
        stopped_at=None if row.stopped_at is None else _utc(row.stopped_at),
        pid=row.pid,
        pgid=row.pgid,
        plan_id=row.plan_id,
        cold_start_s=row.cold_start_s,
        gone_reason=row.gone_reason,
    )


class InstanceRegistry:
    """The `instances` table under the lifecycle (creates its history table when opened)."""

    def __init__(self, store: Store, deployment: str | None = None) -> None:
        self.store = store
        self.deployment = deployment
        store.ensure_table(TransitionRow, "the instance registry")

    def register(
        self,
        name: str,
        model: str,
        gear: str,
        gpu_ids: Sequence[str],
        endpoint: str,
        engine: str,
        *,
        plan_id: int | None = None,
        at: datetime | None = None,
        pid: int | None = None,
        pgid: int | None = None,
    ) -> InstanceRecord:
        """A new instance in state starting (call before launching its engine; or after, with
        its process in the same write: a controller killed in between leaves no row without
        the process a successor must stop)."""
        at = _utc(at or datetime.now(UTC))
        with Session(self.store.engine) as session, session.begin():
            row = InstanceRow(
                name=name,
                model=model,
                gear=gear,
                gpu_ids=",".join(gpu_ids),
                endpoint=endpoint,
                engine=engine,
                state=State.STARTING.value,
                started_at=at,
                state_at=at,
                plan_id=plan_id,
                deployment=self.deployment,
                pid=pid,
                pgid=pgid,
            )
            session.add(row)
            session.flush()
            session.add(
                TransitionRow(instance_id=row.id, from_state=None, to_state=row.state, at=at)
            )
            return _record(row)

    def _row(self, session: Session, instance_id: int) -> InstanceRow:
        row = session.get(InstanceRow, instance_id, with_for_update=True)
        if row is None:
            raise StoreError(f"no instance {instance_id}")
        return row

    def set_process(
        self,
        instance_id: int,
        pid: int | None,
        pgid: int | None,
        endpoint: str | None = None,
        cold_start_s: float | None = None,
    ) -> InstanceRecord:
        """Record the engine's process (and the endpoint or cold start once known)."""
        with Session(self.store.engine) as session, session.begin():
            row = self._row(session, instance_id)
            row.pid, row.pgid = pid, pgid
            if endpoint is not None:
                row.endpoint = endpoint
            if cold_start_s is not None:
                row.cold_start_s = cold_start_s
            return _record(row)

    def transition(
        self,
        instance_id: int,
        state: State | str,
        *,
        reason: str | None = None,
        at: datetime | None = None,
    ) -> InstanceRecord:
        """Move an instance to `state`; LifecycleError (naming the instance) if illegal."""
        at = _utc(at or datetime.now(UTC))
        with Session(self.store.engine) as session, session.begin():
            row = self._row(session, instance_id)
            try:
                to = check_transition(row.state, state)
            except LifecycleError as exc:
                raise LifecycleError(f"instance {row.id} ({row.name}): {exc}") from None
            session.add(
                TransitionRow(
                    instance_id=row.id,
                    from_state=row.state,
                    to_state=to.value,
                    at=at,
                    reason=reason,
                )
            )
            row.state, row.state_at = to.value, at
            if to is State.GONE:
                row.stopped_at, row.gone_reason = at, reason
            return _record(row)

    def mark_gone(
        self, instance_id: int, reason: str, at: datetime | None = None
    ) -> InstanceRecord:
        return self.transition(instance_id, State.GONE, reason=reason, at=at)

    def get(self, instance_id: int) -> InstanceRecord:
        with Session(self.store.engine) as session:
            row = session.get(InstanceRow, instance_id)
            if row is None:
                raise StoreError(f"no instance {instance_id}")
            return _record(row)

    def instances(
        self, states: Collection[State] | None = None, model: str | None = None
    ) -> list[InstanceRecord]:
        query = select(InstanceRow).order_by(InstanceRow.id)
        if states is not None:
            query = query.where(InstanceRow.state.in_([State(s).value for s in states]))
        if model is not None:
            query = query.where(InstanceRow.model == model)
        if self.deployment is not None:
            query = query.where(InstanceRow.deployment == self.deployment)
        with Session(self.store.engine) as session:
            return [_record(r) for r in session.scalars(query)]

    def live_instances(self, model: str | None = None) -> list[InstanceRecord]:
        """Instances not gone (of this registry's deployment, when it has one): what a
        restarted controller may adopt."""
        return self.instances(LIVE_STATES, model)

    def history(self, instance_id: int) -> list[Transition]:
        query = (
            select(TransitionRow)
            .where(TransitionRow.instance_id == instance_id)
            .order_by(TransitionRow.id)
        )
        with Session(self.store.engine) as session:
            return [
                Transition(
                    instance_id=r.instance_id,
                    from_state=None if r.from_state is None else State(r.from_state),
                    to_state=State(r.to_state),
                    at=_utc(r.at),
                    reason=r.reason,
                )
                for r in session.scalars(query)
            ]

    def reconcile(
        self, reachable: Collection[int], reason: str, at: datetime | None = None
    ) -> tuple[list[InstanceRecord], list[InstanceRecord]]:
        """After a restart: the live instances the controller reached are adopted as they
        are; every other live one is marked gone with `reason`. Returns (adopted, gone)."""
        adopted, gone = [], []
        for rec in self.live_instances():
            if rec.id in reachable:
                adopted.append(rec)
            else:
                gone.append(self.mark_gone(rec.id, reason, at))
        return adopted, gone
