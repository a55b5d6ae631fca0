"""prefix_affinity: send a prompt where its prefix is already cached, within capacity.

- Seen prefix: the instance with the longest matched prefix (from the prefix index, via
  `InstanceView.num_prefix_blocks_matched`), ties to the lower least_load cost, if it has a
  free slot (else `spill` to least_load: a cached prefix never outweighs a queue) and passes the
  imbalance guard: if its work ahead per sequence (least_load's cost x slots: the tokens its
  batch has to get through, over per-sequence speed) exceeds the lowest by more than
  `imbalance_ratio` times and `imbalance_abs_s` seconds, least_load decides (`imbalance`;
  SGLang's cache-aware router does the same with request counts). A batch that grows
  slows every sequence in it, free slots or not: without the guard sessions funnel onto
  one instance of many slots.
- Unseen prefix (no match anywhere): bounded-load consistent hashing of the first block
  (typically the system prompt), weighted by capacity, so sessions sharing it converge on one
  instance: each instance has `num_virtual_nodes` x its share of the largest capacity points
  on the ring (at least one); walk the ring from the key and take the first instance with a
  free slot whose in-flight count is below its capacity share of `load_bound` x (all in
  flight + 1) (Mirrokni et al. 2018, with bins of unequal size).
- No prompt blocks at all: least_load.

The rest of the ranking (for retries) follows least_load, tiered by capacity.

Parameters (defaults): `min_match_ratio` 0.1, `imbalance_ratio` 3.0, `imbalance_abs_s` 2.0,
`load_bound` 1.25, `num_virtual_nodes` 64, `output_weight` 1.0. The guard's defaults won the
routing-quality sweep (docs/routing.md): 2.0 / 1.0 gave up prefix hits for no TTFT gain.

The gateway's default policy.

    routing: {policy: prefix_affinity, params: {imbalance_ratio: 3.0, load_bound: 1.25}}

Also registered as the scorer `prefix`: matched blocks / prompt blocks.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Sequence

from flexpipe.policies.routing.base import PolicyHooks
from flexpipe.policies.routing.capacity import Room, assess
from flexpipe.policies.routing.least_load import LeastLoad, decide_by_costs, instance_costs
from flexpipe.policies.routing.registry import register_policy, register_scorer
from flexpipe.policies.routing.views import Decision, InstanceView, RoutingSnapshot


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class PrefixScorer(PolicyHooks):
    name = "prefix"

    def score(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> list[float]:
        del now, rng
        total = len(snapshot.request.block_hashes)
        if total == 0:
            return [0.0] * len(snapshot.instances)
        return [min(1.0, v.num_prefix_blocks_matched / total) for v in snapshot.instances]


class PrefixAffinity(PolicyHooks):
    name = "prefix_affinity"

    def __init__(
        self,
        min_match_ratio: float = 0.1,
        imbalance_ratio: float = 3.0,
        imbalance_abs_s: float = 2.0,
        load_bound: float = 1.25,
        num_virtual_nodes: int = 64,
        output_weight: float = 1.0,
    ) -> None:
        if load_bound < 1.0 or imbalance_ratio < 1.0 or num_virtual_nodes < 1:
            raise ValueError("load_bound and imbalance_ratio must be >= 1, num_virtual_nodes >= 1")
        self.min_match_ratio = min_match_ratio
        self.imbalance_ratio = imbalance_ratio
        self.imbalance_abs_s = imbalance_abs_s
        self.load_bound = load_bound
        self.num_virtual_nodes = num_virtual_nodes
        self._least_load = LeastLoad(output_weight)
        # (instance, num points) per instance -> the ring
        self._rings: dict[tuple[tuple[str, int], ...], tuple[list[int], list[str]]] = {}
        # (instance, capacity) per instance, in view order -> the ring
        self._rings_by_caps: dict[tuple[tuple[str, float], ...], tuple[list[int], list[str]]]
        self._rings_by_caps = {}
        self._last_ring: tuple[dict[str, float], tuple[list[int], list[str]]] | None = None

    def _ring(self, vnodes: tuple[tuple[str, int], ...]) -> tuple[list[int], list[str]]:
        ring = self._rings.get(vnodes)
        if ring is None:
            points = sorted((_point(f"{n}#{i}"), n) for n, k in vnodes for i in range(k))
            ring = ([p for p, _ in points], [n for _, n in points])
            if len(self._rings) > 64:  # pools change rarely; keep the memo small
                self._rings.clear()
            self._rings[vnodes] = ring
        return ring

    def _ring_of(self, caps: dict[str, float]) -> tuple[list[int], list[str]]:
        """The ring of instances of these capacities: each has `num_virtual_nodes` x its
        share of the largest capacity points (at least one). Memoised on the capacities,
        which change as rarely as the pool: the last ring first (a dict comparison, cheaper
        than hashing the key; the ring does not depend on the order of `caps`)."""
        if self._last_ring is not None and self._last_ring[0] == caps:
            return self._last_ring[1]
        key = tuple(caps.items())
        ring = self._rings_by_caps.get(key)
        if ring is None:
            top = max(caps.values())
            vnodes = tuple(
                sorted(
                    (n, max(1, round(self.num_virtual_nodes * c / top))) for n, c in caps.items()
                )
            )
            ring = self._ring(vnodes)
            if len(self._rings_by_caps) > 64:
                self._rings_by_caps.clear()
            self._rings_by_caps[key] = ring
        self._last_ring = (caps, ring)
        return ring

    def choose(self, snapshot: RoutingSnapshot, now: float, rng: random.Random) -> Decision:
        views = snapshot.instances
        if not views:
            return Decision((), "empty")
        room = assess(snapshot, now)
        costs = instance_costs(snapshot, now, self._least_load.output_weight, room)
        by_load = decide_by_costs(snapshot, now, costs, rng, room)
        hashes = snapshot.request.block_hashes
        if not hashes:
            return Decision(by_load.ranked, "no_prefix")
        min_match = max(1.0, self.min_match_ratio * len(hashes))
        # (Explicit loops, not comprehensions, on this path: under Python 3.11 each
        # comprehension is a function call, and a pick has a few views.)
        for v in views:
            if v.num_prefix_blocks_matched >= min_match:
                return self._prefix_hit(views, room, costs, by_load)
        # Unseen prefix: bounded-load consistent hashing on the first block, by capacity.
        caps: dict[str, float] = {}  # name -> capacity
        num_in_flight = 0
        fresh_free = False  # some instance has a free slot and fresh metrics
        for v, c, stale, t in zip(views, room.capacity, room.stale, room.tier, strict=True):
            caps[v.name] = c
            num_in_flight += v.num_in_flight
            if t == 0 and not stale:
                fresh_free = True
        points, owners = self._ring_of(caps)
        total_cap = sum(caps.values())
        num_balls = self.load_bound * (num_in_flight + 1)
        # The walk takes the first instance with a free slot (fresh metrics, while any has
        # them) below its share of the load bound: a condition on the instance only, worked
        # out once per instance here, not per ring point.
        open_: set[str] = set()
        for v, stale, t in zip(views, room.stale, room.tier, strict=True):
            if (
                t == 0
                and not (stale and fresh_free)
                and v.num_in_flight < math.ceil(num_balls * caps[v.name] / total_cap)
            ):
                open_.add(v.name)
        if not open_:
            return Decision(by_load.ranked, "hash_overflow")
        # Fibonacci hashing spreads the (32-bit CRC) block hash over the 64-bit ring.
        key = (hashes[0] * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        k = bisect.bisect_left(points, key)
        num_points = len(points)
        while owners[k % num_points] not in open_:  # (every instance owns a point)
            k += 1
        name = owners[k % num_points]
        return Decision((name, *filter(name.__ne__, by_load.ranked)), "hash")

    def _prefix_hit(
        self, views: Sequence[InstanceView], room: Room, costs: list[float], by_load: Decision
    ) -> Decision:
        """A seen prefix: the longest match, unless it would queue there (`spill`) or it has
        far more work per sequence than the least loaded (`imbalance`)."""
        best_i = max(
            range(len(views)),
            key=lambda i: (views[i].num_prefix_blocks_matched, -costs[i], views[i].name),
        )
        best = views[best_i]
        if room.tier[best_i] != 0:  # no free slot: it would queue there; the shortest wait
            return Decision(by_load.ranked, "spill")
        # the guard weighs work per sequence (cost x slots): what each batch has to get
        # through, which slows every sequence in it; capacity already spoke (free slot)
        work = [c * n for c, n in zip(costs, room.num_slots, strict=True)]
        finite = [w for w in work if math.isfinite(w)]
        low = min(finite) if finite else math.inf
        c = work[best_i]
        overloaded = best.is_full or (
            math.isfinite(low)
            and (
                not math.isfinite(c)
                or (c > self.imbalance_ratio * low and c - low > self.imbalance_abs_s)
            )
        )
        if overloaded:
            return Decision(by_load.ranked, "imbalance")
        rest = tuple(n for n in by_load.ranked if n != best.name)
        return Decision((best.name, *rest), "prefix_hit")


register_policy("prefix_affinity", PrefixAffinity)
register_scorer("prefix", PrefixScorer)
