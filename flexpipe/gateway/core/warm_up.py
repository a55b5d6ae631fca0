"""A recompute move's pre-copy (warm-up) rules (pure): the live gateway's `relay.warm_up`
sends it over HTTP and the simulator's moves on their virtual clock, both by these."""

from __future__ import annotations

from typing import Literal

__all__ = ["MOVE_PRIORITY", "WARM_POLL_S", "WARM_TIMEOUT_S", "WarmOutcome", "warms"]

# A moved request is admitted ahead of the destination's waiting queue (vLLM's `priority`,
# lower first, with `--scheduling-policy priority`; every client request has 0): it already
# waited once, and the pause it sees is what a shift costs the client.
MOVE_PRIORITY = -1
# How long a recompute move waits, by default, for its warm-up (`warm_up`) before cutting
# over anyway: a few prefills of a long context (the controller may give its own bound).
WARM_TIMEOUT_S = 2.0
# How often a warmed move looks again for a prefill on its destination before cutting over
# (moves.py's `between_prefills`; the simulator polls its virtual clock as often).
WARM_POLL_S = 0.005
# What became of a warm-up: done in time; not sent (no free slot on the destination, nothing to
# continue, or a bound of 0); cut off at its bound; refused or broken by the destination.
WarmOutcome = Literal["warmed", "skipped", "timed_out", "failed"]


def warms(timeout_s: float, num_slots: int, num_in_flight: int) -> bool:
    """Whether a recompute move's destination is pre-copied (`warm_up`): a bound above 0 and
    a free slot there (full, the warm-up would only wait: the move goes ahead of its queue).
    `num_slots` 0: unbounded. The gateway and the simulator decide by it."""
    return timeout_s > 0 and not (num_slots and num_in_flight >= num_slots)
