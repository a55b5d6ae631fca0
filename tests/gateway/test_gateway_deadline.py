"""Deadline-aware admission (flexpipe/gateway/core/deadline.py, docs/gateway.md): exact tests of
the pure pieces on a fake clock (the slack estimate, least slack first with the tenant fair
share as tie-break, the shed rule at the margin's edge, every exit leaving the queue empty),
and the live gateway over real HTTP with the official `openai` client: the order a one-slot
instance serves queued requests in, and a 429 with Retry-After for one that cannot make its
TTFT SLO."""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from test_gateway_api import Running
from test_gateway_fakes import FakeEngine, LoopThread

from flexpipe.gateway.config import AdmissionConfig, ConfigError, config_from_dict
from flexpipe.gateway.core.admission import ROUTE, Fail, Queue, admit
from flexpipe.gateway.core.deadline import (
    Deadlines,
    FairShare,
    ServiceRates,
    Shed,
    expected_wait_s,
    is_late,
    rank,
    slack_s,
)
from flexpipe.gateway.core.holds import Holds
from flexpipe.gateway.core.wait_queue import WaitQueue


def test_slack_is_the_deadline_less_now_less_the_wait_its_place_implies() -> None:
    assert expected_wait_s(0, 2.0) == 0.5  # one completion ahead of its slot
    assert expected_wait_s(3, 2.0) == 2.0
    assert expected_wait_s(3, 0.0) == 0.0  # no measured rate: no evidence, no wait
    assert slack_s(12.0, 10.0, 0.5) == 1.5
    rates = ServiceRates(window_s=10.0)
    assert rates.rate("m", 0.0) == 0.0
    for t in (1.0, 2.0, 3.0):
        rates.record("m", t)
    assert rates.rate("m", 3.0) == 1.5  # 3 over the 2 s since the first
    assert rates.rate("m", 7.0) == 0.5  # 3 over 6 s
    assert rates.rate("m", 12.5) == 0.1  # the 1.0 and 2.0 left the window: 1 over 10 s
    assert rates.rate("other", 12.5) == 0.0


def test_the_shed_rule_at_the_margins_edge() -> None:
    assert not is_late(-0.5, 0.5)  # exactly at the margin: served
    assert is_late(-0.5000001, 0.5)  # just past it: shed
    assert not is_late(0.0, 0.0) and is_late(-1e-9, 0.0)
    holds = Holds()

    def ask(now: float, has_slot: bool, wait_s: float, own: float | None = None) -> Any:
        shed = Shed(ttft_slo_s=2.0, ttft_deadline_s=12.0, wait_s=wait_s, margin_s=0.5)
        return admit("m", has_slot, None, holds, now, 10.0, own, 3, 3, 8, 15.0, shed=shed)

    # queueing at 10.0 behind three with a 2.5 s wait: slack -0.5, exactly at the margin
    assert ask(10.0, False, 2.5) == Queue(12.5, 25.0)  # its wait ends at deadline + margin
    late = ask(10.0, False, 2.5000001)  # just past: 429, named by its SLO
    assert isinstance(late, Fail) and late.status == 429 and late.busy and late.shed
    assert late.reason == "slo_late" and "TTFT SLO of 2 s of model `m`" in late.message
    # woken with a slot: no wait ahead; at 12.5 it is exactly at the edge, past it shed
    assert ask(12.5, True, 9.0, own=25.0) is ROUTE
    assert isinstance(ask(12.5000001, True, 9.0, own=25.0), Fail)
    # still without a slot at deadline + margin: late whatever the estimate
    timed_out = ask(12.5, False, 0.0, own=25.0)
    assert isinstance(timed_out, Fail) and timed_out.shed
    # without `shed`, the same request waits the queue's own wait (fcfs, nothing shed)
    assert admit("m", False, None, holds, 12.5, 10.0, 25.0, 3, 3, 8, 15.0) == Queue(25.0, 25.0)


def test_least_slack_first_then_the_tenant_below_its_share_then_the_ticket() -> None:
    clock = [100.0]
    d = Deadlines(AdmissionConfig(order="slack", ttft_slo_s={"m": 2.0}))
    d.served("heavy", clock[0])
    d.served("heavy", clock[0])
    assert d.shares.usage("heavy", 100.0) == 2.0 and d.shares.usage("light", 100.0) == 0.0
    assert d.shares.usage(None, 100.0) == 0.0
    assert d.shares.usage("heavy", 160.0) == pytest.approx(2.0 / math.e)  # decays
    q = WaitQueue[str]()
    arrivals = {"h1": (100.0, "heavy"), "l1": (100.0, "light"), "h0": (99.0, "heavy")}
    for name, (arrival_s, tenant) in arrivals.items():  # queued in this order
        r = d.rank("m", arrival_s, tenant, clock[0])
        assert q.num_ahead("m", 10**9, r) == {"h1": 0, "l1": 0, "h0": 0}[name]
        q.push("m", name, q.ticket(), r)
    # the earliest deadline first; at equal deadlines the tenant below its share
    assert q.line("m") == ["h0", "l1", "h1"]
    assert q.num_ahead("m", 1, d.rank("m", 100.0, "heavy", 100.0)) == 2  # h1's place
    assert q.line("m", after=2, rank=d.rank("m", 100.0, "light", 100.0)) == ["h1"]
    # fcfs ranks nothing: tickets alone
    assert rank("fcfs", 1.0, 5.0) == () and rank("slack", 1.0, 5.0) == (1.0, 5.0)
    # a model with no SLO has no deadline: its line is by fair share, then ticket
    assert d.ttft_deadline_s("other", 1.0) == math.inf and d.shed("other", 1.0, 0, 1.0) is None
    assert d.shed("m", 1.0, 0, 1.0) is None  # shedding off


def test_priority_orders_the_lines_when_every_waiter_looks_again() -> None:
    q = WaitQueue[str]()
    for model, name in (("low", "l1"), ("high", "h1"), ("low", "l2"), ("high", "h2")):
        q.push(model, name, q.ticket())
    assert q.waiters() == ["l1", "h1", "l2", "h2"]  # by ticket (fcfs)
    assert q.waiters({"high": 2.0}) == ["h1", "h2", "l1", "l2"]
    assert q.pop_all({"high": 2.0}) == ["h1", "h2", "l1", "l2"] and len(q) == 0
    d = Deadlines(AdmissionConfig(order="slack", priority={"high": 2.0}))
    assert d.priority == {"high": 2.0}
    assert Deadlines(AdmissionConfig(shed_late=True)).priority is None  # fcfs order


def test_fair_share_counts_decay() -> None:
    f = FairShare(window_s=10.0)
    f.served("a", 0.0)
    f.served("a", 10.0)
    assert f.usage("a", 10.0) == pytest.approx(1.0 + math.exp(-1.0))


def test_the_config_block_is_off_by_default_and_checked() -> None:
    cfg = config_from_dict({})
    assert cfg.admission == AdmissionConfig() and not cfg.admission.enabled
    cfg = config_from_dict(
        {"admission": {"order": "slack", "shed_late": True, "shed_margin_s": 0.5,
                       "ttft_slo_s": {"m": 2}, "priority": {"m": 3}}}
    )  # fmt: skip
    assert cfg.admission.enabled and cfg.admission.ttft_slo_s == {"m": 2}
    for bad, words in (
        ({"order": "edf"}, "admission.order"),
        ({"shed_late": "yes"}, "admission.shed_late"),
        ({"shed_margin_s": -1}, "admission.shed_margin_s"),
        ({"ttft_slo_s": {"m": 0}}, "admission.ttft_slo_s"),
        ({"priority": [1]}, "admission.priority"),
        ({"slo": 1}, "unknown field"),
    ):
        with pytest.raises(ConfigError, match=words):
            config_from_dict({"admission": bad})


def _call(gw: Any, t0: float) -> Any:
    from types import SimpleNamespace

    from flexpipe.policies.routing import RoutingRequest

    return SimpleNamespace(model="m", routing=RoutingRequest(1, 1, ()), move=None, tenant=None,
                           excluded=set(), failed=set(), t0=t0, num_tokens=1.0,
                           instance=None)  # fmt: skip


def test_a_shed_waiter_passes_its_slot_on_and_every_exit_empties_the_queue() -> None:
    """Two waiters for one full instance (TTFT SLO 1 s, no margin). The slot frees at 1.2 s
    on the gateway's clock, before the first waiter's own timer has fired: woken, it is past
    its deadline and shed (429, `slo_late`), and the slot goes at once to the second (within
    its SLO), not when the second's timer fires a second later. The queue ends empty."""
    from flexpipe.gateway.app import Gateway

    fake = [0.0]

    async def scenario() -> tuple[str, float, int, int, int, dict[str, int]]:
        gw = Gateway(config_from_dict({
            "backends": [{"url": "http://a", "model": "m"}],
            "max_concurrency_per_instance": 1, "max_queue": 8, "max_queue_wait_s": 5,
            "admission": {"shed_late": True, "ttft_slo_s": {"m": 1.0}},
        }), clock=lambda: fake[0])  # fmt: skip
        a = gw.pool.get("http://a")
        assert a is not None
        gw.router.acquire(a, 1)  # full
        late = asyncio.create_task(gw._pick(_call(gw, 0.0)))
        await asyncio.sleep(0.01)
        fake[0] = 0.5
        ok = asyncio.create_task(gw._pick(_call(gw, 0.5)))
        await asyncio.sleep(0.01)
        assert gw.queued_by_model() == {"m": 2}
        fake[0] = 1.2
        t0 = time.monotonic()
        gw.finish(a, _call(gw, 0.0), "200")  # the slot frees: wakes `late` first
        inst = await asyncio.wait_for(ok, 2.0)
        waited_s = time.monotonic() - t0
        exc = late.exception()
        status = exc.status if isinstance(exc, Exception) and hasattr(exc, "status") else 0
        shed = int(gw.metrics.rejected.labels("slo_late")._value.get())
        counts, num = gw.queued_by_model(), gw.num_waiting
        await gw.close()
        return inst.url, waited_s, status, shed, num, counts

    url, waited_s, status, shed, num, counts = asyncio.run(scenario())
    assert url == "http://a" and waited_s < 0.5 and status == 429
    assert shed == 1 and num == 0 and counts == {}


# --- the live gateway over real HTTP ------------------------------------------------------


def test_a_one_slot_instance_serves_its_line_by_slack_then_fair_share(lt: LoopThread) -> None:
    """One slot, held by a heavy tenant's request. Then, at one frozen instant, a heavy and a
    light tenant's request queue (equal deadlines: the light one, below its share, first),
    and last one whose client clock says it arrived 5 s earlier (the earliest deadline:
    first). First come, first served would serve them h1, l1, h0."""
    engine = FakeEngine(token_delay_s=0.05)
    keys = [{"key": "sk-heavy", "name": "heavy"}, {"key": "sk-light", "name": "light"}]
    r = Running(lt, [engine], max_concurrency_per_instance=1, max_queue=8,
                max_queue_wait_s=30, tenants=keys,
                admission={"order": "slack", "ttft_slo_s": {"fake-model": 30}})  # fmt: skip
    frozen = [1000.0]
    r.gw.clock = lambda: frozen[0]

    async def scenario() -> None:
        heavy = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-heavy", max_retries=0)
        light = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-light", max_retries=0)

        async def one(client: openai.AsyncOpenAI, name: str, num_tokens: int) -> None:
            stream = await client.completions.create(
                model="fake-model", prompt=name, max_tokens=num_tokens, stream=True
            )
            async for _ in stream:
                pass

        try:
            tasks = [asyncio.create_task(one(heavy, "blocker", 20))]
            await asyncio.sleep(0.2)
            for client, name in ((heavy, "h1"), (light, "l1")):
                tasks.append(asyncio.create_task(one(client, name, 2)))
                await asyncio.sleep(0.1)
            frozen[0] = 995.0
            tasks.append(asyncio.create_task(one(heavy, "h0", 2)))
            await asyncio.sleep(0.1)
            assert r.gw.queued_by_model() == {"fake-model": 3}
            await asyncio.gather(*tasks)
        finally:
            await heavy.close()
            await light.close()

    try:
        asyncio.run(scenario())
        assert [b["prompt"] for b in engine.bodies] == ["blocker", "h0", "l1", "h1"]
        assert r.gw.num_waiting == 0 and r.gw.queued_by_model() == {}
    finally:
        r.close()


def test_a_request_that_cannot_make_its_ttft_slo_gets_a_429_with_retry_after(
    lt: LoopThread,
) -> None:
    """One slot, held 2 s; the TTFT SLO is 0.5 s with a 0.25 s margin. A queued request
    still without a slot 0.75 s after it arrived is refused with 429, Retry-After and words
    naming the SLO (counted as `slo_late`), not served ~1.5 s late; the queue is empty."""
    engine = FakeEngine(token_delay_s=0.05)
    r = Running(lt, [engine], max_concurrency_per_instance=1, max_queue=8, max_queue_wait_s=30,
                admission={"shed_late": True, "shed_margin_s": 0.25,
                           "ttft_slo_s": {"fake-model": 0.5}})  # fmt: skip
    try:
        client = r.client()
        pool = ThreadPoolExecutor(1)

        def blocker_run() -> int:
            stream = client.completions.create(
                model="fake-model", prompt="b", max_tokens=40, stream=True
            )
            return sum(1 for _ in stream)

        blocker = pool.submit(blocker_run)
        time.sleep(0.2)
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="fake-model", prompt="late", max_tokens=2, stream=True)
        waited_s = time.monotonic() - t0
        assert 0.7 <= waited_s < 1.9  # shed at 0.75 s, well before the slot frees at ~2 s
        resp = info.value.response
        assert resp.status_code == 429 and float(resp.headers["retry-after"]) >= 1
        err = resp.json()["error"]
        assert "TTFT SLO of 0.5 s of model `fake-model`" in err["message"]
        assert err["type"] and err["param"] == "model"
        assert blocker.result(10) == 40
        pool.shutdown()
        assert [b["prompt"] for b in engine.bodies] == ["b"]  # never served late
        assert r.gw.metrics.rejected.labels("slo_late")._value.get() == 1
        assert r.gw.num_waiting == 0 and r.gw.queued_by_model() == {}
    finally:
        r.close()
