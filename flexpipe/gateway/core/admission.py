"""The gateway's admission decision (pure): route a request to the instance the router picked,
queue it until a deadline, or fail it with a status and an OpenAI-style message.

The live gateway (`Gateway._pick`, on asyncio futures) and the simulator's gateway
(`SimGateway._route`, on its event loop) ask the router for a pick, then ask `admit` what to
do with it, and carry the answer out on their own clock. The rules, in order:

1. No live instance serves the model (the router's `NoInstance`): a model no GPU free to us
   can place (a refusal, holds.py) fails at once with 503 and the reason; a model not held
   fails with 503 and the router's words; a held one (its engines loading, scaled to zero,
   replaced in place) waits in the queue as if every instance were busy.
2. First come, first served: a request that never queued waits behind the waiters of its
   model, even when a slot is free (wait_queue.py), unless a move names its target.
3. A slot: route.
4. No slot: a request not yet queued finds the queue full (`max_queue`): 429. Else it waits
   until its deadline (`max_queue_wait_s` from when it first queued, or a hold's, holds.py
   `wait_deadline`); a deadline already past: 429.
5. Deadline-aware shedding (opt-in, `shed`: core/deadline.py): a request whose slack is below
   -margin is refused with 429 (reason `slo_late`) instead of served late: when it would
   queue (with the wait its place implies) or when it looks again (with a slot: no wait).
   A queued one waits at most until its TTFT deadline plus the margin; past it, still
   without a slot, it is late whatever the estimate and is shed.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexpipe.gateway.core.deadline import Shed, is_late
from flexpipe.gateway.core.holds import REFUSED_RETRY_AFTER_S, Holds

__all__ = [
    "ROUTE",
    "SHED_REASON",
    "Decision",
    "Fail",
    "Queue",
    "Route",
    "admit",
    "is_served",
    "num_prompt_tokens",
]


SHED_REASON = "slo_late"  # a Fail's reason when a late request is shed (rule 5)


def num_prompt_tokens(num_prompt_bytes: int) -> int:
    """The prompt's tokens as routing and tenants count them before the engine does: about
    four bytes a token, at least one."""
    return num_prompt_bytes // 4 + 1


def is_served(model: str, has_instance: bool, holds: Holds, now: float) -> bool:
    """Whether requests of `model` are taken at all (else a 404 before admission): it has
    an instance in the pool, or it is held or refused (listed even with none, holds.py)."""
    return has_instance or holds.held(model, now) or holds.refused(model, now) is not None


@dataclass(frozen=True, slots=True)
class Route:
    """Go to the router's pick."""


ROUTE = Route()  # (one value: a pick is every request's decision)


@dataclass(frozen=True, slots=True)
class Queue:
    """Wait in the queue until `deadline_s` (or until woken by a freed slot, then ask again).
    `own_deadline_s`: the queue's own deadline, from when it first queued; the caller keeps
    it and passes it back with each later question."""

    deadline_s: float
    own_deadline_s: float


@dataclass(frozen=True, slots=True)
class Fail:
    """Answer the client `status` with `message` (the OpenAI error's words, which clients and
    tests read). `reason`: the rejection's label (`flexpipe_gateway_rejected_total`);
    `param`: the request field at fault; `retry_after_s`: a fixed Retry-After; `busy`: a
    429 of the queue, whose Retry-After the caller measures from its drain rate."""

    status: int
    message: str
    reason: str
    param: str | None = None
    retry_after_s: float | None = None

    @property
    def busy(self) -> bool:
        return self.status == 429

    @property
    def shed(self) -> bool:
        """A late request refused before it was served late (rule 5)."""
        return self.reason == SHED_REASON


Decision = Route | Queue | Fail


def admit(
    model: str,
    has_slot: bool,
    no_instance: str | None,
    holds: Holds,
    now: float,
    arrival_s: float,
    own_deadline_s: float | None,
    num_waiting: int,
    num_waiting_for_model: int,
    max_queue: int,
    max_queue_wait_s: float,
    jumps_line: bool = False,
    shed: Shed | None = None,
) -> Decision:
    """What to do with a request of `model` at `now` (the module's rules). `has_slot`: the
    router picked an instance with a free slot; `no_instance`: the router's `NoInstance`
    words (None: it raised none); `own_deadline_s`: the `Queue.own_deadline_s` of its last
    wait (None: it never queued); `num_waiting`, `num_waiting_for_model`: the queue's length
    and its model's line; `jumps_line`: a move names its target (rule 2 does not apply);
    `shed`: its TTFT deadline and expected wait, to shed it when late (None: never, rule 5)."""
    if no_instance is not None:
        why = holds.refused(model, now)
        if why is not None:  # no instance of it can come: say why, do not wait
            message = f"The model `{model}` cannot be served now: {why}"
            return Fail(503, message, "unplaceable", "model", REFUSED_RETRY_AFTER_S)
        if not holds.held(model, now):
            return Fail(503, no_instance, "no_instance")
        has_slot = False  # held: wait for an instance
    if own_deadline_s is None and not jumps_line and num_waiting_for_model:
        has_slot = False  # others of its model wait: first come, first served
    if shed is not None and is_late(shed.slack_s(now, has_slot), shed.margin_s):
        message = shed.message(model, now, has_slot)
        return Fail(429, message, SHED_REASON, "model")
    if has_slot:
        return ROUTE
    if own_deadline_s is None:
        if num_waiting >= max_queue:
            return Fail(429, "all instances are busy and the wait queue is full", "queue_full")
        own_deadline_s = now + max_queue_wait_s
    # a shift takes capacity away for a while (or a model scaled to zero cold-starts): wait
    # it out; once the hold is over, the queue's wait from its end (holds.py)
    deadline_s = holds.wait_deadline(model, own_deadline_s, arrival_s, max_queue_wait_s)
    if shed is not None and shed.last_s < deadline_s:
        if shed.last_s <= now:  # no slot at its deadline plus the margin: late in any case
            return Fail(429, shed.message(model, now, True), SHED_REASON, "model")
        deadline_s = shed.last_s
    if deadline_s <= now:
        return Fail(429, "all instances stayed busy", "queue_timeout")
    return Queue(deadline_s, own_deadline_s)
