"""The controller's measured arrival rates, kept in the store and read back when it starts, so
the rate forecast ("the same time yesterday", policies/shift/forecast.py) survives a restart:
without it, a controller restarted at 08:55 forecasts nothing from yesterday's 09:00 peak for
a whole day.

One sample per model every `every_s` wall seconds (the rates are one-minute means: a sample a
minute loses little), samples older than the forecast reads (`keep_s`) pruned once an hour.
Times go into the store as UTC epoch seconds and come back in the new process's own clock
(`now_s - (wall_s - at_s)`). A store that fails is logged and skipped: the controller serves
on without the memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from sqlalchemy.exc import SQLAlchemyError

from flexpipe.control.core.observe import RateWindow
from flexpipe.store import Store
from flexpipe.store.rate_history import RateHistory

__all__ = ["KEEP_EVERY_S", "RateMemory"]

log = logging.getLogger("flexpipe.controller")

KEEP_EVERY_S = 60.0
PRUNE_EVERY_S = 3600.0


class RateMemory:
    def __init__(self, history: RateHistory, keep_s: float, every_s: float = KEEP_EVERY_S) -> None:
        self.history = history
        self.keep_s = keep_s
        self.every_s = every_s
        self._kept_wall_s = -float("inf")  # the last sample written
        self._pruned_wall_s = -float("inf")

    @classmethod
    def of(cls, store: Store | None, keep_s: float) -> RateMemory | None:
        """The memory of `store`; None without a store or a forecast that reads no history."""
        if store is None or keep_s <= 0:
            return None
        return cls(RateHistory(store), keep_s)

    def restore(
        self,
        rates: RateWindow,
        models: Collection[str],
        now_s: float,
        wall_s: float,
        say: Callable[[str], None] | None = None,
    ) -> int:
        """Put the samples of the last `keep_s` into `rates` (in the clock of `now_s`, read at
        wall time `wall_s`); returns how many (and says so, when any)."""
        try:
            kept = self.history.since(models, wall_s - self.keep_s)
        except SQLAlchemyError as exc:
            log.warning("rate history not read (the forecast starts from nothing): %s", exc)
            return 0
        offset_s = now_s - wall_s
        num = sum(
            rates.restore(name, [(at_s + offset_s, r) for at_s, r in samples])
            for name, samples in kept.items()
        )
        if num and say is not None:
            oldest_s = min(samples[0][0] for samples in kept.values())
            say(
                f"forecast: {num} rate sample(s) of the last {(wall_s - oldest_s) / 3600:.1f} h "
                "read back from the store"
            )
        return num

    def keep(self, rates: RateWindow, now_s: float, wall_s: float) -> int:
        """Write the rate each model measured at `now_s` (wall time `wall_s`), at most once
        every `every_s`; returns how many."""
        if self.keep_s <= 0 or wall_s - self._kept_wall_s < self.every_s:
            return 0
        measured = sorted((m, s[-1][1]) for m, s in rates.series.items() if s and s[-1][0] == now_s)
        if not measured:
            return 0
        self._kept_wall_s = wall_s
        try:
            num = self.history.append((m, wall_s, r) for m, r in measured)
            if wall_s - self._pruned_wall_s >= PRUNE_EVERY_S:
                self._pruned_wall_s = wall_s
                self.history.prune(wall_s - self.keep_s)
        except SQLAlchemyError as exc:
            log.warning("rate history not written: %s", exc)
            return 0
        return num
