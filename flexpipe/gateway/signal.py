"""A long poll's wake-up: callers wait until a check of theirs holds, woken each time
something that may change it happens, never polling.

The gateway keeps two: a request ended (`Gateway.drained`: the executor waits for an instance
to serve nothing) and a request queued (`Gateway.demand`: the controller's demand trigger for
a model scaled to zero)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TypeVar

__all__ = ["Signal"]

T = TypeVar("T")


class Signal:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._waiters: list[asyncio.Future[None]] = []

    def notify(self) -> None:
        """Something changed: every waiter checks again."""
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_for(self, check: Callable[[], T], timeout_s: float) -> T:
        """`check()`'s value once it is truthy, or its last value when `timeout_s` passed."""
        deadline = self.clock() + timeout_s
        while True:
            value = check()
            left = deadline - self.clock()
            if value or left <= 0:
                return value
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await fut
