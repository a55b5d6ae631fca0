"""Scorer `kv`: more free KV cache scores higher: score = 1 - kv_usage (0.0 when stale).

`kv_usage` is the scraped vllm:kv_cache_usage_perc (0..1). Parameters: none.

    routing: {policy: composite, params: {weights: {kv: 2}}}
"""

from __future__ import annotations

import random

from flexpipe.policies.routing.base import PolicyHooks, clamp01
from flexpipe.policies.routing.registry import register_scorer
from flexpipe.policies.routing.views import RoutingSnapshot


class KvScorer(PolicyHooks):
    name = "kv"

    def score(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> list[float]:
        del rng
        return [
            0.0 if snapshot.is_stale(v, now) else clamp01(1.0 - v.kv_usage)
            for v in snapshot.instances
        ]


register_scorer("kv", KvScorer)
