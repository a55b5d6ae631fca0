"""The gateway's router core, stepped by hand: exact picks, holds and ejections at `now`."""

from __future__ import annotations

import random

import pytest

from flexpipe.gateway.config import GatewayConfig
from flexpipe.gateway.core.pool import Pool, TransitionError
from flexpipe.gateway.core.router import NoInstance, Router
from flexpipe.lifecycle import State
from flexpipe.policies.routing import RoutingRequest

A, B, C = "http://a", "http://b", "http://c"


def make(policy: str = "round_robin", **cfg: object) -> Router:
    config = GatewayConfig(policy=policy, **cfg)  # type: ignore[arg-type]
    pool = Pool(default_max_concurrency=2)
    for url in (A, B, C):
        pool.add(url, "m")
    return Router(config, pool, random.Random(0))


REQ = RoutingRequest(num_prompt_tokens=10, num_expected_output_tokens=20)


def test_failed_instances_are_never_picked_again_busy_ones_only_as_a_last_resort() -> None:
    r = make()
    for _ in range(6):
        pick = r.pick("m", REQ, 0.0, failed={A, B})
        assert pick is not None and pick.instance.url == C
    pick = r.pick("m", REQ, 0.0, excluded={A, B, C}, failed={A, B})
    assert pick is not None and pick.instance.url == C  # busy: still better than nothing
    with pytest.raises(NoInstance):
        r.pick("m", REQ, 0.0, failed={A, B, C})
    with pytest.raises(NoInstance):
        r.pick("other-model", REQ, 0.0)


def test_full_instances_are_skipped_and_none_means_queue() -> None:
    r = make()
    held = []
    for _ in range(6):  # 3 instances x 2 slots
        pick = r.pick("m", REQ, 0.0)
        assert pick is not None
        r.acquire(pick.instance, 30)
        held.append(pick.instance)
    assert sorted(i.url for i in held) == [A, A, B, B, C, C]
    assert r.pick("m", REQ, 0.0) is None
    r.finish(held[0], 30, 1.0)
    pick = r.pick("m", REQ, 1.0)
    assert pick is not None and pick.instance is held[0]


def test_acquire_and_finish_balance_the_load_counters() -> None:
    r = make()
    inst = r.pool.get(A)
    for _ in range(5):
        r.acquire(inst, 100)
    for t in range(5):
        r.finish(inst, 100, float(t))
    assert inst.num_in_flight == 0
    assert inst.num_tokens_sent_since_scrape == 0
    assert r.drain_rate.rate(4.0) > 0


def test_passive_failures_eject_after_the_threshold_and_success_resets() -> None:
    r = make(eject_after_failures=2, eject_base_backoff_s=1.0)
    inst = r.pool.get(B)
    assert r.failed(inst, 10.0) is False
    r.succeeded(inst)
    assert r.failed(inst, 10.0) is False
    assert r.failed(inst, 10.5) is True
    assert not inst.healthy and inst.ejected_until_s == 11.5
    assert inst.state is State.ACTIVE  # health is not a lifecycle state
    pick = r.pick("m", REQ, 10.5)
    assert pick is not None and pick.instance.url != B


def test_retry_after_follows_the_measured_drain_rate() -> None:
    r = make()
    assert r.retry_after_s(5, 0.0) == 60.0  # nothing finished yet: the cap
    inst = r.pool.get(A)
    for i in range(1, 2001):  # 10 per second for 200 s
        r.acquire(inst, 1)
        r.finish(inst, 1, i / 10)
    assert r.retry_after_s(49, 200.0) == pytest.approx(5.0, rel=0.01)


def test_an_instance_view_carries_each_field_under_its_own_name() -> None:
    # Instance.view builds the view positionally (the routing path's hottest allocation).
    pool = Pool(256)
    inst = pool.add("http://a", model="m", max_num_seqs=48)
    inst.weight, inst.num_in_flight, inst.num_running, inst.num_waiting = 2.5, 7, 5, 3
    inst.kv_usage, inst.speed_tokens_per_s, inst.scraped_at_s = 0.25, 41.0, 12.5
    inst.num_scraped_tokens, inst.num_tokens_sent_since_scrape = 900.0, 100.0
    v = inst.view(9)
    assert (v.name, v.weight, v.num_in_flight, v.max_concurrency, v.num_slots) == (
        "http://a",
        2.5,
        7,
        inst.max_concurrency,
        48,
    )
    assert (v.num_running, v.num_waiting, v.kv_usage, v.num_queued_tokens) == (5, 3, 0.25, 1000.0)
    assert (v.speed_tokens_per_s, v.scraped_at_s, v.num_prefix_blocks_matched) == (41.0, 12.5, 9)
    assert inst.max_concurrency not in (48, 0, 256)  # max_num_seqs + its allowance: distinct
    # the properties it writes out: slots from the KV cache when max_num_seqs is unknown,
    # queued tokens never below zero
    inst.max_num_seqs, inst.num_kv_slots, inst.num_tokens_sent_since_scrape = 0, 5, -950.0
    v = inst.view()
    assert (v.num_slots, v.num_queued_tokens) == (inst.num_slots, inst.num_queued_tokens) == (5, 0)


def test_a_move_destination_takes_new_requests_only_when_no_other_has_a_slot() -> None:
    r = make()  # round robin over A, B, C; 2 slots each
    r.pool.fence(B, "move-1", until_s=5.0, now=1.0)
    r.pool.fence(B, "move-2", until_s=4.0, now=1.0)  # two moves: fenced until both end
    assert r.pool.instances[B].fenced_until_s == 5.0 and r.pool.fenced_until_s == 5.0
    held = []
    for _ in range(4):  # B is never taken while A or C has a slot
        pick = r.pick("m", REQ, 1.0)
        assert pick is not None and pick.instance.url != B
        r.acquire(pick.instance, 30)
        held.append(pick.instance.url)
    assert sorted(held) == [A, A, C, C]
    pick = r.pick("m", REQ, 1.0)  # A and C full: the fenced one rather than a queue
    assert pick is not None and pick.instance.url == B
    # a move's own request goes there (the controller chose it), fenced or not
    moved = r.pick("m", REQ, 1.0, prefer=B)
    assert moved is not None and (moved.instance.url, moved.reason) == (B, "moved")


def test_a_fence_ends_at_its_time_or_when_its_stream_has_its_first_token_there() -> None:
    r = make()
    r.pool.fence(A, "move-1", until_s=2.0, now=1.0)
    assert {r.pick("m", REQ, 1.9).instance.url for _ in range(4)} == {B, C}  # type: ignore[union-attr]
    assert {r.pick("m", REQ, 2.0).instance.url for _ in range(3)} == {A, B, C}  # type: ignore[union-attr]
    r.pool.fence(A, "move-2", until_s=9.0, now=3.0)  # the ended fence is dropped
    assert r.pool.instances[A].fences == {"move-2": 9.0}
    r.pool.unfence(A, "move-2")  # its first token came on A
    assert r.pool.instances[A].fenced_until_s == 0.0
    assert {r.pick("m", REQ, 3.5).instance.url for _ in range(3)} == {A, B, C}  # type: ignore[union-attr]
    r.pool.unfence(A, "move-2")  # twice, or on an instance gone: nothing
    r.pool.unfence("http://gone", "move-3")


def test_the_failure_blacklist_forgets_failures_older_than_the_last_success() -> None:
    """The blacklist counts an instance's failures since its last success: the window slides
    with each success, and the failures before it leave. Failures spread over time, a
    success after every two: never three in a row, never ejected (eject_after_failures=3).
    Three in a row: ejected for the base backoff; ejected again with no success between,
    the backoff doubles; a success resets both."""
    r = make(eject_after_failures=3, eject_base_backoff_s=1.0, eject_max_backoff_s=30.0)
    inst = r.pool.get(B)
    ejected = []
    for t in (0.0, 60.0, 120.0, 180.0, 240.0, 300.0):
        ejected.append(r.failed(inst, t))
        if t in (60.0, 180.0):
            r.succeeded(inst)  # the two failures before it leave the window
    assert ejected == [False] * 6 and inst.healthy and inst.num_consecutive_failures == 2
    assert r.failed(inst, 301.0) is True  # the third in a row
    assert not inst.healthy and inst.ejected_until_s == 302.0
    r.pool.readmit(inst)  # a probe answered: back, with an empty window
    assert [r.failed(inst, 400.0) for _ in range(3)] == [False, False, True]
    assert inst.ejected_until_s == 402.0  # no success since the last ejection: doubled
    r.pool.readmit(inst)
    r.succeeded(inst)
    assert [r.failed(inst, 500.0) for _ in range(3)] == [False, False, True]
    assert inst.ejected_until_s == 501.0


def test_a_health_probe_that_answers_empties_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Passive failures and probes share the window: two failures, a probe that answers,
    two more failures: not ejected (three were needed in a row)."""
    import asyncio

    from flexpipe.gateway.app import Gateway
    from flexpipe.gateway.config import config_from_dict
    from flexpipe.gateway.prober import Prober

    async def answers(self: Prober, inst: object, path: str) -> tuple[int, bytes]:
        return 200, b""

    monkeypatch.setattr(Prober, "_get", answers)

    async def scenario() -> tuple[bool, int]:
        gw = Gateway(config_from_dict({
            "backends": [{"url": A, "model": "m"}], "eject_after_failures": 3,
        }))  # fmt: skip
        inst = gw.pool.get(A)
        gw.failure(inst)
        gw.failure(inst)
        await gw.prober.probe(inst)
        gw.failure(inst)
        gw.failure(inst)
        await gw.close()
        return inst.healthy, inst.num_consecutive_failures

    assert asyncio.run(scenario()) == (True, 2)


def test_an_asleep_or_waking_instance_is_never_routed_to() -> None:
    r = make()
    r.pool.set_state(A, State.ASLEEP)
    picks = set()
    for _ in range(6):
        pick = r.pick("m", REQ, 0.0)
        assert pick is not None
        picks.add(pick.instance.url)
    assert picks == {B, C}
    r.pool.set_state(A, State.WAKING)
    r.pool.set_state(B, State.DRAINING)
    r.pool.set_state(B, State.ASLEEP)
    for _ in range(4):
        pick = r.pick("m", REQ, 0.0)
        assert pick is not None and pick.instance.url == C
    with pytest.raises(TransitionError, match="asleep → active"):
        r.pool.set_state(B, State.ACTIVE)  # it wakes first
    r.pool.set_state(A, State.ACTIVE)
    assert {r.pick("m", REQ, 0.0).instance.url for _ in range(4)} == {A, C}  # type: ignore[union-attr]
