"""random: a random instance, weighted by its capacity (slots x weight).

Instances with a free slot come first (`capacity.tier`); within a tier the order is a
weighted draw without replacement. Parameters: none. Uses only the injected
`random.Random`, so a seeded run is reproducible.

    routing: {policy: random}
"""

from __future__ import annotations

import random

from flexpipe.policies.routing.base import PolicyHooks
from flexpipe.policies.routing.capacity import capacity, tier
from flexpipe.policies.routing.registry import register_policy
from flexpipe.policies.routing.views import Decision, RoutingSnapshot


class RandomPick(PolicyHooks):
    name = "random"

    def choose(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> Decision:
        # Weighted order without replacement (Efraimidis-Spirakis keys): u ** (1 / w).
        keyed = []
        for v in snapshot.instances:
            w = capacity(v)
            keyed.append((tier(v, snapshot, now), -(rng.random() ** (1.0 / w)), v.name))
        keyed.sort()
        return Decision(tuple(k[2] for k in keyed), "random")


register_policy("random", RandomPick)
