"""One live controller per deployment on a store: a lease row with its holder's pid, host and
heartbeat (docs/controller.md, "One store, several deployments").

Table `controller_leases`: one row per deployment. A controller takes the lease at start and
renews its heartbeat every few seconds while it runs; a second controller of the same
deployment is refused while the holder lives (`LeaseHeldError`, one line). A lease whose
holder is dead (its pid gone, on this host) or silent (no heartbeat for `stale_after_s`) is
stale and taken over: that is the restart after `kill -9`. Times are unix seconds (what two
processes share).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Float, Integer, String, delete
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, Session, mapped_column

from flexpipe.store.schema import Base
from flexpipe.store.store import Store, StoreError

__all__ = ["ControllerLeases", "Lease", "LeaseHeldError", "LeaseRow", "stale"]

STALE_AFTER_S = 60.0  # no heartbeat for this long: the holder is gone (another host, frozen)


class LeaseHeldError(StoreError):
    """Another live controller holds the deployment's lease."""


class LeaseRow(Base):
    __tablename__ = "controller_leases"

    deployment: Mapped[str] = mapped_column(String(300), primary_key=True)
    pid: Mapped[int] = mapped_column(Integer)
    host: Mapped[str] = mapped_column(String(255))
    started_at_s: Mapped[float] = mapped_column(Float)  # unix s
    heartbeat_at_s: Mapped[float] = mapped_column(Float)  # unix s


@dataclass(frozen=True, slots=True)
class Lease:
    deployment: str
    pid: int
    host: str
    started_at_s: float
    heartbeat_at_s: float

    def held_by(self, pid: int, host: str) -> bool:
        return self.pid == pid and self.host == host


def _lease(row: LeaseRow) -> Lease:
    return Lease(row.deployment, row.pid, row.host, row.started_at_s, row.heartbeat_at_s)


def stale(
    lease: Lease, now_s: float, host: str, alive: Callable[[int], bool], stale_after_s: float
) -> str | None:
    """Why `lease` no longer holds, seen from `host` at `now_s`; None while its holder lives.
    Pure: `alive(pid)` is the caller's probe (only asked for a holder on `host`)."""
    silent_s = now_s - lease.heartbeat_at_s
    if silent_s > stale_after_s:
        return f"no heartbeat for {silent_s:.0f} s"
    if lease.host == host and not alive(lease.pid):
        return f"pid {lease.pid} is gone"
    return None


class ControllerLeases:
    """The leases of a store (creates the table when opened)."""

    def __init__(self, store: Store, stale_after_s: float = STALE_AFTER_S) -> None:
        self.store = store
        self.stale_after_s = stale_after_s
        store.ensure_table(LeaseRow, "the controller leases")

    def get(self, deployment: str) -> Lease | None:
        with Session(self.store.engine) as session:
            row = session.get(LeaseRow, deployment)
            return None if row is None else _lease(row)

    def acquire(
        self, deployment: str, pid: int, host: str, now_s: float, alive: Callable[[int], bool]
    ) -> Lease | None:
        """Take the lease of `deployment` for (pid, host). Returns the stale lease it took over
        (None: there was none, or it was ours); LeaseHeldError while another holder lives."""
        try:
            return self._acquire(deployment, pid, host, now_s, alive)
        except IntegrityError:  # another controller inserted the row between our read and write
            return self._acquire(deployment, pid, host, now_s, alive)

    def _acquire(
        self, deployment: str, pid: int, host: str, now_s: float, alive: Callable[[int], bool]
    ) -> Lease | None:
        with Session(self.store.engine) as session, session.begin():
            row = session.get(LeaseRow, deployment, with_for_update=True)
            old = None if row is None else _lease(row)
            theirs = old is not None and not old.held_by(pid, host)
            if (
                old is not None
                and theirs
                and stale(old, now_s, host, alive, self.stale_after_s) is None
            ):
                where = "" if old.host == host else f" on {old.host}"
                silent_s = max(0.0, now_s - old.heartbeat_at_s)
                raise LeaseHeldError(
                    f"deployment {deployment!r} already has a live controller (pid "
                    f"{old.pid}{where}, heartbeat {silent_s:.0f} s ago) in store "
                    f"{self.store.display_url}; stop it first, or serve another gateway"
                )
            if row is None:
                session.add(
                    LeaseRow(
                        deployment=deployment,
                        pid=pid,
                        host=host,
                        started_at_s=now_s,
                        heartbeat_at_s=now_s,
                    )
                )
            else:
                row.pid, row.host, row.started_at_s, row.heartbeat_at_s = pid, host, now_s, now_s
            return old if theirs else None

    def renew(self, deployment: str, pid: int, host: str, now_s: float) -> Lease | None:
        """The heartbeat of a lease we hold; returns the holder when it is not us (taken over
        as stale) or None when renewed."""
        with Session(self.store.engine) as session, session.begin():
            row = session.get(LeaseRow, deployment, with_for_update=True)
            if row is None:
                session.add(
                    LeaseRow(
                        deployment=deployment,
                        pid=pid,
                        host=host,
                        started_at_s=now_s,
                        heartbeat_at_s=now_s,
                    )
                )
                return None
            if row.pid != pid or row.host != host:
                return _lease(row)
            row.heartbeat_at_s = now_s
            return None

    def release(self, deployment: str, pid: int, host: str) -> bool:
        """Give the lease back (only ours); True if it was ours."""
        with Session(self.store.engine) as session, session.begin():
            result = session.execute(
                delete(LeaseRow).where(
                    LeaseRow.deployment == deployment, LeaseRow.pid == pid, LeaseRow.host == host
                )
            )
            return bool(getattr(result, "rowcount", 0))
