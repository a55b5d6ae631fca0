"""An instance's one lifecycle (pure): starting → rehearsing → active → draining → gone,
and beside the main line asleep → waking → active.

The gateway's pool, the store and the controller all check a change of state here, so an
instance can never be, say, drained before it started. Health is not a state: an instance
the gateway ejected after failed probes keeps its state and is only out of routing until a
probe succeeds. Legal moves besides the main line:

- starting → active: an instance of the first plan (nothing to rehearse against);
- rehearsing → draining: a rehearsal missed and the target is rolled back (it already
  served a slice of live traffic, so it drains rather than drops it);
- draining → active: a rollback after the switch brings a draining instance back;
- active/draining → asleep: the engine sleeps (vLLM's sleep mode) instead of stopping, once
  its requests moved or finished; it holds only what vLLM keeps on the GPU while asleep and is
  never routed to;
- starting/rehearsing → asleep: an in-place successor pre-started beside the instance it
  replaces sleeps until that one is gone (docs/controller.md, "In place");
- asleep → waking → active: a later plan wants the same model, gear and GPUs, and waking it
  is faster than a cold start (docs/controller.md, "Sleep instead of stop");
- any live state → gone: the engine died, failed to start or was found unreachable (an asleep
  or waking one too: a wake that fails falls back to a cold start elsewhere).

`gone` is final: a new engine on the same GPUs is a new instance.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

__all__ = [
    "DORMANT_STATES",
    "LIVE_STATES",
    "TRANSITIONS",
    "LifecycleError",
    "State",
    "can_transition",
    "check_transition",
    "parse_state",
]


class State(enum.StrEnum):
    STARTING = "starting"
    REHEARSING = "rehearsing"
    ACTIVE = "active"
    DRAINING = "draining"
    ASLEEP = "asleep"
    WAKING = "waking"
    GONE = "gone"


# state -> the states it may move to
TRANSITIONS: Mapping[State, frozenset[State]] = {
    State.STARTING: frozenset({State.REHEARSING, State.ACTIVE, State.ASLEEP, State.GONE}),
    State.REHEARSING: frozenset({State.ACTIVE, State.DRAINING, State.ASLEEP, State.GONE}),
    State.ACTIVE: frozenset({State.DRAINING, State.ASLEEP, State.GONE}),
    State.DRAINING: frozenset({State.ACTIVE, State.ASLEEP, State.GONE}),
    State.ASLEEP: frozenset({State.WAKING, State.GONE}),
    State.WAKING: frozenset({State.ACTIVE, State.GONE}),
    State.GONE: frozenset(),
}

# states of an instance whose engine may still be running (a restarted controller adopts them)
LIVE_STATES: frozenset[State] = frozenset(s for s in State if s is not State.GONE)

# states of an instance whose engine sleeps or is waking: it holds GPU memory but serves nothing
DORMANT_STATES: frozenset[State] = frozenset({State.ASLEEP, State.WAKING})


class LifecycleError(ValueError):
    """An unknown state or an illegal change of state; the message names both ends."""


def parse_state(value: str) -> State:
    try:
        return State(value)
    except ValueError:
        names = ", ".join(s.value for s in State)
        raise LifecycleError(f"unknown instance state {value!r}: expected one of {names}") from None


def can_transition(current: State | str, target: State | str) -> bool:
    return parse_state(target) in TRANSITIONS[parse_state(current)]


def check_transition(current: State | str, target: State | str) -> State:
    """`target` as a State if `current` may move to it; else LifecycleError saying why."""
    frm, to = parse_state(current), parse_state(target)
    if to in TRANSITIONS[frm]:
        return to
    if frm is State.GONE:
        raise LifecycleError(f"illegal transition {frm} → {to}: gone is final")
    if frm is to:
        raise LifecycleError(f"illegal transition {frm} → {to}: already {to}")
    allowed = ", ".join(sorted(s.value for s in TRANSITIONS[frm]))
    raise LifecycleError(f"illegal transition {frm} → {to}: from {frm} only to {allowed}")
