"""least_request: the instance with the fewest requests in flight at this gateway.

In-flight counts are divided by the instance's `weight`, so weight 2 takes twice as many.
Ties are broken by the seeded RNG. Parameters: none. Also registered as the scorer
`least_request`: score = (min + 1) / (own + 1) over weighted in-flight counts.

    routing: {policy: least_request}
"""

from __future__ import annotations

import random

from flexpipe.policies.routing.base import PolicyHooks, rank_by_score
from flexpipe.policies.routing.registry import register_policy, register_scorer
from flexpipe.policies.routing.snapshot import Decision, RoutingSnapshot


class LeastRequest(PolicyHooks):
    name = "least_request"

    def score(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> list[float]:
        del now, rng
        loads = [v.num_in_flight / max(v.weight, 1e-9) for v in snapshot.instances]
        if not loads:
            return []
        low = min(loads)
        return [(low + 1.0) / (x + 1.0) for x in loads]

    def choose(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> Decision:
        scores = self.score(snapshot, now, rng)
        return Decision(rank_by_score(snapshot.instances, scores, rng), "fewest_in_flight")


register_policy("least_request", LeastRequest)
register_scorer("least_request", LeastRequest)
