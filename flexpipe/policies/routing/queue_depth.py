"""Scorer `queue`: fewer requests waiting in the engine's queue scores higher.

score = (max_waiting - own) / (max_waiting - min_waiting) over fresh instances, 1.0 when all
are equal, 0.0 for stale metrics (llm-d's queue scorer). `num_waiting` is the scraped
vllm:num_requests_waiting. Parameters: none.

    routing: {policy: composite, params: {weights: {queue: 2}}}
"""

from __future__ import annotations

import random

from flexpipe.policies.routing.base import PolicyHooks
from flexpipe.policies.routing.registry import register_scorer
from flexpipe.policies.routing.snapshot import RoutingSnapshot


class QueueScorer(PolicyHooks):
    name = "queue"

    def score(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> list[float]:
        del rng
        fresh = [not snapshot.is_stale(v, now) for v in snapshot.instances]
        waits = [v.num_waiting for v, f in zip(snapshot.instances, fresh, strict=True) if f]
        if not waits:
            return [0.0] * len(snapshot.instances)
        low, high = min(waits), max(waits)
        out = []
        for v, f in zip(snapshot.instances, fresh, strict=True):
            if not f:
                out.append(0.0)
            elif high == low:
                out.append(1.0)
            else:
                out.append((high - v.num_waiting) / (high - low))
        return out


register_scorer("queue", QueueScorer)
