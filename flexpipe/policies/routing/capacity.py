"""Capacity: how much room an instance has, the one place every policy reads it from.

An instance's *slots* are the sequences its engine runs at once (`InstanceView.num_slots`:
vLLM's max_num_seqs, given at registration or reported by the engine), never more than the
gateway's cap on it; unknown slots fall back to the cap, then to 1. Its *capacity* is
slots x weight.

Three tiers, the same for every policy (`rank`):

0. a free slot (fewer requests in flight than slots, and fresh KV usage below
   `MAX_KV_USAGE`): the request starts at once;
1. no free slot but below the gateway's cap: the request would queue in the engine;
2. full (at the cap): the gateway skips it.

A policy's score orders instances within tier 0, so affinity or a low score can never send a
request to queue behind an instance while another has a free slot ("spill before queueing").
Tier 1 is ordered by the expected wait for a slot (`queue_wait`): requests ahead beyond the
slots, over slots x measured per-sequence speed.

Equalising `utilization` ((in flight + 1/2) / capacity) keeps each instance's in-flight count
in proportion to its slots; by Little's law its share of requests is then in proportion to
slots x per-sequence speed: its token throughput. The half is Sainte-Laguë's divisor: it
apportions requests to capacities without favouring large instances (+1, d'Hondt: a 2-slot
instance would get a request only once the others were half full) or small ones (+0: it would
get the second request of an idle pool).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

from flexpipe.policies.routing.views import InstanceView, RoutingSnapshot

NOMINAL_SPEED_TOKENS_PER_S = 100.0  # per sequence, used while no instance has a measured speed
MAX_KV_USAGE = 0.95  # above this (fresh) KV usage the engine has no room for one more sequence


def num_slots(v: InstanceView) -> int:
    """Sequences the instance runs at once: max_num_seqs if known (capped by the gateway's
    limit), else that limit, else 1."""
    n, cap = v.num_slots, v.max_concurrency
    if n > 0:
        return cap if 0 < cap < n else n  # min(n, cap) under a cap
    return cap if cap > 0 else 1


def capacity(v: InstanceView) -> float:
    return num_slots(v) * max(v.weight, 1e-9)


def utilization(v: InstanceView) -> float:
    """The share of its capacity in use, this request counted half (Sainte-Laguë)."""
    return (v.num_in_flight + 0.5) / capacity(v)


def has_free_slot(v: InstanceView, snapshot: RoutingSnapshot, now: float) -> bool:
    if v.num_in_flight >= num_slots(v):
        return False
    return snapshot.is_stale(v, now) or v.kv_usage < MAX_KV_USAGE


def tier(v: InstanceView, snapshot: RoutingSnapshot, now: float) -> int:
    """0: a free slot; 1: would queue in the engine; 2: at the gateway's cap."""
    if v.is_full:
        return 2
    return 0 if has_free_slot(v, snapshot, now) else 1


@dataclass(slots=True)
class Room:
    """Each view's `num_slots`, `capacity`, staleness and `tier`, in view order, worked out
    in one pass (`assess`): a policy and `rank` read each of them several times a pick."""

    num_slots: list[int]
    capacity: list[float]
    stale: list[bool]
    tier: list[int]


def assess(snapshot: RoutingSnapshot, now: float) -> Room:
    """The `Room` of every instance of `snapshot`: `num_slots`, `capacity`,
    `RoutingSnapshot.is_stale` and `tier` of each view, written out in one loop (the
    gateway's and the simulator's hottest: every request, every candidate; calling the
    five functions cost half as much again). tests/policies/test_routing_policies.py checks that it
    agrees with them."""
    room = Room([], [], [], [])
    max_age = snapshot.max_metrics_age_s
    for v in snapshot.instances:
        n, cap = v.num_slots, v.max_concurrency
        slots = (cap if 0 < cap < n else n) if n > 0 else (cap if cap > 0 else 1)
        room.num_slots.append(slots)
        room.capacity.append(slots * max(v.weight, 1e-9))
        scraped_at_s = v.scraped_at_s
        stale = scraped_at_s is None or now - scraped_at_s > max_age
        room.stale.append(stale)
        k = v.num_in_flight
        if 0 < cap <= k:  # full
            room.tier.append(2)
        else:
            room.tier.append(0 if k < slots and (stale or v.kv_usage < MAX_KV_USAGE) else 1)
    return room


def mean_speed(views: Sequence[InstanceView]) -> float:
    """Mean measured per-sequence decode speed (the nominal one while none is measured)."""
    measured = [v.speed_tokens_per_s for v in views if v.speed_tokens_per_s > 0]
    return sum(measured) / len(measured) if measured else NOMINAL_SPEED_TOKENS_PER_S


def queue_wait(v: InstanceView, default_speed: float) -> float:
    """Relative wait for a slot: requests ahead beyond the slots / (capacity x speed)."""
    speed = v.speed_tokens_per_s if v.speed_tokens_per_s > 0 else default_speed
    return max(0, v.num_in_flight + 1 - num_slots(v)) / (capacity(v) * speed)


def rank(
    snapshot: RoutingSnapshot,
    now: float,
    scores: Sequence[float],
    rng: random.Random,
    room: Room | None = None,
) -> tuple[str, ...]:
    """Names by tier, then (tier 1) shortest wait, then highest score; ties by the RNG.
    `room`: the snapshot's `assess`, if the caller has it."""
    views = snapshot.instances
    tiers = (room if room is not None else assess(snapshot, now)).tier
    default: float | None = None  # the mean speed, once an instance would queue
    draw = rng.random
    keyed = []
    for v, s, t in zip(views, scores, tiers, strict=True):
        wait = 0.0
        if t == 1:
            if default is None:
                default = mean_speed(views)
            wait = queue_wait(v, default)
        keyed.append((t, wait, -s, draw(), v.name))
    keyed.sort()
    return tuple(map(itemgetter(4), keyed))
