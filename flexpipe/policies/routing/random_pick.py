"""random: a uniformly random instance, weighted by the instance's `weight`.

Parameters: none. Uses only the injected `random.Random`, so a seeded run is reproducible.

    routing: {policy: random}
"""

from __future__ import annotations

import random

from flexpipe.policies.routing.base import PolicyHooks
from flexpipe.policies.routing.registry import register_policy
from flexpipe.policies.routing.snapshot import Decision, RoutingSnapshot


class RandomPick(PolicyHooks):
    name = "random"

    def choose(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> Decision:
        del now
        # Weighted order without replacement (Efraimidis-Spirakis keys): u ** (1 / w).
        keyed = []
        for v in snapshot.instances:
            w = max(v.weight, 1e-9)
            keyed.append((v.is_full, -(rng.random() ** (1.0 / w)), v.name))
        keyed.sort()
        return Decision(tuple(k[2] for k in keyed), "random")


register_policy("random", RandomPick)
