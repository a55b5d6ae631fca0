"""The gateway's decisions, synchronous and clock-free: which instance serves a request,
what a request holds while it runs, when an instance is ejected, how long a refused client
should wait. The live `Gateway` wraps it in I/O (HTTP, the wait queue's futures, metrics);
the simulator drives the same object on a virtual clock. Every method takes `now`.

Pick: the candidates are the model's active, healthy instances minus those that already failed this
request (never again) and, while others remain, minus those that were busy for it (a 429 or
503). The routing policy ranks them, and instances a move is cutting over to go behind the
rest (`fenced_last`); the first one below its concurrency limit wins. None
means every candidate is at its limit: the caller queues the request and asks again when a
slot frees.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence

from flexpipe.gateway.config import GatewayConfig
from flexpipe.gateway.core.backpressure import DrainRate
from flexpipe.gateway.core.pool import Instance, Pool
from flexpipe.policies.routing import (
    InstanceView,
    PrefixIndex,
    RoutingRequest,
    RoutingSnapshot,
    create_policy,
)
from flexpipe.policies.routing.views import read_only


def fenced_last(
    ranked: Sequence[str], by_name: Mapping[str, tuple[Instance, object]], now: float
) -> list[str]:
    """The policy's ranking with the instances a move is cutting over to (fenced until after
    `now`, `Pool.fence`) moved behind the others, each group in its order: a new request goes
    there only when no other candidate has a slot, so the fence never queues it."""
    open_: list[str] = []
    fenced: list[str] = []
    for name in ranked:
        found = by_name.get(name)
        (fenced if found is not None and found[0].fenced_until_s > now else open_).append(name)
    return open_ + fenced


class NoInstance(Exception):
    """No live instance serves the model (for this request)."""


@read_only
class Pick:
    """A routing decision: the instance, why, and the prefix-index accounting."""

    instance: Instance
    reason: str  # the policy's reason for its first choice, or "next_ranked"
    num_blocks: int  # the prompt's blocks
    num_blocks_matched: int  # of which the prefix index thinks the instance holds


class Router:
    def __init__(self, cfg: GatewayConfig, pool: Pool, rng: random.Random) -> None:
        self.cfg = cfg
        self.pool = pool
        self.rng = rng
        self.policy = create_policy(cfg.policy, **cfg.policy_params)
        self.prefix_index = PrefixIndex(cfg.max_prefix_blocks_per_instance)
        self.drain_rate = DrainRate()  # requests finished per second (for Retry-After)
        self.mean_request_tokens = 512.0  # EWMA of prompt + expected output per request

    # ---------------------------------------------------------------- routing
    def pick(
        self,
        model: str,
        request: RoutingRequest,
        now: float,
        excluded: Collection[str] = (),
        failed: Collection[str] = (),
        prefer: str | None = None,
    ) -> Pick | None:
        """The instance for `request`, or None when every candidate is at its limit.
        Raises `NoInstance` when no live instance is left for it. `prefer`: an instance the
        controller chose (a move's target), taken whenever it is a candidate, even at its
        limit: the controller priced the wait for a slot there, the request already held a
        slot on the instance it leaves, and the engine admits it ahead of its queue."""
        routable = self.pool.routable(model)
        if failed:
            routable = [i for i in routable if i.url not in failed]
        cands = routable
        if excluded:
            cands = [i for i in routable if i.url not in excluded] or routable
        if not cands:
            raise NoInstance(f"no healthy instance serves model `{model}` right now")
        hashes = request.block_hashes
        index = self.prefix_index
        if prefer is not None:
            inst = next((i for i in cands if i.url == prefer), None)
            if inst is not None:
                matched = index.match(inst.url, hashes) if hashes else 0
                if hashes:
                    index.insert(inst.url, hashes)
                return Pick(inst, "moved", len(hashes), matched)
        # (loops, not comprehensions: under Python 3.11 each is a function call, and this
        # runs for every request with a few candidates)
        views = []
        by_name: dict[str, tuple[Instance, InstanceView]] = {}  # name -> (record, its view)
        match = index.match
        for i in cands:
            view = i.view(match(i.url, hashes) if hashes else 0)
            views.append(view)
            by_name[view.name] = (i, view)
        snapshot = RoutingSnapshot(tuple(views), request, self.cfg.max_metrics_age_s)
        decision = self.policy.choose(snapshot, now, self.rng)
        ranked: Sequence[str] = decision.ranked
        if self.pool.fenced_until_s > now:
            ranked = fenced_last(ranked, by_name, now)
        first = decision.ranked[0] if decision.ranked else None
        for name in ranked:
            found = by_name.get(name)
            if found is None:
                continue
            inst, view = found
            if inst.num_in_flight >= inst.max_concurrency:
                continue
            matched = 0
            if hashes:
                matched = view.num_prefix_blocks_matched
                index.insert(name, hashes)
            reason = decision.reason if name == first else "next_ranked"
            return Pick(inst, reason, len(hashes), matched)
        return None

    def remove_instance(self, url: str) -> None:
        """Forget what routing kept about an instance that left the pool."""
        self.prefix_index.remove_instance(url)
        hook = getattr(self.policy, "on_instance_removed", None)
        if hook is not None:
            hook(url)

    # ---------------------------------------------------------------- load accounting
    def acquire(self, inst: Instance, num_tokens: float) -> None:
        """`inst` serves a request of `num_tokens` (prompt + expected output) from now."""
        inst.num_in_flight += 1
        inst.num_tokens_sent_since_scrape += num_tokens
        self.mean_request_tokens += 0.05 * (num_tokens - self.mean_request_tokens)

    def finish(self, inst: Instance, num_tokens: float, now: float) -> None:
        """`inst` no longer serves it (each `acquire` has exactly one `finish`)."""
        inst.num_in_flight -= 1
        inst.num_tokens_sent_since_scrape -= num_tokens
        self.drain_rate.record(now)

    def retry_after_s(self, num_waiting: int, now: float) -> float:
        """What a refused client should wait: the queue ahead at the measured drain rate."""
        return self.drain_rate.retry_after_s(num_waiting, now)

    # ---------------------------------------------------------------- health
    def succeeded(self, inst: Instance) -> None:
        inst.num_consecutive_failures = 0
        if inst.backoff_s:
            inst.backoff_s = 0.0

    def failed(self, inst: Instance, now: float) -> bool:
        """A passive signal (connect error, timeout, broken stream); True when it ejected
        the instance."""
        inst.num_consecutive_failures += 1
        if inst.healthy and inst.num_consecutive_failures >= self.cfg.eject_after_failures:
            self.eject(inst, now)
            return True
        return False

    def eject(self, inst: Instance, now: float) -> None:
        self.pool.eject(inst, now, self.cfg.eject_base_backoff_s, self.cfg.eject_max_backoff_s)
