"""Models with no instance (scaled to zero, or their instances lost): each tick, held in the
gateway so that their requests wait for the cold start their demand triggers, or refused
(a 503 with the reason) when no GPU free to us can place them (`placeable.unplaceable`);
and the demand trigger that wakes the controller when one of their requests queues.

A hold or a refusal lapses unless renewed (`standby_hold_s`), and the tick that renews them
waits while a shift is carried out: a shift longer than the hold (a large model's cold
start, a long drain) would let its models' requests get a 404 while their capacity comes.
So while a shift runs, its `Renewal` (the last tick's holds and refusals, and the holds the
shift makes itself) is renewed on its own cadence (`renewal`; the simulator's controller
renews the same on its virtual clock).

A part of the controller (flexpipe.control.controller), kept here so that its tick reads on
its own; it uses the controller's gateway client, cluster view, planner and shift log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flexpipe.control.api.gateway_client import GatewayError
from flexpipe.control.core.wait_notice import WaitNotice
from flexpipe.policies.shift import placeable

if TYPE_CHECKING:
    from flexpipe.control.controller import Controller

__all__ = ["Renewal", "StandbyModels", "renewal"]

log = logging.getLogger("flexpipe.controller")


@dataclass(frozen=True, slots=True)
class Renewal:
    """What a shift in progress keeps alive in the gateway: these holds and refusals, each
    for the hold's length again, every `every_s`."""

    held: tuple[str, ...]
    refused: tuple[tuple[str, str], ...]  # (model, why), as the last tick refused it
    every_s: float


def renewal(
    held: Iterable[str], refused: Mapping[str, str], tick_s: float, hold_s: float
) -> Renewal | None:
    """The renewal of `held` and `refused` while a shift runs (None: nothing to keep). A
    refused model is renewed refused, not held (a hold would lift its refusal). As often as
    a tick would renew them, and at least three times per hold: a renewal the gateway is
    slow to take still leaves a third of the hold."""
    refusals = tuple(sorted(refused.items()))
    holds = tuple(sorted(set(held) - set(refused)))
    if hold_s <= 0 or not (holds or refusals):
        return None
    return Renewal(holds, refusals, min(tick_s, hold_s / 3))


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

    def renewal(self, shift_holds: Iterable[str] = ()) -> Renewal | None:
        """What to keep alive while a shift runs: the last tick's holds and refusals, and
        `shift_holds`, the holds of `standby_hold_s` the shift makes itself (the first
        plan's models, a model it takes to zero)."""
        cfg = self.ctl.cfg
        return renewal(self.held | set(shift_holds), self.refused, cfg.tick_s, cfg.standby_hold_s)

    async def keep(self, kept: Renewal, over: asyncio.Event) -> None:
        """Renew `kept` every `every_s` until `over` is set (the shift ended): a
        renewal under way then finishes, so none reaches the gateway after what follows
        the shift (the first plan's release of its holds)."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(kept.every_s):
                    await over.wait()
            if over.is_set():
                return
            await self._renew(kept)

    async def _renew(self, kept: Renewal) -> None:
        gateway, hold_s = self.ctl.gateway, self.ctl.cfg.standby_hold_s
        for model, why in kept.refused:
            try:
                await gateway.refuse(model, why, hold_s)
            except GatewayError as exc:
                log.warning("refusal of %s: %s", model, exc)
        for model in kept.held:
            try:
                await gateway.hold(model, hold_s)
            except GatewayError as exc:
                log.warning("hold of %s: %s", model, exc)

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
