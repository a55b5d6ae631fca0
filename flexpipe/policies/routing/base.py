"""The two contracts: a `RoutingPolicy` ranks instances; a `Scorer` scores them in [0, 1].

Policies rank; the framework (the gateway, the simulator) retries, queues and backs off, once
for every policy; every ranking is tiered by capacity first (`capacity.rank`). Hooks are
optional with no-op defaults: a stateless policy is tiny.
"""

from __future__ import annotations

import random
from typing import Protocol, runtime_checkable

from flexpipe.policies.routing.views import Decision, RoutingSnapshot


@runtime_checkable
class RoutingPolicy(Protocol):
    name: str

    def choose(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> Decision: ...


@runtime_checkable
class Scorer(Protocol):
    """Returns one score per instance (same order as `snapshot.instances`), each in [0, 1]."""

    name: str

    def score(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> list[float]: ...


class PolicyHooks:
    """No-op lifecycle hooks a policy may override."""

    def on_request_complete(self, instance: str, now: float) -> None:
        del instance, now

    def on_instance_removed(self, instance: str) -> None:
        del instance


def clamp01(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x
