"""An engine is ready when GET /health answers 200: the one probe every launcher (and the
adoption of a predecessor's engines) asks, and the wait for a starting engine."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from flexpipe.http.client import ClientPool, Timeouts, UpstreamError
from flexpipe.launch.base import EngineExited, EngineHandle, EngineNotReady

__all__ = ["StartingEngine", "health_ok", "wait_ready"]

PROBE_TIMEOUTS = Timeouts(connect_s=1.0, ttfb_s=2.0, idle_s=2.0)


async def health_ok(pool: ClientPool, endpoint: str, timeouts: Timeouts = PROBE_TIMEOUTS) -> bool:
    """One GET /health: True when it answers 200, False otherwise or when unreachable."""
    try:
        resp = await pool.request(endpoint, "GET", "/health", timeouts=timeouts)
        await resp.read()
        resp.release()
    except (UpstreamError, OSError):
        return False
    return resp.status == 200


class StartingEngine(EngineHandle, Protocol):
    """A handle a launcher waits on: it says, in its launcher's words, how it went."""

    async def exited_message(self) -> str:
        """Why it is no more (the EngineExited message, with its last log lines)."""
        ...

    async def log_lines(self) -> str:
        """`; last log lines...:` and the lines, or "" when there are none."""
        ...


async def wait_ready(handle: StartingEngine, timeout_s: float, poll_s: float = 0.1) -> None:
    """Poll GET /health until 200; if the engine exits or time runs out, stop it and raise
    (EngineExited, EngineNotReady)."""
    pool = ClientPool()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if handle.returncode is not None:
                raise EngineExited(await handle.exited_message(), handle.returncode)
            if await health_ok(pool, handle.endpoint):
                return
            if time.monotonic() >= deadline:
                raise EngineNotReady(
                    f"engine {handle.name} did not become ready (GET /health 200) within "
                    f"{timeout_s:g} s; stopped it" + await handle.log_lines()
                )
            await asyncio.sleep(poll_s)
    except BaseException:
        await handle.stop()
        raise
    finally:
        await pool.close()
