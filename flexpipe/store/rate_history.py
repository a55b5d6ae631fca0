"""Each model's measured arrival rate over time, in the store: the rate forecast's input
(policies/shift/forecast.py reads "the same time yesterday"), kept so that a restarted
controller forecasts from the day it had, not from nothing.

Table `rate_samples`: one row per model and sample, the time as UTC epoch seconds (a
controller's own clock is monotonic and starts again with each process; the wall clock is
what two processes share). The controller writes one sample a minute per model and prunes
what is older than the forecast reads (`ForecastParams.keep_s`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from sqlalchemy import Float, Index, Integer, String, delete, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from flexpipe.store.schema import Base
from flexpipe.store.store import Store

__all__ = ["RateHistory", "RateSampleRow"]


class RateSampleRow(Base):
    __tablename__ = "rate_samples"
    __table_args__ = (Index("ix_rate_samples_model_at", "model", "at_s"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(200))
    at_s: Mapped[float] = mapped_column(Float)  # UTC epoch seconds
    rate_per_s: Mapped[float] = mapped_column(Float)  # arrivals per (modelled) second


class RateHistory:
    """The rate samples of a store (creates the table when opened)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        store.ensure_table(RateSampleRow, "the rate history")

    def append(self, samples: Iterable[tuple[str, float, float]]) -> int:
        """Write (model, UTC epoch s, rate per s) samples; returns how many."""
        rows = [RateSampleRow(model=m, at_s=at_s, rate_per_s=r) for m, at_s, r in samples]
        if rows:
            with Session(self.store.engine) as session, session.begin():
                session.add_all(rows)
        return len(rows)

    def since(
        self, models: Collection[str], since_s: float
    ) -> dict[str, list[tuple[float, float]]]:
        """Each of `models`' samples at or after `since_s` (UTC epoch s), oldest first, as
        (UTC epoch s, rate per s)."""
        out: dict[str, list[tuple[float, float]]] = {}
        if not models:
            return out
        query = (
            select(RateSampleRow.model, RateSampleRow.at_s, RateSampleRow.rate_per_s)
            .where(RateSampleRow.model.in_(list(models)), RateSampleRow.at_s >= since_s)
            .order_by(RateSampleRow.model, RateSampleRow.at_s, RateSampleRow.id)
        )
        with Session(self.store.engine) as session:
            for model, at_s, rate in session.execute(query):
                out.setdefault(model, []).append((at_s, rate))
        return out

    def prune(self, before_s: float) -> int:
        """Drop the samples older than `before_s` (UTC epoch s); returns how many."""
        with Session(self.store.engine) as session, session.begin():
            result = session.execute(delete(RateSampleRow).where(RateSampleRow.at_s < before_s))
            return int(getattr(result, "rowcount", 0) or 0)
