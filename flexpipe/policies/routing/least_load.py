"""least_load: the instance that would finish this request's work soonest.

Cost per instance = (queued and running tokens, from the engine's /metrics corrected by what
this gateway sent since the scrape, + this request's prompt tokens + its expected output)
divided by the instance's measured speed times its weight. A GPU half as fast gets half the
traffic at equal queues (seed 001 §4.1-4.2). Instances whose speed is not yet measured get
the mean of the measured ones (a nominal 100 tokens/s while none is measured). Stale metrics
(older than the snapshot's `max_metrics_age_s`, or never scraped) make an instance count as
saturated: it ranks after every fresh one, and if all are stale the order falls back to
fewest in flight.

Parameters: `output_weight` (default 1.0) scales the expected output tokens (decode tokens
cost more than prefill tokens on real engines; raise it to reflect that).

    routing: {policy: least_load, params: {output_weight: 1.0}}

Also registered as the scorer `load`: score = min cost / own cost (0 when stale).
"""

from __future__ import annotations

import math
import random

from flexpipe.policies.routing.base import PolicyHooks, rank_by_score
from flexpipe.policies.routing.registry import register_policy, register_scorer
from flexpipe.policies.routing.snapshot import Decision, InstanceView, RoutingSnapshot

NOMINAL_SPEED_TOKENS_PER_S = 100.0  # used while no instance of the pool has a measured speed


def instance_costs(
    snapshot: RoutingSnapshot, now: float, output_weight: float = 1.0
) -> list[float]:
    """Estimated seconds of work ahead on each instance if it took this request (inf = stale)."""
    req = snapshot.request
    measured = [v.speed_tokens_per_s for v in snapshot.instances if v.speed_tokens_per_s > 0]
    default_speed = sum(measured) / len(measured) if measured else NOMINAL_SPEED_TOKENS_PER_S
    extra = req.num_prompt_tokens + output_weight * req.num_expected_output_tokens
    costs = []
    for v in snapshot.instances:
        if snapshot.is_stale(v, now):
            costs.append(math.inf)
            continue
        speed = v.speed_tokens_per_s if v.speed_tokens_per_s > 0 else default_speed
        costs.append((v.num_queued_tokens + extra) / (speed * max(v.weight, 1e-9)))
    return costs


def _fallback_in_flight(views: tuple[InstanceView, ...]) -> list[float]:
    return [1.0 / (1.0 + v.num_in_flight / max(v.weight, 1e-9)) for v in views]


class LeastLoad(PolicyHooks):
    name = "least_load"

    def __init__(self, output_weight: float = 1.0) -> None:
        if output_weight < 0:
            raise ValueError("output_weight must be >= 0")
        self.output_weight = float(output_weight)

    def score(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> list[float]:
        del rng
        return _scores(instance_costs(snapshot, now, self.output_weight))

    def choose(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> Decision:
        return decide_by_costs(snapshot, instance_costs(snapshot, now, self.output_weight), rng)


def _scores(costs: list[float]) -> list[float]:
    finite = [c for c in costs if math.isfinite(c)]
    if not finite:
        return [0.0] * len(costs)
    low = min(finite)
    return [0.0 if not math.isfinite(c) else (low / c if c > 0 else 1.0) for c in costs]


def decide_by_costs(snapshot: RoutingSnapshot, costs: list[float], rng: random.Random) -> Decision:
    """least_load's decision from costs already computed by `instance_costs`."""
    if all(math.isinf(c) for c in costs):
        scores = _fallback_in_flight(snapshot.instances)
        return Decision(rank_by_score(snapshot.instances, scores, rng), "stale_metrics")
    return Decision(rank_by_score(snapshot.instances, _scores(costs), rng), "least_cost")


register_policy("least_load", LeastLoad)
register_scorer("load", LeastLoad)
