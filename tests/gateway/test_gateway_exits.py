"""Every exit path of a request releases what it held: client timeouts and disconnects at
each phase, tenants' token budgets, and the gateway's own shutdown. Upstreams are fake
engines on real sockets; the clients are the official `openai` client and raw sockets."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import openai
import orjson
import pytest
from test_gateway_api import Running
from test_gateway_fakes import FakeEngine, LoopThread

from flexpipe.gateway.call import Move
from flexpipe.gateway.tenants import TokenBucket


def wait_for(cond: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def idle(r: Running) -> bool:
    gw = r.gw
    return (
        gw.num_active_calls == 0
        and not gw.num_waiting
        and all(i.num_in_flight == 0 for i in gw.pool.instances.values())
    )


def test_client_timeouts_before_the_head_release_their_slots(lt: LoopThread) -> None:
    """The issue's repro: four non-streamed requests that time out on the client left
    num_in_flight at 4 for good and every later request got 429."""
    engine = FakeEngine(mode="hang")
    r = Running(lt, [engine], max_concurrency_per_instance=4, max_queue=0)
    try:
        client = r.client(timeout=0.3)
        for _ in range(4):
            with pytest.raises(openai.APITimeoutError):
                client.completions.create(model="fake-model", prompt="x", max_tokens=200)
        wait_for(lambda: idle(r), 5)
        wait_for(lambda: engine.num_cancelled == 4, 5)  # the engine's work was aborted
        engine.mode = "ok"
        out = r.client().completions.create(model="fake-model", prompt="x", max_tokens=2)
        assert out.choices[0].text
    finally:
        r.close()


def test_a_stream_queued_at_the_gateway_leaves_no_trace_when_its_client_goes(
    lt: LoopThread,
) -> None:
    engine = FakeEngine(token_delay_s=0.05)
    r = Running(lt, [engine], max_concurrency_per_instance=1, max_queue=4)
    try:
        first = r.client().completions.create(
            model="fake-model", prompt="x", max_tokens=40, stream=True
        )
        it = iter(first)
        next(it)  # holds the only slot
        with pytest.raises(openai.APITimeoutError):  # waits in the queue, then gives up
            r.client(timeout=0.3).completions.create(
                model="fake-model", prompt="y", max_tokens=5, stream=True
            )
        wait_for(lambda: not r.gw.num_waiting, 5)
        rest = [c.choices[0].text for c in it if c.choices]
        assert len(rest) == 39
        wait_for(lambda: idle(r), 5)
    finally:
        r.close()


def test_a_queued_client_that_leaves_as_it_is_woken_is_gone_from_the_queue(
    lt: LoopThread,
) -> None:
    """A slot frees (the queued request is woken) in the same loop pass as its client leaves:
    the leaving must win. (asyncio.wait_for on Python 3.11 returned the wake-up and swallowed
    the cancellation: the request went on queued for nobody, then ran on the engine.)"""
    engine = FakeEngine(token_delay_s=0.05)
    r = Running(lt, [engine], max_concurrency_per_instance=1, max_queue=4)
    try:
        first = r.client().completions.create(
            model="fake-model", prompt="x", max_tokens=40, stream=True
        )
        it = iter(first)
        next(it)  # holds the only slot
        server = r.gw.server
        assert server is not None
        (holder,) = server._connections

        async def queued() -> None:
            host, port = r.url.removeprefix("http://").split(":")
            _, writer = await asyncio.open_connection(host, int(port))
            body = orjson.dumps({"model": "fake-model", "prompt": "y", "max_tokens": 200})
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                b"\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
            )
            await writer.drain()
            while not r.gw.num_waiting:
                await asyncio.sleep(0.005)
            (conn,) = server._connections - {holder}
            assert conn.transport is not None
            conn.transport.abort()  # the client leaves (connection_lost comes next pass) ...
            r.gw._wake_one("fake-model")  # ... as a slot frees
            writer.close()

        lt.run(queued())
        wait_for(lambda: not r.gw.num_waiting, 2)
        rest = [c.choices[0].text for c in it if c.choices]
        assert len(rest) == 39
        wait_for(lambda: idle(r), 5)
        assert engine.num_requests == 1  # the one that left never reached the engine
    finally:
        r.close()


def test_disconnect_while_the_request_body_is_still_arriving(lt: LoopThread) -> None:
    r = Running(lt, [FakeEngine()])
    try:
        host, port = r.url.removeprefix("http://").split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                    b'application/json\r\ncontent-length: 1000\r\n\r\n{"model": '
                )
        wait_for(lambda: idle(r), 5)
        assert r.client().completions.create(model="fake-model", prompt="x", max_tokens=2)
    finally:
        r.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_as_the_engine_answers_releases_the_slot(
    lt: LoopThread, stream: bool
) -> None:
    """The race CI found (one slot held for good, the engine generating for nobody): the
    engine's response head arrives and the client's disconnect cancels the handler before it
    resumes. Here the disconnect comes exactly as the send returns (a cancellation pending on
    the request's task, the connection aborted): the handler must still release the slot and
    the upstream response at its next step."""
    engine = FakeEngine(token_delay_s=0.05)
    r = Running(lt, [engine], max_concurrency_per_instance=4)
    real_send = r.gw.send

    async def send_then_the_client_leaves(*args: Any, **kw: Any) -> Any:
        result = await real_send(*args, **kw)
        server = r.gw.server
        assert server is not None
        (conn,) = server._connections  # the test's one client connection
        task, transport = conn._task, conn.transport
        assert task is not None and transport is not None

        task.cancel()  # what connection_lost does, before the handler's next step
        transport.abort()
        return result

    r.gw.send = send_then_the_client_leaves  # type: ignore[method-assign]
    try:
        with pytest.raises(openai.APIConnectionError):
            if stream:
                list(r.client().completions.create(
                    model="fake-model", prompt="x", max_tokens=200, stream=True
                ))  # fmt: skip
            else:
                r.client().completions.create(model="fake-model", prompt="x", max_tokens=200)
        wait_for(lambda: idle(r), 5)
        wait_for(lambda: engine.num_active == 0, 5)  # the engine's work was aborted
        r.gw.send = real_send  # type: ignore[method-assign]
        assert r.client().completions.create(model="fake-model", prompt="x", max_tokens=2)
    finally:
        r.close()


def test_a_move_as_the_client_leaves_ends_the_request_and_sends_it_nowhere(
    lt: LoopThread,
) -> None:
    """A move cancels the request's own task while it waits for the engine's head, and takes
    that cancellation back to send it again to the target; a client that leaves in the same
    pass cancels the task too, and that one must stand: the request ends, its slot and the
    source's work are released, and nothing reaches the target."""
    source, target = FakeEngine(mode="hang"), FakeEngine()
    r = Running(lt, [source, target])
    r.gw.pool.drain(target.url)  # the request starts on `source`

    async def move_as_the_client_leaves() -> str:
        (call,) = r.gw.calls_on(source.url)
        server = r.gw.server
        assert server is not None and call.sending is not None
        (conn,) = server._connections  # the test's one client connection
        assert conn._task is call.sending and conn.transport is not None
        outcome, _ = await r.gw.move_request(call.id, Move("recompute", target.url))
        conn._task.cancel()  # what connection_lost does, in the same pass
        conn.transport.abort()
        return outcome

    try:
        with pytest.raises(openai.APIConnectionError):
            client = r.client()

            def move_once_sent() -> None:
                wait_for(lambda: source.num_requests == 1, 5)
                r.gw.pool.activate(target.url)
                assert lt.run(move_as_the_client_leaves()) == "rerun"

            thread = threading.Thread(target=move_once_sent)
            thread.start()
            try:
                client.completions.create(model="fake-model", prompt="x", max_tokens=2)
            finally:
                thread.join(10)
        wait_for(lambda: idle(r), 5)
        wait_for(lambda: source.num_cancelled == 1, 5)  # the source's work was aborted
        assert target.num_requests == 0  # not sent again: the client had left
    finally:
        r.close()


def test_token_bucket_refuses_what_can_never_fit_and_settles_what_was_used() -> None:
    b = TokenBucket(rate_per_s=2000 / 60, capacity=2000, level=2000, updated_s=0.0)
    assert b.try_take(3000, 0.0) == float("inf")  # more than the whole budget
    assert b.level == 2000
    assert b.try_take(1500, 0.0) == 0.0
    b.settle(charged=1500, used=100, now=0.0)  # only 100 were generated
    assert b.level == pytest.approx(1900)
    assert b.try_take(1000, 0.0) == 0.0
    b.settle(charged=1000, used=2200, now=0.0)  # used more than estimated: debt
    assert b.level == pytest.approx(-300)
    assert b.try_take(100, 0.0) == pytest.approx(400 / (2000 / 60))


def test_tenant_token_budget_cannot_be_bypassed(lt: LoopThread) -> None:
    tenants = [{"key": "sk-t", "name": "t", "tokens_per_min": 2000}]
    r = Running(lt, [FakeEngine()], tenants=tenants)
    try:
        client = r.client("sk-t")
        with pytest.raises(openai.BadRequestError, match="too large") as info:
            client.completions.create(model="fake-model", prompt="x", max_tokens=3000)
        assert info.value.body["param"] == "max_tokens"  # type: ignore[index]
        # actual tokens are charged: 3 x 600 fit, the fourth does not
        for _ in range(3):
            client.completions.create(model="fake-model", prompt="x", max_tokens=600)
        with pytest.raises(openai.RateLimitError, match="tokens per minute"):
            client.completions.create(model="fake-model", prompt="x", max_tokens=600)
        # a stream that stops early is charged what it relayed, not its max_tokens
        bucket = r.gw.tenants.lookup("Bearer sk-t").tokens  # type: ignore[union-attr]
        assert bucket is not None
        bucket.level = 2000.0
        stream = client.completions.create(
            model="fake-model", prompt="x", max_tokens=1000, stream=True
        )
        assert len([c for c in stream if c.choices]) == 1000
        wait_for(lambda: idle(r), 5)
        assert 2000 - bucket.level == pytest.approx(1001, abs=40)  # refilled a little since
    finally:
        r.close()


def test_shutdown_finishes_what_it_can_and_ends_the_rest_with_an_error_event(
    lt: LoopThread,
) -> None:
    slow, quick = FakeEngine(token_delay_s=0.05), FakeEngine(token_delay_s=0.01)
    r = Running(lt, [slow, quick], routing={"policy": "round_robin"})
    try:
        host, port = r.url.removeprefix("http://").split(":")

        async def stream(max_tokens: int) -> list[str]:
            """The `data:` lines of a streamed completion, read raw until the end."""
            reader, writer = await asyncio.open_connection(host, int(port))
            body = b'{"model": "fake-model", "prompt": "x", "max_tokens": %d, "stream": true}'
            body %= max_tokens
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                % (len(body), body)
            )
            raw = await reader.read()
            writer.close()
            return re.findall(r"data: [^\r\n]*", raw.decode())

        async def scenario() -> tuple[list[str], list[str], Exception | None]:
            long = asyncio.create_task(stream(400))  # 20 s: cut at the deadline
            short = asyncio.create_task(stream(10))  # 0.1 s: finishes in the grace
            while r.gw.num_active_calls < 2:
                await asyncio.sleep(0.01)
            shutdown = asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(r.gw.shutdown(1.0), lt.loop)
            )
            await asyncio.sleep(0.2)
            refused: Exception | None = None
            try:  # new connections are refused once shutdown began
                await stream(1)
            except OSError as exc:
                refused = exc
            out = await long, await short
            await shutdown
            return out[0], out[1], refused

        long_lines, short_lines, refused = asyncio.run(scenario())
        assert short_lines[-1] == "data: [DONE]" and len(short_lines) == 11
        assert long_lines[-1] == "data: [DONE]"
        assert "shutting down" in long_lines[-2] and '"error"' in long_lines[-2]
        assert 5 < len(long_lines) < 400
        assert refused is not None
        assert idle(r)
    finally:
        r.close()


def test_a_hold_keeps_requests_queued_while_capacity_is_relaunched(lt: LoopThread) -> None:
    """An in-place shift takes an instance away while its replacement starts: with a hold
    for the model, requests wait in the queue past max_queue_wait_s instead of getting 429,
    and every waiter is served once the new instance joins the pool."""
    slow = FakeEngine(token_delay_s=0.05)
    r = Running(lt, [slow], max_concurrency_per_instance=1, max_queue=8, max_queue_wait_s=0.3,
                admin_token="t")  # fmt: skip
    auth = {"authorization": "Bearer t", "content-type": "application/json"}
    try:
        body = b'{"model": "fake-model", "seconds": 30}'
        assert r.http("POST", "/admin/models/hold", body, auth)[0] == 200

        async def burst() -> list[int]:
            client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)

            async def one() -> int:
                stream = await client.completions.create(
                    model="fake-model", prompt="x", max_tokens=20, stream=True
                )
                return len([c async for c in stream if c.choices])

            try:
                tasks = [asyncio.create_task(one()) for _ in range(4)]
                await asyncio.sleep(0.6)  # twice max_queue_wait_s: nobody refused
                assert not any(t.done() and t.exception() for t in tasks)
                extra = lt.run(FakeEngine(token_delay_s=0.01).start())
                r.engines.append(extra)
                add = {"url": extra.url, "model": "fake-model", "max_concurrency": 4}
                assert r.http("POST", "/admin/instances", orjson.dumps(add), auth)[0] == 200
                return list(await asyncio.gather(*tasks))
            finally:
                await client.close()

        assert asyncio.run(burst()) == [20, 20, 20, 20]
        assert r.http("POST", "/admin/models/hold", b'{"model": "fake-model", "seconds": 0}',
                      auth)[0] == 200  # fmt: skip
        assert r.gw.holds.models(r.gw.clock()) == set()
    finally:
        r.close()


def held_queue_then(
    r: Running, then: Callable[[], None]
) -> tuple[list[BaseException | None], float]:
    """Three requests queued for the held `fake-model` (past `max_queue_wait_s`: still
    waiting), then `then()` (an admin call, off the event loop): each request's error and how
    long after `then()` the last of them ended."""

    async def scenario() -> tuple[list[BaseException | None], float]:
        client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        try:
            tasks = [
                asyncio.create_task(
                    client.completions.create(model="fake-model", prompt="x", max_tokens=2)
                )
                for _ in range(3)
            ]
            await asyncio.sleep(0.6)  # past max_queue_wait_s: held, still queued
            assert not any(t.done() for t in tasks)
            t0 = time.monotonic()
            await asyncio.to_thread(then)
            await asyncio.wait(tasks, timeout=10)
            return [t.exception() for t in tasks], time.monotonic() - t0
        finally:
            await client.close()

    return asyncio.run(scenario())


def test_a_hold_that_ends_with_no_instance_left_refuses_its_queue_at_once(
    lt: LoopThread,
) -> None:
    """Requests queued through a long hold (a model held for a cold start that will not
    come): when the controller ends the hold they are refused at once with the reason, not
    after the wait the hold gave them."""
    r = Running(lt, [], max_queue_wait_s=0.2, admin_token="t")
    auth = {"authorization": "Bearer t", "content-type": "application/json"}
    hold = b'{"model": "fake-model", "seconds": 300}'
    try:
        assert r.http("POST", "/admin/models/hold", hold, auth)[0] == 200

        def end_hold() -> None:
            end = b'{"model": "fake-model", "seconds": 0}'
            assert r.http("POST", "/admin/models/hold", end, auth)[0] == 200

        errors, took_s = held_queue_then(r, end_hold)
        assert all(isinstance(e, openai.APIStatusError) and e.status_code == 503 for e in errors)
        assert took_s < 3.0  # at once (before: the hold's 300 s)
        assert idle(r)
    finally:
        r.close()


def test_a_held_model_with_no_instance_queues_its_requests_and_signals_demand(
    lt: LoopThread,
) -> None:
    """Scale to zero at the gateway: a model with no instance but a hold is listed and
    accepted; its requests wait in the queue; `/admin/models/demand` answers as soon as one
    waits (it is asked before, and woken by the request: not a poll); an instance that joins
    (starting, then active) serves them. Unheld, a model with no instance is a 404."""
    r = Running(lt, [], max_queue_wait_s=0.2, admin_token="t")
    auth = {"authorization": "Bearer t", "content-type": "application/json"}

    def post(path: str, **body: Any) -> tuple[int, Any]:
        status, _, raw = r.http("POST", path, orjson.dumps(body), auth)
        return status, orjson.loads(raw)

    try:
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="fake-model", prompt="x", max_tokens=2)
        assert post("/admin/models/hold", model="fake-model", seconds=60)[0] == 200
        assert [m.id for m in client.models.list().data] == ["fake-model"]
        assert post("/admin/models/demand", models=["fake-model"], wait_s=0)[1] == {"queued": {}}

        async def scenario() -> tuple[dict[str, Any], list[int], float]:
            aclient = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
            loop = asyncio.get_running_loop()
            t0 = time.monotonic()
            models = ["fake-model", "other"]
            demand = loop.run_in_executor(
                None, lambda: post("/admin/models/demand", models=models, wait_s=30)
            )
            await asyncio.sleep(0.3)
            assert not demand.done()  # nothing queued yet: it waits
            tasks = [
                asyncio.create_task(
                    aclient.completions.create(model="fake-model", prompt="x", max_tokens=3)
                )
                for _ in range(2)
            ]
            status, answer = await demand
            waited_s = time.monotonic() - t0
            assert status == 200
            await asyncio.sleep(0.5)  # past max_queue_wait_s: still queued, not refused
            assert not any(t.done() for t in tasks)
            engine = lt.run(FakeEngine().start())
            r.engines.append(engine)
            url = engine.url
            assert post("/admin/instances", url=url, model="fake-model", state="starting")[0] == 200
            await asyncio.sleep(0.2)
            assert not any(t.done() for t in tasks)  # starting: not routed
            assert post("/admin/instances/state", url=url, state="active")[0] == 200
            done = await asyncio.gather(*tasks)
            await aclient.close()
            return answer, [c.usage.completion_tokens for c in done if c.usage], waited_s

        answer, tokens, waited_s = asyncio.run(scenario())
        assert answer["queued"] == {"fake-model": 1} or answer["queued"] == {"fake-model": 2}
        assert tokens == [3, 3] and waited_s < 5
        assert r.gw.queued_by_model() == {}
        assert post("/admin/models/demand", models="fake-model", wait_s=0)[0] == 400
    finally:
        r.close()
