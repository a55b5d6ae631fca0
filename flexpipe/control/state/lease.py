"""The controller's lease on its deployment in the store (store/controller_lease.py): taken at
start, its heartbeat renewed every `every_s` while the controller lives (a task of its own,
so a long cold start or shift does not let it go stale), given back at close.

A second controller of the same deployment is refused at start with one line; a stale lease
(its holder's pid gone, or no heartbeat for a minute) is taken over and said. If another
controller took ours over (we were frozen past the heartbeat), that is said once; this
controller does not fight for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError

from flexpipe.launch.process import pid_alive
from flexpipe.store import Store
from flexpipe.store.controller_lease import ControllerLeases, LeaseHeldError

__all__ = ["HEARTBEAT_EVERY_S", "Lease", "pid_alive"]

log = logging.getLogger("flexpipe.controller")

HEARTBEAT_EVERY_S = 5.0


class Lease:
    def __init__(
        self,
        leases: ControllerLeases,
        deployment: str,
        say: Callable[[str], None],
        every_s: float = HEARTBEAT_EVERY_S,
    ) -> None:
        self.leases = leases
        self.deployment = deployment
        self.say = say
        self.every_s = every_s
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self._task: asyncio.Task[None] | None = None
        self._lost = False

    @classmethod
    def of(cls, store: Store | None, deployment: str, say: Callable[[str], None]) -> Lease | None:
        return None if store is None else cls(ControllerLeases(store), deployment, say)

    def acquire(self, wall: Callable[[], float]) -> None:
        """Take the lease and start the heartbeat; RuntimeError (one line) while another
        controller of the deployment lives."""
        try:
            old = self.leases.acquire(self.deployment, self.pid, self.host, wall(), pid_alive)
        except LeaseHeldError as exc:
            raise RuntimeError(str(exc)) from None
        if old is not None:
            self.say(
                f"controller: took over deployment {self.deployment} from pid {old.pid} "
                f"(last heartbeat {max(0.0, wall() - old.heartbeat_at_s):.0f} s ago)"
            )
        self._task = asyncio.ensure_future(self._beat(wall))

    async def _beat(self, wall: Callable[[], float]) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                holder = self.leases.renew(self.deployment, self.pid, self.host, wall())
            except SQLAlchemyError as exc:
                log.warning("controller lease not renewed: %s", exc)
                continue
            if holder is not None and not self._lost:
                self._lost = True
                self.say(
                    f"error: deployment {self.deployment}: another controller (pid "
                    f"{holder.pid} on {holder.host}) took the lease over"
                )

    async def release(self) -> None:
        if self._task is None:
            return  # never taken: nothing of ours to give back
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        try:
            self.leases.release(self.deployment, self.pid, self.host)
        except SQLAlchemyError as exc:
            log.warning("controller lease not released: %s", exc)
