"""Every routing policy in isolation, on hand-built snapshots, with exact expected choices."""

from __future__ import annotations

import random
import zlib
from collections import OrderedDict

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
from flexpipe.policies.routing.prefix_index import chain_block_hashes
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


def test_an_idle_one_slot_instance_wins_over_a_four_slot_one_half_full() -> None:
    """Sainte-Lagues divisor (`capacity.utilization`: the request counted half): an idle
    one-slot instance is at (0 + 0.5) / 1 = 0.5, a four-slot one with two in flight at
    (2 + 0.5) / 4 = 0.625, so the idle one takes the request. With d'Hondt's +1 it would be
    1 / 1 against 3 / 4, and a one-slot instance idled while larger ones were half full.
    Both policies that read utilization, with fresh metrics and (least_load) stale ones."""
    from flexpipe.policies.routing.capacity import utilization

    one = view("one", num_slots=1, max_concurrency=4)
    four = view("four", num_slots=4, max_concurrency=4, num_in_flight=2)
    assert (utilization(one), utilization(four)) == (0.5, 0.625)
    d = create_policy("least_request").choose(snap(four, one), NOW, rng())
    assert d.ranked == ("one", "four")
    assert create_scorer("least_request").score(snap(four, one), NOW, rng()) == [0.8, 1.0]
    stale = [
        view(v.name, num_slots=v.num_slots, max_concurrency=4, num_in_flight=v.num_in_flight,
             scraped_at_s=None)
        for v in (four, one)
    ]  # fmt: skip
    d = create_policy("least_load").choose(snap(*stale), NOW, rng())
    assert (d.ranked, d.reason) == (("one", "four"), "stale_metrics")


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


def test_block_hashes_chain_crc32_with_the_index_above() -> None:
    """Each block's hash: CRC-32 of it continuing the previous one's, its index in the upper
    bits; the same past the indices made in advance (4096)."""
    text = bytes(random.Random(3).randrange(256) for _ in range(64 * 5000 + 7))
    expected, h = [], 0
    for i in range(5000):
        h = zlib.crc32(text[64 * i : 64 * (i + 1)], h)
        expected.append((i << 32) | h)
    assert prompt_block_hashes(text, 64) == tuple(expected)
    assert prompt_block_hashes(text[:63], 64) == ()


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
    assert idx.match("a", h) == 2  # h's tail went: its prefix stays whole
    assert idx.match("a", other) == 3


def _chained_prompts(rng: random.Random, num: int) -> list[tuple[int, ...]]:
    """Prompts of 0-11 blocks from a small alphabet: they share, repeat, extend and end
    inside each other's runs."""
    return [
        chain_block_hashes(
            bytes([rng.choice(b"ab" if i < 4 else b"abc")]) * 8 for i in range(rng.randrange(12))
        )
        for _ in range(num)
    ]


def test_prefix_index_is_an_exact_lru() -> None:
    """Against an `OrderedDict` LRU of blocks, where an insertion uses a prompt's blocks
    deepest first: the same blocks, in the same use order, the same matches; over bounds
    with many evictions and with none."""
    rng = random.Random(7)
    for bound in (5, 20, 60, 10_000):
        idx, ref = PrefixIndex(max_blocks_per_instance=bound), OrderedDict[int, None]()
        for hashes in _chained_prompts(rng, 3000):
            assert idx.match("a", hashes) == next(
                (n for n, h in enumerate(hashes) if h not in ref), len(hashes)
            )
            idx.insert("a", hashes)
            for h in reversed(hashes):
                ref[h] = None
                ref.move_to_end(h)
            while len(ref) > bound:
                ref.popitem(last=False)
            assert idx.num_blocks("a") == len(ref)
            tree = idx._trees["a"]
            assert [h for node in tree.lru for h in reversed(node.hashes)] == list(ref)
        if bound > len(ref):  # no eviction so far: evict all but the 10 most recent, in order
            idx.max_blocks_per_instance = 10
            idx.insert("a", ())
            assert [h for node in idx._trees["a"].lru for h in reversed(node.hashes)] == list(ref)[
                -10:
            ]
        idx.remove_instance("a")
        assert idx.num_blocks("a") == 0 and idx.instances() == []


def test_prefix_index_keeps_an_unshared_prompt_in_one_node() -> None:
    """What makes it cheap: prompts that share nothing are one node each, and a prompt that
    shares a prefix adds one node for its own part and splits the shared run once."""
    idx = PrefixIndex()
    prompts = [prompt_block_hashes(bytes([65 + i]) * 64 * 30, 64) for i in range(20)]
    for h in prompts:
        idx.insert("a", h)
    tree = idx._trees["a"]
    assert len(tree.lru) == 20 and idx.num_blocks("a") == 600
    follow_up = prompt_block_hashes(b"A" * 64 * 10 + b"z" * 64 * 5, 64)
    idx.insert("a", follow_up)
    assert len(tree.lru) == 22 and idx.num_blocks("a") == 605
    assert idx.match("a", follow_up) == 15 and idx.match("a", prompts[0]) == 30


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


def test_prefix_affinity_hash_takes_fresh_free_instances_first() -> None:
    p = create_policy("prefix_affinity")
    views = [view(n) for n in ("a", "b", "c", "d")]
    home = p.choose(snap(*views, block_hashes=(0, 1)), NOW, rng()).best
    stale_home = [view(v.name, scraped_at_s=NOW - 60 if v.name == home else NOW) for v in views]
    d = p.choose(snap(*stale_home, block_hashes=(0, 1)), NOW, rng())
    assert d.best != home and d.reason == "hash"  # a fresh one with a free slot is there
    all_stale = [view(v.name, scraped_at_s=NOW - 60) for v in views]
    d = p.choose(snap(*all_stale, block_hashes=(0, 1)), NOW, rng())
    assert (d.best, d.reason) == (home, "hash")  # none is fresh: the stale home
    busy = [view(v.name, num_slots=1, num_in_flight=1) for v in views]
    assert p.choose(snap(*busy, block_hashes=(0, 1)), NOW, rng()).reason == "hash_overflow"


def test_prefix_affinity_ring_follows_the_capacities() -> None:
    """The ring is memoised on the capacities: one policy over changing pools chooses as a
    new policy does for each."""
    p = create_policy("prefix_affinity")
    pools = [
        [view("a"), view("b"), view("c")],
        [view("a", weight=4.0), view("b"), view("c")],
        [view("c"), view("a"), view("b")],
        [view("a"), view("b")],
        [view("a"), view("b"), view("c")],
    ]
    for views in pools * 2:
        for key in range(30):
            s = snap(*views, block_hashes=(key * 7919, 1))
            assert p.choose(s, NOW, rng()) == create_policy("prefix_affinity").choose(s, NOW, rng())


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


# ---------------------------------------------------------------- capacity
# The seed's example pool (examples/clusters/fragmented-4gpu.yaml, `flexpipe up`): caps as the
# gateway derives them from max_num_seqs (slots + slots // 8).
EXAMPLE_SLOTS = {"tp2-a100": 48, "l40s": 16, "l4": 2}
EXAMPLE_CAPS = {"tp2-a100": 54, "l40s": 18, "l4": 2}


def example_views(in_flight: dict[str, int], **kw: object) -> list[InstanceView]:
    return [
        view(
            n,
            num_slots=EXAMPLE_SLOTS[n],
            max_concurrency=EXAMPLE_CAPS[n],
            num_in_flight=in_flight.get(n, 0),
            num_queued_tokens=640.0 * in_flight.get(n, 0),
            **kw,
        )
        for n in EXAMPLE_SLOTS
    ]


def test_capacity_tiers_free_slot_then_queue_by_wait_then_full() -> None:
    from flexpipe.policies.routing import capacity as cap

    s = snap(
        view("free", num_slots=4, max_concurrency=5, num_in_flight=3),
        view("kv-full", num_slots=4, max_concurrency=5, num_in_flight=0, kv_usage=0.97),
        view("queues", num_slots=4, max_concurrency=5, num_in_flight=4),
        view("full", num_slots=4, max_concurrency=5, num_in_flight=5),
        view("unknown", max_concurrency=8, num_in_flight=7),  # slots = the cap
    )
    assert [cap.tier(v, s, NOW) for v in s.instances] == [0, 1, 1, 2, 0]
    assert [cap.num_slots(v) for v in s.instances] == [4, 4, 4, 4, 8]
    # kv-full waits for (0 + 1 - 4) -> 0 requests ahead, queues for 1: kv-full first
    assert cap.rank(s, NOW, [0.0] * 5, rng())[2:] == ("kv-full", "queues", "full")
    stale_kv = snap(view("a", num_slots=2, kv_usage=0.99, scraped_at_s=NOW - 60))
    assert cap.tier(stale_kv.instances[0], stale_kv, NOW) == 0  # stale KV usage is not trusted
    # when all queue, the shortest expected wait wins: 1 ahead of 48 slots, not 1 ahead of 2
    all_busy = snap(*example_views({"tp2-a100": 48, "l40s": 16, "l4": 2}))
    assert cap.rank(all_busy, NOW, [0.0, 0.0, 1.0], rng()) == ("tp2-a100", "l40s", "l4")


def test_assess_agrees_with_the_per_view_capacity_functions() -> None:
    """`capacity.assess` writes num_slots, capacity, staleness and tier out in one loop (the
    hot path): on every combination of the fields they read, the same values."""
    import itertools

    from flexpipe.policies.routing import capacity as cap

    fields = itertools.product(
        (0, 1, 4, 9),  # num_slots
        (0, 1, 4, 6),  # max_concurrency
        (0, 1, 3, 4, 5, 6, 9),  # num_in_flight
        (0.5, 0.95, 0.99),  # kv_usage
        (1.0, 2.5, 0.0),  # weight
        (None, NOW, NOW - 5.0, NOW - 5.5),  # scraped_at_s (max age 5)
    )
    views = [
        view(f"v{i}", num_slots=n, max_concurrency=c, num_in_flight=k, kv_usage=kv, weight=w,
             scraped_at_s=at)
        for i, (n, c, k, kv, w, at) in enumerate(fields)
    ]  # fmt: skip
    s = snap(*views)
    room = cap.assess(s, NOW)
    assert room.num_slots == [cap.num_slots(v) for v in views]
    assert room.capacity == [cap.capacity(v) for v in views]
    assert room.stale == [s.is_stale(v, NOW) for v in views]
    assert room.tier == [cap.tier(v, s, NOW) for v in views]
    assert [t == 0 for t in room.tier] == [cap.has_free_slot(v, s, NOW) for v in views]
    assert sorted(set(room.tier)) == [0, 1, 2] and any(room.stale) and not all(room.stale)


def _steady_state_shares(
    policy_name: str, concurrency: int, num_steps: int = 1500
) -> tuple[dict[str, float], dict[str, int]]:
    """Route `num_steps` requests with `concurrency` in flight (each completion picks one
    request uniformly: equal service times); shares of requests and peak in flight."""
    p = create_policy(policy_name)
    r = random.Random(7)
    live: list[str] = []  # instance of each request in flight
    picks = dict.fromkeys(EXAMPLE_SLOTS, 0)
    peak = dict.fromkeys(EXAMPLE_SLOTS, 0)
    for step in range(num_steps):
        if len(live) >= concurrency:
            live.pop(r.randrange(len(live)))
        counts = {n: live.count(n) for n in EXAMPLE_SLOTS}
        s = snap(
            *example_views(counts, speed_tokens_per_s=25.0),
            num_prompt_tokens=512,
            num_expected_output_tokens=128,
            block_hashes=(step * 7919 + 13, step),  # a new prefix each time
        )
        ranked = p.choose(s, NOW, r).ranked
        name = next(n for n in ranked if counts[n] < EXAMPLE_CAPS[n])
        live.append(name)
        picks[name] += 1
        peak[name] = max(peak[name], counts[name] + 1)
    return {n: c / num_steps for n, c in picks.items()}, peak


@pytest.mark.parametrize("policy_name", routing.policy_names())
@pytest.mark.parametrize("concurrency", [8, 32, 60])
def test_every_policy_shares_requests_by_capacity(policy_name: str, concurrency: int) -> None:
    shares, peak = _steady_state_shares(policy_name, concurrency)
    total = sum(EXAMPLE_SLOTS.values())
    for name, slots in EXAMPLE_SLOTS.items():
        assert shares[name] <= 1.5 * slots / total + 0.01, (name, shares)
    assert shares["tp2-a100"] >= 0.65  # its fair share is 48/66 = 0.73
    assert peak["l4"] <= 2  # below the pool's capacity the small instance never queues
    if concurrency <= 32:  # the old prefix_affinity sent 16 % here (hashing, no capacity)
        assert shares["l4"] <= 0.05, shares


def test_least_request_fills_slots_in_proportion() -> None:
    p = create_policy("least_request")
    counts = dict.fromkeys(EXAMPLE_SLOTS, 0)
    for _ in range(33):  # half the pool's 66 slots
        name = p.choose(snap(*example_views(counts)), NOW, rng()).best
        assert name is not None
        counts[name] += 1
    assert counts == {"tp2-a100": 24, "l40s": 8, "l4": 1}


def test_round_robin_turns_in_proportion_to_capacity() -> None:
    p = create_policy("round_robin")
    s = snap(view("a", num_slots=3, max_concurrency=9), view("b", num_slots=1, max_concurrency=9))
    assert [p.choose(s, NOW, rng()).best for _ in range(8)] == list("aabaaaba")


def test_random_draws_in_proportion_to_capacity() -> None:
    p = create_policy("random")
    s = snap(view("a", num_slots=48, max_concurrency=64), view("b", num_slots=16))
    picks = [p.choose(s, NOW, random.Random(i)).best for i in range(2000)]
    assert 0.70 < picks.count("a") / len(picks) < 0.80  # 48 : 16 -> 75 %


def test_least_load_divides_work_by_slots() -> None:
    p = create_policy("least_load")
    # 10 requests of work on 48 slots drain faster than 1 on 2 slots
    s = snap(
        view("big", num_slots=48, max_concurrency=54, num_in_flight=10, num_queued_tokens=6400),
        view("small", num_slots=2, max_concurrency=2, num_in_flight=1, num_queued_tokens=640),
        num_prompt_tokens=512,
        num_expected_output_tokens=128,
    )
    d = p.choose(s, NOW, rng())
    assert d.ranked == ("big", "small")
    # (6400 + 640) / (100 x 48) = 1.47 s against (640 + 640) / (100 x 2) = 6.4 s
    scores = create_scorer("load").score(s, NOW, rng())
    assert scores == pytest.approx([1.0, (7040 / 4800) / (1280 / 200)])


def test_prefix_affinity_spills_from_a_cached_instance_without_a_free_slot() -> None:
    p = create_policy("prefix_affinity")
    hashes = (1, 2, 3, 4)
    busy = snap(
        view("l4", num_slots=2, max_concurrency=3, num_in_flight=2, num_prefix_blocks_matched=4),
        view("a100", num_slots=48, max_concurrency=54, num_in_flight=30),
        block_hashes=hashes,
    )
    d = p.choose(busy, NOW, rng())
    assert (d.best, d.reason) == ("a100", "spill")
    idle = snap(
        view("l4", num_slots=2, max_concurrency=3, num_in_flight=1, num_prefix_blocks_matched=4),
        view("a100", num_slots=48, max_concurrency=54, num_in_flight=30),
        block_hashes=hashes,
    )
    assert (p.choose(idle, NOW, rng()).best, p.choose(idle, NOW, rng()).reason) == (
        "l4",
        "prefix_hit",
    )


def test_prefix_affinity_ring_points_follow_capacity() -> None:
    p = create_policy("prefix_affinity")
    views = [view("big", num_slots=48, max_concurrency=54), view("small", num_slots=2)]
    homes = [
        p.choose(snap(*views, block_hashes=(k * 7919, 1)), NOW, rng()).best for k in range(400)
    ]
    # 64 ring points against 3 (48 : 2 slots): the small instance is home to ~4 % of prefixes
    assert homes.count("small") / len(homes) < 0.10
    assert homes.count("small") > 0


def test_composite_prefix_never_outweighs_a_queue() -> None:
    p = create_policy("composite", weights={"prefix": 10, "load": 1})
    s = snap(
        view(
            "cached", num_slots=2, max_concurrency=3, num_in_flight=2, num_prefix_blocks_matched=4
        ),
        view("cold", num_slots=16, max_concurrency=18, num_in_flight=15),
        block_hashes=(1, 2, 3, 4),
    )
    assert p.choose(s, NOW, rng()).ranked == ("cold", "cached")


def test_prefix_affinity_guard_weighs_work_per_sequence_not_per_slot() -> None:
    """Many free slots do not make a growing batch free: 20 requests' work on the cached
    instance against none elsewhere is an imbalance whatever the slots (without it every
    session funnels onto the instance that first saw its system prompt)."""
    p = create_policy("prefix_affinity")
    s = snap(
        view("cached", num_slots=256, max_concurrency=256, num_in_flight=20,
             num_queued_tokens=12_000, speed_tokens_per_s=100, num_prefix_blocks_matched=4),
        view("idle", num_slots=256, max_concurrency=256, speed_tokens_per_s=100),
        block_hashes=(1, 2, 3, 4), num_prompt_tokens=500, num_expected_output_tokens=100,
    )  # fmt: skip
    d = p.choose(s, NOW, rng())
    assert (d.best, d.reason) == ("idle", "imbalance")  # (12000 + 600) / 100 s against 6 s
    light = snap(
        view("cached", num_slots=256, max_concurrency=256, num_in_flight=1,
             num_queued_tokens=100, speed_tokens_per_s=100, num_prefix_blocks_matched=4),
        view("idle", num_slots=256, max_concurrency=256, speed_tokens_per_s=100),
        block_hashes=(1, 2, 3, 4), num_prompt_tokens=500, num_expected_output_tokens=100,
    )  # fmt: skip
    d = p.choose(light, NOW, rng())
    assert (d.best, d.reason) == ("cached", "prefix_hit")  # 7 s against 6 s
