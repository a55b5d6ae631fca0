"""The live controller's word to the gateway about models with no instance: the holds and
refusals the tick's core decides (control/core/standby.py) sent over HTTP, their renewal
while a shift runs, and the demand trigger that wakes the controller when one of their
requests queues. The simulator's controller sends the same commands to its gateway on the
virtual clock (sim/controller.py).

Given what it needs, not the controller: the gateway client, the core's standby state, the
models with no instance now, the tick's and the hold's length, and where to say and note.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Sequence

from flexpipe.control.api.gateway_client import GatewayAdmin, GatewayError
from flexpipe.control.core.standby import (
    RefusalChange,
    Renewal,
    StandbyCommand,
    StandbyState,
    renewal,
)
from flexpipe.control.core.wait_notice import WaitNotice

__all__ = ["Renewal", "StandbyModels", "renewal"]

log = logging.getLogger("flexpipe.controller")

Note = Callable[[str, str, Sequence[str]], None]  # (kind, reason, notes): the shift log


class StandbyModels:
    def __init__(
        self,
        gateway: GatewayAdmin,
        state: StandbyState,
        models: Callable[[], list[str]],
        tick_s: float,
        hold_s: float,
        say: Callable[[str], None],
        note: Note,
    ) -> None:
        """`models`: the models with no instance running now (scaled to zero); `hold_s`:
        how long a hold or refusal lasts unless renewed."""
        self.gateway = gateway
        self.state = state
        self.models = models
        self.tick_s = tick_s
        self.hold_s = hold_s
        self.say = say
        self.note = note
        self._waits = WaitNotice()  # said once: requests wait for a model with no instance

    @property
    def held(self) -> set[str]:
        return self.state.held

    @property
    def refused(self) -> dict[str, str]:
        """Models no GPU free to us can place -> the planner's reason (a 503 with it)."""
        return self.state.refused

    async def carry_out(self, commands: Sequence[StandbyCommand], serving: Collection[str]) -> None:
        """A tick's holds and refusals (`TickCore.standby`); `serving`: the models with an
        instance. One the gateway did not take is not settled: the next tick sends it again."""
        for line in self._waits.serving(serving):
            self.say(line)
        for cmd in commands:
            try:
                await self._send(cmd)
            except GatewayError as exc:
                log.warning("hold of %s: %s", cmd.model, exc)
                continue
            change = self.state.settle(cmd)
            if change is not None:
                self._said(change)

    async def _send(self, cmd: StandbyCommand) -> None:
        if cmd.why is not None:
            await self.gateway.refuse(cmd.model, cmd.why, cmd.seconds)
        else:
            await self.gateway.hold(cmd.model, cmd.seconds)

    async def keep(self, kept: Renewal, over: asyncio.Event) -> None:
        """Renew `kept` every `every_s` until `over` is set (the shift ended): a
        renewal under way then finishes, so none reaches the gateway after what follows
        the shift (the first plan's release of its holds). The simulator's controller
        renews on events of its virtual clock instead."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(kept.every_s):
                    await over.wait()
            if over.is_set():
                return
            for cmd in kept.commands(self.hold_s):
                try:
                    await self._send(cmd)
                except GatewayError as exc:
                    what = "hold" if cmd.why is None else "refusal"
                    log.warning("%s of %s: %s", what, cmd.model, exc)

    def _said(self, change: RefusalChange) -> None:
        """Said once and logged when a model starts or stops being refused."""
        model = change.model
        if change.why is not None:
            self.say(f"controller: {model} is refused (503), not held: {change.why}")
            self.note("resources", f"{model} refused, not held: {change.why}", [change.why])
            return
        again = "held again for a cold start" if change.standby else "serves again"
        self.say(f"controller: {model} can be placed again; {again}")
        self.note("resources", f"{model} can be placed again; {again} (was: {change.was})", [])

    async def watch_demand(self, changed: asyncio.Event) -> None:
        """The demand trigger of models scaled to zero: the gateway answers as soon as one
        of their requests queues (an event, not a poll); `changed` makes the controller tick
        at once."""
        while True:
            models = self.models()
            if not models:
                await asyncio.sleep(min(1.0, self.tick_s))
                continue
            try:
                queued = await self.gateway.demand(models, max(self.tick_s, 5.0))
            except GatewayError as exc:
                log.warning("demand of %s: %s", ", ".join(models), exc)
                await asyncio.sleep(self.tick_s)
                continue
            for line in self._waits.queued(models, queued):
                self.say(line)
            if any(n > 0 for n in queued.values()):
                changed.set()
                await asyncio.sleep(self.tick_s)  # the wake shift takes it from here
