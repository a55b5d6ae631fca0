"""Holds (pure): a model whose requests wait in the queue for capacity instead of being
refused — while the controller's first engines load, while an in-place shift replaces an
instance, and while a model scaled to zero cold-starts one (`POST /admin/models/hold`).

Refusals: a model with no instance that no GPU free to us can place (`POST
/admin/models/refuse`, the controller's `placement` check): its requests are answered 503
with the reason at once instead of waiting for a cold start that cannot come. A hold lifts
a refusal and a refusal ends a hold; the model stays listed by /v1/models either way.

The live gateway and the simulator's gateway keep one `Holds` each and ask it the same
questions with their own clock's `now`.
"""

from __future__ import annotations

__all__ = ["MAX_HELD_WAIT_S", "MAX_HOLD_S", "REFUSED_RETRY_AFTER_S", "STANDBY_HOLD_S", "Holds"]

MAX_HELD_WAIT_S = 900.0  # the longest a request of a held model waits, from its arrival
MAX_HOLD_S = 3600.0  # the longest one hold lasts (the controller renews what it keeps)
# What the controller asks for while a model has no instance serving yet (its first engines
# loading, or scaled to zero): renewed every tick, so it only outlasts a cold start.
STANDBY_HOLD_S = 600.0
# The Retry-After of a refused model's 503: the controller looks at the GPUs again every tick,
# and a change (a tenant leaving) holds the model again.
REFUSED_RETRY_AFTER_S = 60.0


class Holds:
    def __init__(self) -> None:
        self._until: dict[str, float] = {}  # model -> end of its hold
        # model -> (why no instance of it can come, until when: renewed by the controller
        # every tick as a hold is, so a refusal nobody renews lapses)
        self._refused: dict[str, tuple[str, float]] = {}

    def hold(self, model: str, seconds: float, now: float) -> None:
        """Hold `model` for `seconds` from `now` (at most MAX_HOLD_S); 0 ends the hold (its
        end is kept: what was queued through it waits the queue's time from then). Any hold
        lifts a refusal of `model`."""
        self._until[model] = now + min(max(seconds, 0.0), MAX_HOLD_S)
        self._refused.pop(model, None)

    def refuse(self, model: str, reason: str, seconds: float, now: float) -> None:
        """No instance of `model` can come (`reason`): its hold ends now, and for `seconds`
        from `now` (at most MAX_HOLD_S), while it has no instance, its requests are refused
        with `reason` (until then, or the next `hold`)."""
        if self._until.get(model, 0.0) > now:
            self._until[model] = now
        self._refused[model] = (reason, now + min(max(seconds, 0.0), MAX_HOLD_S))

    def refused(self, model: str, now: float) -> str | None:
        """Why `model` is refused at `now` (None: it is not)."""
        entry = self._refused.get(model)
        return entry[0] if entry is not None and entry[1] > now else None

    def held(self, model: str, now: float) -> bool:
        return self._until.get(model, 0.0) > now

    def models(self, now: float) -> set[str]:
        """The models held or refused now (listed by /v1/models even with no instance)."""
        held = {m for m, until in self._until.items() if until > now}
        return held | {m for m, (_, until) in self._refused.items() if until > now}

    def wait_deadline(
        self, model: str, deadline: float, arrival_s: float, queue_wait_s: float = 0.0
    ) -> float:
        """A queued request's deadline: the queue's own (`deadline`); for a model held in
        the request's life, the hold's end and then `queue_wait_s`, the queue's wait (it
        waited out a cold start or an in-place shift: once the hold is over it waits for a
        slot as any request would, no longer: not the hold's whole length again, and not
        a 429 for the time the hold took); never more than MAX_HELD_WAIT_S after it arrived,
        however often the hold is renewed. The caller passes the queue's own deadline each
        time, not a deadline this returned before."""
        until = self._until.get(model)
        if until is None or until <= arrival_s:  # no hold in this request's life
            return deadline
        return max(deadline, min(until + queue_wait_s, arrival_s + MAX_HELD_WAIT_S))
