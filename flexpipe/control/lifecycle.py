"""Re-exported from `flexpipe.lifecycle` (the gateway's pool, the store and the controller
share it; the gateway does not import the controller)."""

from flexpipe.lifecycle import (
    LIVE_STATES,
    TRANSITIONS,
    LifecycleError,
    State,
    can_transition,
    check_transition,
    parse_state,
)

__all__ = [
    "LIVE_STATES",
    "TRANSITIONS",
    "LifecycleError",
    "State",
    "can_transition",
    "check_transition",
    "parse_state",
]
