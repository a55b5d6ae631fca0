"""least_load: the instance whose work ahead, per unit of capacity, is smallest.

Cost per instance = (queued and running tokens, from the engine's /metrics corrected by what
this gateway sent since the scrape, + this request's prompt tokens and expected output)
divided by its token throughput: slots (max_num_seqs) x measured per-sequence decode speed x
weight. That is the seconds it would take to drain its work at full batch: an instance with
three times the slots (or a GPU twice as fast) takes three times (twice) the work at equal
cost. The request counts whole (not half, as in `capacity.utilization`): on an idle slow
instance its own tokens are all the work there is, and half of them would make it look
cheaper than a busy fast one that finishes sooner. Instances whose speed is not yet
measured get the mean of the measured ones (a nominal 100 tokens/s while none is measured).
Stale metrics (older than the snapshot's `max_metrics_age_s`, or never scraped) make an
instance count as saturated: it ranks after every fresh one of its tier, and if all are
stale the order falls back to the lowest utilization (in flight per slot). As in every
policy, an instance with a free slot ranks before one without (`capacity.rank`).

Parameters: `output_weight` (default 1.0) scales the expected output tokens (decode tokens
cost more than prefill tokens on real engines; raise it to reflect that).

    routing: {policy: least_load, params: {output_weight: 1.0}}

Also registered as the scorer `load`: score = min cost / own cost (0 when stale).
"""

from __future__ import annotations

import math
import random

from flexpipe.policies.routing.base import PolicyHooks
from flexpipe.policies.routing.capacity import Room, assess, mean_speed, rank, utilization
from flexpipe.policies.routing.registry import register_policy, register_scorer
from flexpipe.policies.routing.views import Decision, RoutingSnapshot


def instance_costs(
    snapshot: RoutingSnapshot, now: float, output_weight: float = 1.0, room: Room | None = None
) -> list[float]:
    """Seconds to drain each instance's work, this request included, at full batch
    (inf = stale metrics). `room`: the snapshot's `capacity.assess`, if the caller has it."""
    req = snapshot.request
    views = snapshot.instances
    if room is None:
        room = assess(snapshot, now)
    default_speed: float | None = None  # the mean speed, once an instance has none measured
    extra = req.num_prompt_tokens + output_weight * req.num_expected_output_tokens
    costs = []
    for v, stale, cap in zip(views, room.stale, room.capacity, strict=True):
        if stale:
            costs.append(math.inf)
            continue
        speed = v.speed_tokens_per_s
        if not speed > 0:
            if default_speed is None:
                default_speed = mean_speed(views)
            speed = default_speed
        costs.append((v.num_queued_tokens + extra) / (speed * cap))
    return costs


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
        room = assess(snapshot, now)
        costs = instance_costs(snapshot, now, self.output_weight, room)
        return decide_by_costs(snapshot, now, costs, rng, room)


def _finite(costs: list[float]) -> list[float]:
    # (loops, not comprehensions, in this module: under Python 3.11 each comprehension is a
    # function call, which costs more than its loop over a pick's few instances)
    out = []
    for c in costs:
        if math.isfinite(c):
            out.append(c)
    return out


def _scores(costs: list[float], finite: list[float] | None = None) -> list[float]:
    """low / cost (0 for stale); `finite`: `_finite(costs)`, if the caller has it."""
    if finite is None:
        finite = _finite(costs)
    if not finite:
        return [0.0] * len(costs)
    low = min(finite)
    isfinite = math.isfinite
    out = []
    for c in costs:
        out.append(0.0 if not isfinite(c) else (low / c if c > 0 else 1.0))
    return out


def decide_by_costs(
    snapshot: RoutingSnapshot,
    now: float,
    costs: list[float],
    rng: random.Random,
    room: Room | None = None,
) -> Decision:
    """least_load's decision from costs already computed by `instance_costs` (`room`: the
    snapshot's `capacity.assess`, if the caller has it)."""
    finite = _finite(costs)
    if not finite and all(math.isinf(c) for c in costs):
        scores = [1.0 / utilization(v) for v in snapshot.instances]
        return Decision(rank(snapshot, now, scores, rng, room), "stale_metrics")
    return Decision(rank(snapshot, now, _scores(costs, finite), rng, room), "least_cost")


register_policy("least_load", LeastLoad)
register_scorer("load", LeastLoad)
