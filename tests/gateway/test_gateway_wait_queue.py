"""The gateway's wait queue (flexpipe/gateway/core/wait_queue.py): first come, first served per
model. An exact test of the pure line, and the live gateway over real HTTP with the official client:
a slot that frees goes to a waiter of its own model."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import openai
import pytest
from test_gateway_api import Running
from test_gateway_fakes import FakeEngine, LoopThread

from flexpipe.gateway.core.wait_queue import WaitQueue


def test_each_model_has_its_line_in_ticket_order_and_a_retry_keeps_its_place() -> None:
    q = WaitQueue[str]()
    tickets = {name: q.ticket() for name in ("a1", "b1", "a2", "b2", "a3")}
    for name, ticket in tickets.items():
        q.push("model-" + name[0], name, ticket)
    assert len(q) == 5 and q.counts() == {"model-a": 3, "model-b": 2}
    assert q.line("model-a") == ["a1", "a2", "a3"] and q.line("model-b") == ["b1", "b2"]
    assert q.waiters() == ["a1", "b1", "a2", "b2", "a3"]
    # the oldest of a model is woken; finding no slot, it goes back to its own place
    assert q.pop_first("model-a") == "a1"
    late = q.ticket()
    q.push("model-a", "a4", late)
    q.push("model-a", "a1", tickets["a1"])
    assert q.line("model-a") == ["a1", "a2", "a3", "a4"]
    assert q.remove("model-a", "a2") and not q.remove("model-a", "a2")
    assert not q.remove("model-c", "a1")
    assert q.count("model-a") == 3 and q.count("model-c") == 0 and q.line("model-c") == []
    assert q.pop_first("model-c") is None
    assert q.pop_all() == ["a1", "b1", "b2", "a3", "a4"]
    assert len(q) == 0 and q.counts() == {} and q.waiters() == []


def test_a_freed_slot_goes_to_its_own_models_oldest_waiter(lt: LoopThread) -> None:
    """Two models, one slot each, both full, each with waiters. When b's slot frees, b's
    waiter is served at once. (One line for all models woke the oldest waiter of any model:
    a's, which found no slot and went to the back, while b's slept until a's long request
    ended.) a's waiters are served in the order they came."""
    a, b = FakeEngine(token_delay_s=0.05), FakeEngine(token_delay_s=0.02)
    a.model, b.model = "model-a", "model-b"
    r = Running(lt, [a, b], max_concurrency_per_instance=1, max_queue=8, max_queue_wait_s=30)

    async def scenario() -> dict[str, float]:
        client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        done_at: dict[str, float] = {}

        async def one(name: str, num_tokens: int) -> None:
            stream = await client.completions.create(
                model="model-" + name[0], prompt="x", max_tokens=num_tokens, stream=True
            )
            async for _ in stream:
                pass
            done_at[name] = time.monotonic()

        try:
            tasks = []
            for name, num_tokens in (("a1", 40), ("b1", 40), ("a2", 2), ("b2", 2), ("a3", 2)):
                tasks.append(asyncio.create_task(one(name, num_tokens)))
                await asyncio.sleep(0.1)  # each arrives after the one before is placed
            assert r.gw.queued_by_model() == {"model-a": 2, "model-b": 1}
            await asyncio.gather(*tasks)
            return done_at
        finally:
            await client.close()

    try:
        done_at = asyncio.run(scenario())
        assert done_at["b2"] < done_at["a1"]  # a1 holds a's slot for ~2 s
        assert done_at["a1"] < done_at["a2"] < done_at["a3"]
        assert r.gw.num_waiting == 0 and r.gw.queued_by_model() == {}
    finally:
        r.close()


def test_a_waiter_that_may_not_use_the_freed_slot_passes_it_on() -> None:
    """A retry that left instance a (`excluded`) waits first in the line; a's slot frees and
    wakes it, but it may not go there: the next waiter is woken and takes a at once. (It slept
    until its own wait ran out, and every new request of the model queued behind it.)"""
    from types import SimpleNamespace

    from flexpipe.gateway.app import Gateway
    from flexpipe.gateway.config import config_from_dict
    from flexpipe.policies.routing import RoutingRequest

    async def scenario() -> tuple[str, float, bool]:
        gw = Gateway(config_from_dict({
            "backends": [{"url": "http://a", "model": "m"}, {"url": "http://b", "model": "m"}],
            "max_concurrency_per_instance": 1, "max_queue": 8, "max_queue_wait_s": 5,
        }))  # fmt: skip
        a, b = gw.pool.get("http://a"), gw.pool.get("http://b")
        assert a is not None and b is not None
        gw.router.acquire(a, 1)
        gw.router.acquire(b, 1)  # both full

        def call(excluded: set[str]) -> Any:
            return SimpleNamespace(model="m", routing=RoutingRequest(1, 1, ()), move=None,
                                   excluded=excluded, failed=set(), t0=gw.clock())  # fmt: skip

        retry = asyncio.create_task(gw._pick(call({"http://a"})))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(gw._pick(call(set())))
        await asyncio.sleep(0.01)
        assert gw.queued_by_model() == {"m": 2}
        t0 = gw.clock()
        gw.router.finish(a, 1, t0)
        gw._wake_one("m")  # what `Gateway.finish` of a's request does
        inst = await asyncio.wait_for(second, 2.0)
        waited_s = gw.clock() - t0
        still_waiting = not retry.done()
        retry.cancel()
        await gw.close()
        return inst.url, waited_s, still_waiting

    url, waited_s, still_waiting = asyncio.run(scenario())
    assert url == "http://a" and waited_s < 1.0 and still_waiting


def test_a_waiter_woken_as_its_client_leaves_hands_the_slot_to_the_next() -> None:
    """Three waiters for one full instance. Its slot frees and wakes the first; in the same
    loop pass, before it resumes, its client leaves (the handler is cancelled). The slot
    must go on: the second waiter takes it at once, the third still waits. (Without the
    hand-on the wake-up is lost with the leaver, and the second sleeps until its own wait
    runs out.)"""
    from types import SimpleNamespace

    from flexpipe.gateway.app import Gateway
    from flexpipe.gateway.config import config_from_dict
    from flexpipe.policies.routing import RoutingRequest

    async def scenario() -> tuple[str, float, bool, dict[str, int]]:
        gw = Gateway(config_from_dict({
            "backends": [{"url": "http://a", "model": "m"}],
            "max_concurrency_per_instance": 1, "max_queue": 8, "max_queue_wait_s": 5,
        }))  # fmt: skip
        a = gw.pool.get("http://a")
        gw.router.acquire(a, 1)  # full

        def call() -> Any:
            return SimpleNamespace(model="m", routing=RoutingRequest(1, 1, ()), move=None,
                                   excluded=set(), failed=set(), t0=gw.clock())  # fmt: skip

        waiters = []
        for _ in range(3):
            waiters.append(asyncio.create_task(gw._pick(call())))
            await asyncio.sleep(0.01)
        first, second, third = waiters
        assert gw.queued_by_model() == {"m": 3}
        t0 = gw.clock()
        gw.router.finish(a, 1, t0)
        gw._wake_one("m")  # what `Gateway.finish` of a's request does: wakes the first ...
        first.cancel()  # ... whose client leaves before it resumes
        inst = await asyncio.wait_for(second, 2.0)
        waited_s = gw.clock() - t0
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await asyncio.sleep(0.05)
        third_waits = not third.done()
        queued = gw.queued_by_model()
        third.cancel()
        await gw.close()
        return inst.url, waited_s, third_waits, queued

    url, waited_s, third_waits, queued = asyncio.run(scenario())
    assert url == "http://a" and waited_s < 1.0
    assert third_waits and queued == {"m": 1}


def test_a_waiter_woken_as_its_wait_ends_still_hands_on_a_slot_it_may_not_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two full instances, two waiters; the first left instance a before (a busy retry:
    `excluded`). a's slot frees and wakes the first in the very loop pass its own wait ends
    (the loop was held up past both). The wake-up comes, the timeout wins: the first gets
    its 429, and the slot it may not use must still go to the second, at once, not when the
    second's own wait runs out."""
    from types import SimpleNamespace

    from flexpipe.gateway import app, slots
    from flexpipe.gateway.config import config_from_dict
    from flexpipe.gateway.core.admission import Decision, Queue
    from flexpipe.gateway.retry_later import RetryLater
    from flexpipe.policies.routing import RoutingRequest

    decisions: list[Decision] = []
    admit = slots.admit

    def spy(*args: Any, **kw: Any) -> Decision:
        decisions.append(admit(*args, **kw))
        return decisions[-1]

    monkeypatch.setattr(slots, "admit", spy)

    async def scenario() -> tuple[str, float, float, str]:
        loop = asyncio.get_running_loop()
        gw = app.Gateway(config_from_dict({
            "backends": [{"url": "http://a", "model": "m"}, {"url": "http://b", "model": "m"}],
            "max_concurrency_per_instance": 1, "max_queue": 8, "max_queue_wait_s": 0.5,
        }), clock=loop.time)  # fmt: skip
        a, b = gw.pool.get("http://a"), gw.pool.get("http://b")
        gw.router.acquire(a, 1)
        gw.router.acquire(b, 1)

        def call(excluded: set[str]) -> Any:
            return SimpleNamespace(model="m", routing=RoutingRequest(1, 1, ()), move=None,
                                   excluded=excluded, failed=set(), t0=gw.clock())  # fmt: skip

        first = asyncio.create_task(gw._pick(call({"http://a"})))
        await asyncio.sleep(0.01)
        (queued,) = decisions
        assert isinstance(queued, Queue)
        deadline_s = queued.deadline_s
        await asyncio.sleep(0.4)
        second = asyncio.create_task(gw._pick(call(set())))
        await asyncio.sleep(0.01)
        assert gw.queued_by_model() == {"m": 2}
        freed_at: list[float] = []

        def free_a() -> None:
            freed_at.append(loop.time())
            gw.router.finish(a, 1, freed_at[0])
            gw._wake_one("m")  # what `Gateway.finish` of a's request does

        # the loop is held up from just before the first's deadline to past it: the slot's
        # wake-up and the first's timeout then run in one pass, the wake-up first
        loop.call_at(deadline_s - 0.05, time.sleep, 0.1)
        loop.call_at(deadline_s - 0.04, free_a)
        inst = await asyncio.wait_for(second, 2.0)
        got_s = loop.time() - freed_at[0]
        try:
            await first
            first_outcome = "routed"
        except RetryLater as exc:
            first_outcome = f"{exc.status}: {exc.message}"
        await gw.close()
        return inst.url, got_s, deadline_s + 0.4 - freed_at[0], first_outcome

    url, got_s, second_wait_left_s, first_outcome = asyncio.run(scenario())
    assert first_outcome == "429: all instances stayed busy"
    assert url == "http://a" and second_wait_left_s > 0.3 and got_s < 0.2
