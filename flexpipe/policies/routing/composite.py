"""composite: a weighted sum of scorers, each in [0, 1]; the highest total wins.

The framework, not the scorer, clamps and weights (llm-d's scheduler profile). Scorers by
name: `prefix` (matched prompt blocks / prompt blocks), `queue` (engine waiting queue),
`kv` (free KV cache), `load` (least_load cost), `least_request` (utilization).
Ties are broken by the seeded RNG. The totals order instances within a capacity tier
(`capacity.rank`): one with a free slot always ranks before one where the request would
queue, so no prefix score can outweigh a queue. The decision's reason names
the scorer that contributed most to the winner.

Parameters: `weights` (default `DEFAULT_WEIGHTS`), `params` (per-scorer parameters).

    routing:
      policy: composite
      params:
        weights: {prefix: 3, queue: 1, kv: 1, load: 3}
        params: {load: {output_weight: 1.0}}
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from flexpipe.policies.routing.base import PolicyHooks, Scorer, clamp01
from flexpipe.policies.routing.capacity import rank
from flexpipe.policies.routing.registry import create_scorer, register_policy
from flexpipe.policies.routing.views import Decision, RoutingSnapshot

# The best composite of the routing-quality sweep (docs/routing.md): prefix 3 and flexpipe's
# least_load cost 3, with llm-d's queue and KV scorers as light tie-breakers. A load weight
# below the prefix weight lets prefix hits funnel every session onto one instance.
DEFAULT_WEIGHTS: dict[str, float] = {"prefix": 3.0, "queue": 1.0, "kv": 1.0, "load": 3.0}


class Composite(PolicyHooks):
    name = "composite"

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        params: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        chosen = dict(DEFAULT_WEIGHTS if weights is None else weights)
        if not chosen or any(w < 0 for w in chosen.values()):
            raise ValueError("composite weights must be a non-empty map of non-negative numbers")
        params = params or {}
        self.weights = chosen
        self.scorers: list[tuple[Scorer, float]] = [
            (create_scorer(name, **dict(params.get(name, {}))), float(w))
            for name, w in chosen.items()
            if w > 0
        ]

    def choose(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> Decision:
        n = len(snapshot.instances)
        if n == 0:
            return Decision((), "empty")
        totals = [0.0] * n
        parts: list[list[float]] = []
        for scorer, w in self.scorers:
            s = [clamp01(x) * w for x in scorer.score(snapshot, now, rng)]
            parts.append(s)
            for i in range(n):
                totals[i] += s[i]
        ranked = rank(snapshot, now, totals, rng)
        best = next(i for i, v in enumerate(snapshot.instances) if v.name == ranked[0])
        top = max(range(len(parts)), key=lambda k: parts[k][best]) if parts else 0
        reason = self.scorers[top][0].name if self.scorers else "none"
        return Decision(ranked, reason)


register_policy("composite", Composite)
