"""Models with no instance, decided (pure): which to hold in the gateway, which to refuse, and
what a shift in progress keeps alive. The live controller (control/standby.py) sends these
commands over HTTP, the simulator's (sim/controller.py) to its gateway on the virtual clock.

A model with no instance (scaled to zero, or its instances lost) is held so that its requests
queue for the cold start their demand triggers; one that no GPU free to us can place is
refused instead (a 503 with the planner's reason, `placeable.unplaceable`), until it can be
placed again; one that serves again is released (a hold of 0 s).

A hold or a refusal lapses unless renewed (`hold_s`): every tick renews them, and the tick
waits while a shift is carried out, so a shift longer than the hold (a large model's cold
start, a long drain) would let its models' requests get a 404 while their capacity comes. So
while a shift runs, its `Renewal` (the last tick's holds and refusals, and the holds the
shift makes itself) is renewed on its own cadence (`renewal`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from flexpipe.cluster import Cluster
from flexpipe.policies.planner import ModelDemand
from flexpipe.policies.shift import placeable
from flexpipe.policies.shift.candidates import Planner

__all__ = ["RefusalChange", "Renewal", "StandbyCommand", "StandbyState", "renewal"]


@dataclass(frozen=True, slots=True)
class StandbyCommand:
    """One word to the gateway: hold `model` for `seconds` (0: release it), or, with `why`,
    refuse its requests for `seconds` with that reason."""

    model: str
    seconds: float
    why: str | None = None  # not None: refuse, with this reason
    standby: bool = False  # the model has no instance now (what a settled hold records)


@dataclass(frozen=True, slots=True)
class RefusalChange:
    """A model started being refused (`why`), or stopped (`why` None, `was` its old reason;
    `standby`: it is held again for a cold start, else it serves again)."""

    model: str
    why: str | None
    was: str | None
    standby: bool


@dataclass(frozen=True, slots=True)
class Renewal:
    """What a shift in progress keeps alive in the gateway: these holds and refusals, each
    for the hold's length again, every `every_s`."""

    held: tuple[str, ...]
    refused: tuple[tuple[str, str], ...]  # (model, why), as the last tick refused it
    every_s: float

    def commands(self, hold_s: float) -> list[StandbyCommand]:
        """One renewal: the refusals first, then the holds."""
        out = [StandbyCommand(m, hold_s, why) for m, why in self.refused]
        return out + [StandbyCommand(m, hold_s) for m in self.held]


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


@dataclass
class StandbyState:
    """What the gateway was last told (a command counts once the gateway took it)."""

    held: set[str] = field(default_factory=set)  # models held with no instance
    # models with no instance that no GPU free to us can place -> the planner's reason
    refused: dict[str, str] = field(default_factory=dict)

    def commands(
        self,
        demands: Sequence[ModelDemand],
        serving: Collection[str],
        cluster: Cluster,
        now_s: float,
        planner: Planner,
        wake_rate_per_s: float,
        next_change_in_s: float | None,
        hold_s: float,
    ) -> list[StandbyCommand]:
        """Each tick: hold every model with no instance, refuse those no GPU free to us can
        place (not while a GPU is due back within the hold), release those that serve again
        or can be placed again; in model order."""
        standby = {d.name for d in demands} - set(serving)
        unplaceable = placeable.unplaceable(
            cluster, demands, standby, now_s, planner, wake_rate_per_s, next_change_in_s, hold_s
        )
        out = []
        for model in sorted(standby | self.held | set(self.refused)):
            why = unplaceable.get(model)
            seconds = hold_s if why is not None or model in standby else 0.0
            out.append(StandbyCommand(model, seconds, why, model in standby))
        return out

    def settle(self, cmd: StandbyCommand) -> RefusalChange | None:
        """The gateway took `cmd`: what it now holds and refuses; a refusal that started or
        ended (said once, not at every tick)."""
        if cmd.standby:
            self.held.add(cmd.model)
        else:
            self.held.discard(cmd.model)
        was = self.refused.get(cmd.model)
        if cmd.why is not None:
            self.refused[cmd.model] = cmd.why
            return RefusalChange(cmd.model, cmd.why, None, cmd.standby) if was is None else None
        if was is None:
            return None
        del self.refused[cmd.model]
        return RefusalChange(cmd.model, None, was, cmd.standby)

    def renewal(self, shift_holds: Iterable[str], tick_s: float, hold_s: float) -> Renewal | None:
        """What to keep alive while a shift runs: the last tick's holds and refusals, and
        `shift_holds`, the holds the shift makes itself (the first plan's models, a model it
        takes to zero)."""
        return renewal(self.held | set(shift_holds), self.refused, tick_s, hold_s)
