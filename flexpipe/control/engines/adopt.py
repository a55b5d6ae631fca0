"""A restarted controller takes over the engines its predecessor left running (docs/controller.md,
"Crash safety"): the store's registry says which instances were live; the launcher says which of
them still run (`AdoptingLauncher.adopt`: a local process group alive, a Ray placement group whole
with its actor alive) and hands back a handle on each; those whose /health answers 200 are adopted
as they are — no duplicate launch —, the others are stopped and marked gone."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from flexpipe.http.client import ClientPool, Timeouts
from flexpipe.launch import EngineHandle
from flexpipe.launch.health import health_ok

__all__ = ["healthy"]


async def healthy(handles: Mapping[int, EngineHandle], timeout_s: float = 3.0) -> set[int]:
    """The ids (record ids) of the handles whose engine answers GET /health 200."""
    pool = ClientPool(max_idle_per_backend=1)
    timeouts = Timeouts(timeout_s, timeout_s, 1.0)
    try:
        flags = await asyncio.gather(
            *(health_ok(pool, h.endpoint, timeouts) for h in handles.values())
        )
    finally:
        await pool.close()
    return {i for i, good in zip(handles, flags, strict=True) if good}
