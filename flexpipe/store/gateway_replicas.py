"""Which gateway replicas each deployment serves, kept in the store so that a controller
restarted with a replica more or fewer keeps its deployment id — its engines, shift log,
occupations and lease (docs/controller.md, "Several gateways"; the choice is
`control/core/gateway_sync.choose_deployment`).

Table `gateway_replicas`: one row per deployment and replica URL, rewritten whole when a
controller starts.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from sqlalchemy import String, delete, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from flexpipe.store.controller_lease import LeaseRow
from flexpipe.store.schema import Base, InstanceRow
from flexpipe.store.store import Store

__all__ = ["GatewayReplicaRow", "GatewayReplicas"]


class GatewayReplicaRow(Base):
    __tablename__ = "gateway_replicas"

    deployment: Mapped[str] = mapped_column(String(300), primary_key=True)
    url: Mapped[str] = mapped_column(String(300), primary_key=True)


class GatewayReplicas:
    """The replicas of each deployment in a store (creates the table when opened)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        store.ensure_table(GatewayReplicaRow, "the gateway replicas")
        store.ensure_table(LeaseRow, "the controller leases")

    def fleets(self) -> dict[str, frozenset[str]]:
        """Deployment -> the replica URLs last recorded for it."""
        out: dict[str, set[str]] = {}
        with Session(self.store.engine) as session:
            for row in session.scalars(select(GatewayReplicaRow)):
                out.setdefault(row.deployment, set()).add(row.url)
        return {d: frozenset(urls) for d, urls in out.items()}

    def known(self, ids: Collection[str]) -> set[str]:
        """Which of `ids` are deployments of the store already (instances or a lease)."""
        wanted = list(ids)
        if not wanted:
            return set()
        with Session(self.store.engine) as session:
            found = set(
                session.scalars(
                    select(InstanceRow.deployment).where(InstanceRow.deployment.in_(wanted))
                )
            )
            found |= set(
                session.scalars(select(LeaseRow.deployment).where(LeaseRow.deployment.in_(wanted)))
            )
        return {d for d in found if d is not None}

    def save(self, deployment: str, urls: Iterable[str]) -> None:
        """Record `urls` as the replicas of `deployment` (in place of the last ones)."""
        with Session(self.store.engine) as session, session.begin():
            session.execute(
                delete(GatewayReplicaRow).where(GatewayReplicaRow.deployment == deployment)
            )
            for url in sorted(set(urls)):
                session.add(GatewayReplicaRow(deployment=deployment, url=url))
