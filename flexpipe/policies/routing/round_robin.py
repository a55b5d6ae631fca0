"""round_robin: each request goes to the next instance in name order.

Parameters: none. Full instances (at their concurrency limit) rank last.

    routing: {policy: round_robin}
"""

from __future__ import annotations

import random

from flexpipe.policies.routing.base import PolicyHooks
from flexpipe.policies.routing.registry import register_policy
from flexpipe.policies.routing.snapshot import Decision, RoutingSnapshot


class RoundRobin(PolicyHooks):
    name = "round_robin"

    def __init__(self) -> None:
        self._num_chosen = 0  # requests routed so far: the rotation position

    def choose(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> Decision:
        del now, rng
        names = sorted(v.name for v in snapshot.instances)
        if not names:
            return Decision((), "empty")
        start = self._num_chosen % len(names)
        self._num_chosen += 1
        rotated = names[start:] + names[:start]
        full = {v.name for v in snapshot.instances if v.is_full}
        ranked = [n for n in rotated if n not in full] + [n for n in rotated if n in full]
        return Decision(tuple(ranked), "rotation")


register_policy("round_robin", RoundRobin)
