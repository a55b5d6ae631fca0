"""Scorer `queue`: fewer requests waiting in the engine's queue, per unit of capacity, scores
higher.

w = num_waiting / capacity (slots x weight): ten waiting on a 48-slot instance drain faster
than two on a 2-slot one. score = (max_w - own) / (max_w - min_w) over fresh instances, 1.0
when all are equal, 0.0 for stale metrics (llm-d's queue scorer, normalised by capacity).
`num_waiting` is the scraped vllm:num_requests_waiting. Parameters: none.

    routing: {policy: composite, params: {weights: {queue: 2}}}
"""

from __future__ import annotations

import random

from flexpipe.policies.routing.base import PolicyHooks
from flexpipe.policies.routing.capacity import capacity
from flexpipe.policies.routing.registry import register_scorer
from flexpipe.policies.routing.views import RoutingSnapshot


class QueueScorer(PolicyHooks):
    name = "queue"

    def score(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> list[float]:
        del rng
        views = snapshot.instances
        fresh = [not snapshot.is_stale(v, now) for v in views]
        per_cap = [v.num_waiting / capacity(v) for v in views]
        waits = [w for w, f in zip(per_cap, fresh, strict=True) if f]
        if not waits:
            return [0.0] * len(views)
        low, high = min(waits), max(waits)
        out = []
        for w, f in zip(per_cap, fresh, strict=True):
            if not f:
                out.append(0.0)
            elif high == low:
                out.append(1.0)
            else:
                out.append((high - w) / (high - low))
        return out


register_scorer("queue", QueueScorer)
