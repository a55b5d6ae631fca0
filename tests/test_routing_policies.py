"""Every routing policy in isolation, on hand-built snapshots, with exact expected choices."""

from __future__ import annotations

import random

import pytest

from flexpipe.policies import routing
from flexpipe.policies.routing import (
    InstanceView,
    PrefixIndex,
    RoutingRequest,
    RoutingSnapshot,
    create_policy,
    create_scorer,
    prompt_block_hashes,
)
from flexpipe.policies.routing.registry import register_policy

NOW = 100.0


def view(name: str, **kw: object) -> InstanceView:
    kw.setdefault("scraped_at_s", NOW)
    return InstanceView(name=name, **kw)  # type: ignore[arg-type]


def snap(*views: InstanceView, **req: object) -> RoutingSnapshot:
    return RoutingSnapshot(tuple(views), RoutingRequest(**req))  # type: ignore[arg-type]


def rng() -> random.Random:
    return random.Random(0)


def test_public_api_is_deliberate() -> None:
    assert set(routing.__all__) == {
        "Decision", "InstanceView", "PolicyHooks", "PrefixIndex", "RoutingPolicy",
        "RoutingRequest", "RoutingSnapshot", "Scorer", "create_policy", "create_scorer",
        "policy_names", "prompt_block_hashes", "register_policy", "register_scorer",
        "scorer_names",
    }  # fmt: skip


def test_registry_names_and_errors() -> None:
    assert routing.policy_names() == [
        "composite", "least_load", "least_request", "prefix_affinity", "random", "round_robin",
    ]  # fmt: skip
    assert routing.scorer_names() == ["kv", "least_request", "load", "prefix", "queue"]
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        create_policy("nope")
    with pytest.raises(ValueError, match="bad parameters"):
        create_policy("least_load", speed=3)
    with pytest.raises(ValueError, match="already registered"):
        register_policy("round_robin", lambda: create_policy("random"))


def test_round_robin_rotates_in_name_order_and_skips_full() -> None:
    p = create_policy("round_robin")
    s = snap(view("b"), view("a"), view("c"))
    assert [p.choose(s, NOW, rng()).best for _ in range(4)] == ["a", "b", "c", "a"]
    full = snap(view("a", num_in_flight=2, max_concurrency=2), view("b"), view("c"))
    assert p.choose(full, NOW, rng()).ranked == ("b", "c", "a")  # position 4 starts at b


def test_random_is_reproducible_and_weighted() -> None:
    p = create_policy("random")
    s = snap(view("a", weight=3.0), view("b", weight=1.0))
    picks = [p.choose(s, NOW, random.Random(i)).best for i in range(2000)]
    assert picks == [p.choose(s, NOW, random.Random(i)).best for i in range(2000)]
    share_a = picks.count("a") / len(picks)
    assert 0.70 < share_a < 0.80  # 3:1 weights -> 75 %


def test_least_request_counts_in_flight_per_weight() -> None:
    p = create_policy("least_request")
    s = snap(view("a", num_in_flight=4), view("b", num_in_flight=3), view("c", num_in_flight=5))
    assert p.choose(s, NOW, rng()).ranked == ("b", "a", "c")
    heavy = snap(view("a", num_in_flight=4, weight=2.0), view("b", num_in_flight=3))
    assert p.choose(heavy, NOW, rng()).best == "a"  # 4 / 2 < 3 / 1


def test_least_load_normalises_by_speed() -> None:
    p = create_policy("least_load")
    # same queue, b is twice as fast -> b; a's queue is half of b's but b is 4x faster -> b
    s = snap(
        view("a", num_queued_tokens=1000, speed_tokens_per_s=10),
        view("b", num_queued_tokens=1000, speed_tokens_per_s=20),
        num_prompt_tokens=100,
        num_expected_output_tokens=100,
    )
    assert p.choose(s, NOW, rng()).ranked == ("b", "a")
    s2 = snap(
        view("a", num_queued_tokens=500, speed_tokens_per_s=10),
        view("b", num_queued_tokens=1000, speed_tokens_per_s=40),
    )
    assert p.choose(s2, NOW, rng()).best == "b"  # 500/10 = 50 s > 1000/40 = 25 s
    scores = create_scorer("load").score(s2, NOW, rng())
    assert scores == pytest.approx([0.5, 1.0])


def test_least_load_treats_stale_metrics_as_saturated() -> None:
    p = create_policy("least_load")
    s = snap(
        view("idle-but-stale", num_queued_tokens=0, scraped_at_s=NOW - 60),
        view("busy", num_queued_tokens=5000),
        view("never", scraped_at_s=None),
    )
    d = p.choose(s, NOW, rng())
    assert d.best == "busy" and d.reason == "least_cost"
    all_stale = snap(view("a", scraped_at_s=None, num_in_flight=3), view("b", scraped_at_s=None))
    d = p.choose(all_stale, NOW, rng())
    assert (d.best, d.reason) == ("b", "stale_metrics")


def test_least_load_unmeasured_speed_gets_mean_of_measured() -> None:
    p = create_policy("least_load")
    s = snap(
        view("new", num_queued_tokens=1000),
        view("fast", num_queued_tokens=1000, speed_tokens_per_s=30),
        view("slow", num_queued_tokens=1000, speed_tokens_per_s=10),
    )
    assert p.choose(s, NOW, rng()).ranked == ("fast", "new", "slow")


def test_prefix_index_lru_and_chain() -> None:
    idx = PrefixIndex(max_blocks_per_instance=4)
    h = prompt_block_hashes(b"x" * 64 * 3 + b"tail", 64)
    assert len(h) == 3 and len(set(h)) == 3
    idx.insert("a", h)
    assert idx.match("a", h) == 3 and idx.match("b", h) == 0
    other = prompt_block_hashes(b"x" * 64 + b"y" * 128, 64)
    assert idx.match("a", other) == 1  # shares only the first block
    idx.insert("a", other)  # 5 distinct blocks > 4: the least recently used one goes
    assert idx.num_blocks("a") == 4
    assert idx.match("a", h) == 1  # h[1] evicted; the chain stops there


def test_prefix_affinity_prefers_longest_match() -> None:
    p = create_policy("prefix_affinity")
    hashes = (1, 2, 3, 4)
    s = snap(
        view("a", num_prefix_blocks_matched=1),
        view("b", num_prefix_blocks_matched=4, num_queued_tokens=100, speed_tokens_per_s=100),
        view("c", speed_tokens_per_s=100),
        block_hashes=hashes,
    )
    d = p.choose(s, NOW, rng())
    assert (d.best, d.reason) == ("b", "prefix_hit")


def test_prefix_affinity_imbalance_guard_falls_back_to_least_load() -> None:
    p = create_policy("prefix_affinity", imbalance_ratio=2.0, imbalance_abs_s=1.0)
    s = snap(
        view("hot", num_prefix_blocks_matched=4, num_queued_tokens=100_000, speed_tokens_per_s=100),
        view("cold", num_queued_tokens=0, speed_tokens_per_s=100),
        block_hashes=(1, 2, 3, 4),
    )
    d = p.choose(s, NOW, rng())
    assert (d.best, d.reason) == ("cold", "imbalance")


def test_prefix_affinity_unseen_prefix_uses_bounded_consistent_hash() -> None:
    p = create_policy("prefix_affinity")
    views = [view(n) for n in ("a", "b", "c", "d")]
    firsts = {}
    for key in range(40):
        s = snap(*views, block_hashes=(key * 7919, 1))
        d = p.choose(s, NOW, rng())
        assert d.reason == "hash"
        firsts[key] = d.best
        assert p.choose(s, NOW, random.Random(99)).best == d.best  # same key, same home
    assert len(set(firsts.values())) == 4  # keys spread over the ring
    # the home instance is over the load bound -> the next one on the ring
    key_home = firsts[0]
    loaded = [view(v.name, num_in_flight=10 if v.name == key_home else 0) for v in views]
    d = p.choose(snap(*loaded, block_hashes=(0, 1)), NOW, rng())
    assert d.best != key_home and d.reason == "hash"


def test_queue_and_kv_scorers() -> None:
    s = snap(
        view("a", num_waiting=0, kv_usage=0.9),
        view("b", num_waiting=10, kv_usage=0.1),
        view("c", num_waiting=5, kv_usage=0.5, scraped_at_s=NOW - 100),
    )
    assert create_scorer("queue").score(s, NOW, rng()) == [1.0, 0.0, 0.0]
    assert create_scorer("kv").score(s, NOW, rng()) == pytest.approx([0.1, 0.9, 0.0])


def test_composite_weighs_scorers_and_names_the_main_reason() -> None:
    p = create_policy("composite", weights={"prefix": 3, "queue": 2, "kv": 2})
    s = snap(
        view("cached", num_prefix_blocks_matched=4, num_waiting=3, kv_usage=0.5),
        view("empty", num_waiting=0, kv_usage=0.0),
        block_hashes=(1, 2, 3, 4),
    )
    # cached: 3*1 + 2*0 + 2*0.5 = 4; empty: 0 + 2*1 + 2*1 = 4 -> tie broken by rng; tilt it:
    s2 = snap(
        view("cached", num_prefix_blocks_matched=4, num_waiting=3, kv_usage=0.4),
        view("empty", num_waiting=0, kv_usage=0.0),
        block_hashes=(1, 2, 3, 4),
    )
    d = p.choose(s2, NOW, rng())
    assert (d.best, d.reason) == ("cached", "prefix")
    only_load = create_policy("composite", weights={"queue": 1})
    assert only_load.choose(s, NOW, rng()).ranked == ("empty", "cached")
    with pytest.raises(ValueError):
        create_policy("composite", weights={"prefix": -1})


def test_full_instances_rank_last_everywhere() -> None:
    s = snap(
        view("full", max_concurrency=1, num_in_flight=1, num_prefix_blocks_matched=4),
        view("free", num_queued_tokens=10_000),
        block_hashes=(1, 2, 3, 4),
    )
    for name in routing.policy_names():
        d = create_policy(name).choose(s, NOW, rng())
        assert d.ranked[-1] == "full", name
