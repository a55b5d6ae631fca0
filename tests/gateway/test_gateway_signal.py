"""The gateway's long-poll wake-up (flexpipe/gateway/signal.py), on a real event loop."""

from __future__ import annotations

import asyncio
import time

from flexpipe.gateway.signal import Signal


def test_a_waiter_answers_when_notified_and_its_check_holds_else_at_its_timeout() -> None:
    async def scenario() -> tuple[int, float, int, float]:
        signal = Signal(time.monotonic)
        signal.notify()  # nobody waits: nothing happens
        items: list[int] = []
        waiter = asyncio.create_task(signal.wait_for(lambda: len(items), 5.0))
        await asyncio.sleep(0.05)
        signal.notify()  # woken, its check still 0: waits on
        await asyncio.sleep(0.05)
        assert not waiter.done()
        t0 = time.monotonic()
        items.append(1)
        signal.notify()
        got = await waiter
        answered_s = time.monotonic() - t0
        t1 = time.monotonic()
        empty = await signal.wait_for(lambda: 0, 0.2)  # never holds: its last value at 0.2 s
        return got, answered_s, empty, time.monotonic() - t1

    got, answered_s, empty, timed_out_s = asyncio.run(scenario())
    assert got == 1 and answered_s < 0.5
    assert empty == 0 and 0.2 <= timed_out_s < 1.0
