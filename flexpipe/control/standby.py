"""Models with no instance (scaled to zero, or their instances lost): each tick, held in the
gateway so that their requests wait for the cold start their demand triggers, or refused
(a 503 with the reason) when no GPU free to us can place them (`placeable.unplaceable`);
and the demand trigger that wakes the controller when one of their requests queues.

A part of the controller (flexpipe.control.controller), kept here so that its tick reads on
its own; it uses the controller's gateway client, cluster view, planner and shift log.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from flexpipe.control.gateway_client import GatewayError
from flexpipe.control.wait_notice import WaitNotice
from flexpipe.policies.shift import placeable

if TYPE_CHECKING:
    from flexpipe.control.controller import Controller

__all__ = ["StandbyModels"]

log = logging.getLogger("flexpipe.controller")


class StandbyModels:
    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.held: set[str] = set()  # models held in the gateway with no instance
        # models with no instance that no GPU free to us can place -> the planner's reason:
        # refused in the gateway (a 503 with it) instead of held, re-checked every tick
        self.refused: dict[str, str] = {}
        self._waits = WaitNotice()  # said once: requests wait for a model with no instance

    def models(self) -> list[str]:
        """Models with no instance running (scaled to zero)."""
        ctl = self.ctl
        serving = {i.planned.model for i in ctl.running.values()}
        return [d.name for d in ctl.cfg.demands if d.name not in serving]

    async def hold_or_refuse(self) -> None:
        """A model scaled to zero stays held in the gateway (its requests queue for the
        instance its demand will start); one that serves again is released. One that no GPU
        free to us can place is refused instead (`placeable.unplaceable`: not while a GPU is
        due back within the hold), until it can be again."""
        ctl = self.ctl
        standby = set(self.models())
        for line in self._waits.serving({d.name for d in ctl.cfg.demands} - standby):
            ctl.say(line)
        next_change_s = ctl.resources.next_change_s()
        hold_s = ctl.cfg.standby_hold_s
        unplaceable = placeable.unplaceable(
            ctl.cluster, ctl.cfg.demands, standby, ctl.clock(), ctl.planner,
            ctl.policy.params.wake_request_rate_per_s,
            None if next_change_s is None else next_change_s - ctl.wall(),
            hold_s,
        )  # fmt: skip
        for model in sorted(standby | self.held | set(self.refused)):
            why = unplaceable.get(model)
            try:
                if why is not None:
                    await ctl.gateway.refuse(model, why, hold_s)
                else:
                    await ctl.gateway.hold(model, hold_s if model in standby else 0)
            except GatewayError as exc:
                log.warning("hold of %s: %s", model, exc)
                continue
            if model in standby:
                self.held.add(model)
            else:
                self.held.discard(model)
            self._refusal(model, why, model in standby)

    def _refusal(self, model: str, why: str | None, standby: bool) -> None:
        """Said once and logged when a model starts or stops being refused."""
        ctl = self.ctl
        was = self.refused.get(model)
        if why is not None:
            self.refused[model] = why
            if was is None:
                ctl.say(f"controller: {model} is refused (503), not held: {why}")
                ctl.note("resources", f"{model} refused, not held: {why}", [why])
            return
        if was is None:
            return
        del self.refused[model]
        again = "held again for a cold start" if standby else "serves again"
        ctl.say(f"controller: {model} can be placed again; {again}")
        ctl.note("resources", f"{model} can be placed again; {again} (was: {was})")

    async def watch_demand(self, changed: asyncio.Event) -> None:
        """The demand trigger of models scaled to zero: the gateway answers as soon as one
        of their requests queues (an event, not a poll); `changed` makes the controller tick
        at once."""
        ctl = self.ctl
        while True:
            models = self.models()
            if not models:
                await asyncio.sleep(min(1.0, ctl.cfg.tick_s))
                continue
            try:
                queued = await ctl.gateway.demand(models, max(ctl.cfg.tick_s, 5.0))
            except GatewayError as exc:
                log.warning("demand of %s: %s", ", ".join(models), exc)
                await asyncio.sleep(ctl.cfg.tick_s)
                continue
            for line in self._waits.queued(models, queued):
                ctl.say(line)
            if any(n > 0 for n in queued.values()):
                changed.set()
                await asyncio.sleep(ctl.cfg.tick_s)  # the wake shift takes it from here
