"""A restarted controller takes over the engines its predecessor left running (issue 9 §7):
the store's registry says which instances were live; each one whose process group is alive
and whose /health answers 200 is adopted as it is — no duplicate launch —, the others are
marked gone (and whatever is left of their process groups is stopped)."""

from __future__ import annotations

import asyncio
import signal

from flexpipe.http.client import ClientPool, Timeouts
from flexpipe.launch.base import HandleBase
from flexpipe.launch.health import health_ok
from flexpipe.launch.process import group_alive, signal_group
from flexpipe.store.instance_registry import InstanceRecord

__all__ = ["AdoptedEngine", "reachable"]


class AdoptedEngine(HandleBase):
    """An engine another controller started (implements EngineHandle): known by its
    endpoint and process group, stopped by signalling the group."""

    def __init__(self, record: InstanceRecord, stop_grace_s: float = 10.0) -> None:
        super().__init__(record.name, record.endpoint, record.cold_start_s or 0.0)
        self.pgid = record.pgid or record.pid or 0
        self.stop_grace_s = stop_grace_s

    @property
    def pid(self) -> int:
        return self.pgid

    @property
    def returncode(self) -> int | None:
        """None while any process of its group lives (the exit status is not ours to see)."""
        return None if group_alive(self.pgid) else -1

    async def _stop(self) -> None:
        signal_group(self.pgid, signal.SIGTERM)
        for _ in range(int(self.stop_grace_s / 0.05)):
            if not group_alive(self.pgid):
                return
            await asyncio.sleep(0.05)
        signal_group(self.pgid, signal.SIGKILL)


async def reachable(records: list[InstanceRecord], timeout_s: float = 3.0) -> set[int]:
    """The ids of the records whose process group lives and whose engine is healthy."""
    pool = ClientPool(max_idle_per_backend=1)

    async def ok(rec: InstanceRecord) -> bool:
        if not group_alive(rec.pgid or rec.pid or 0):
            return False
        return await health_ok(pool, rec.endpoint, Timeouts(timeout_s, timeout_s, 1.0))

    try:
        flags = await asyncio.gather(*(ok(r) for r in records))
    finally:
        await pool.close()
    return {r.id for r, good in zip(records, flags, strict=True) if good}


def stop_group(record: InstanceRecord) -> None:
    """What is left of a gone instance's processes."""
    signal_group(record.pgid or 0, signal.SIGKILL)
