"""least_request: the instance with the lowest utilization: requests in flight at this
gateway, this one included, per unit of capacity (slots x weight).

An instance with 48 slots takes 24 times the requests of one with 2; weight 2 doubles an
instance's share. Ties are broken by the seeded RNG; an instance with a free slot ranks before
one without (`capacity.rank`). Parameters: none. Also registered as the scorer
`least_request`: score = min utilization / own utilization.

    routing: {policy: least_request}
"""

from __future__ import annotations

import random

from flexpipe.policies.routing.base import PolicyHooks
from flexpipe.policies.routing.capacity import rank, utilization
from flexpipe.policies.routing.registry import register_policy, register_scorer
from flexpipe.policies.routing.views import Decision, RoutingSnapshot


class LeastRequest(PolicyHooks):
    name = "least_request"

    def score(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> list[float]:
        del now, rng
        loads = [utilization(v) for v in snapshot.instances]
        if not loads:
            return []
        low = min(loads)
        return [low / x for x in loads]

    def choose(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> Decision:
        scores = self.score(snapshot, now, rng)
        return Decision(rank(snapshot, now, scores, rng), "lowest_utilization")


register_policy("least_request", LeastRequest)
register_scorer("least_request", LeastRequest)
