"""The demand trigger's long poll (`POST /admin/models/demand`): the controller asks which of
the models it scaled to zero have requests queued, and the answer comes as soon as one
queues (woken by the queueing, not a poll) or when its wait is over."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection

__all__ = ["DemandSignal"]


class DemandSignal:
    def __init__(self, num_queued: Callable[[str], int], clock: Callable[[], float]) -> None:
        self.num_queued = num_queued  # a model's requests in the wait queue
        self.clock = clock
        self._waiters: list[asyncio.Future[None]] = []

    def changed(self) -> None:
        """A request queued: every poll looks again."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait(self, models: Collection[str], timeout_s: float) -> dict[str, int]:
        """Requests queued for `models`, once there is at least one or `timeout_s` passed."""
        deadline = self.clock() + timeout_s
        while True:
            queued = {m: n for m in models if (n := self.num_queued(m))}
            left = deadline - self.clock()
            if queued or left <= 0:
                return queued
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await fut
