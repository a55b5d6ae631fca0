"""round_robin: smooth weighted round robin over the instances, weighted by capacity.

Each instance gets turns in proportion to its capacity (slots x weight), interleaved (nginx's
smooth weighted round robin: every pick adds each instance's capacity to its credit, the
highest credit wins and pays back the total). Equal capacities rotate in name order.
Instances without a free slot are passed over while another has one (`capacity.tier`).
Parameters: none.

    routing: {policy: round_robin}
"""

from __future__ import annotations

import random

from flexpipe.policies.routing.base import PolicyHooks
from flexpipe.policies.routing.capacity import capacity, tier
from flexpipe.policies.routing.registry import register_policy
from flexpipe.policies.routing.views import Decision, RoutingSnapshot


class RoundRobin(PolicyHooks):
    name = "round_robin"

    def __init__(self) -> None:
        self._credit: dict[str, float] = {}  # instance -> smooth-WRR credit

    def choose(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> Decision:
        del rng
        views = sorted(snapshot.instances, key=lambda v: v.name)
        if not views:
            return Decision((), "empty")
        tiers = {v.name: tier(v, snapshot, now) for v in views}
        best_tier = min(tiers.values())
        eligible = [v for v in views if tiers[v.name] == best_tier]
        total = 0.0
        for v in eligible:
            w = capacity(v)
            self._credit[v.name] = self._credit.get(v.name, 0.0) + w
            total += w
        credit = self._credit
        order = sorted(views, key=lambda v: (tiers[v.name], -credit.get(v.name, 0.0), v.name))
        credit[order[0].name] -= total
        if len(credit) > 4 * len(views):  # forget instances long gone
            names = {v.name for v in views}
            self._credit = {n: c for n, c in credit.items() if n in names}
        return Decision(tuple(v.name for v in order), "rotation")

    def on_instance_removed(self, instance: str) -> None:
        self._credit.pop(instance, None)


register_policy("round_robin", RoundRobin)
