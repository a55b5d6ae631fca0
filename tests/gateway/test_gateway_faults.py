"""Faults: engines that die (kill -9, real processes), fail (500/503), hang, go unhealthy,
get drained, are slow; clients that disconnect; a pool that is full. The gateway must lose
nothing it accepted: a complete response, a seamless continuation, or a clear error."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from test_gateway_api import Running
from test_gateway_fakes import FakeEngine, LoopThread, free_port, wait_http

MODEL = "llama-2-7b"


def metric(r: Running, needle: str) -> float:
    with urllib.request.urlopen(r.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(needle)
    )


def wait_for(cond: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


@pytest.fixture
def sim_engines() -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    procs = []
    try:
        for _ in range(2):
            port = free_port()
            cmd = [sys.executable, "-m", "flexpipe.engine.sim", "--model", MODEL, "--port",
                   str(port), "--load-time-s", "0", "--time-scale", "1"]  # fmt: skip
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append((proc, f"http://127.0.0.1:{port}"))
        for _, url in procs:
            wait_http(url + "/health", 60)
        yield procs
    finally:
        for proc, _ in procs:
            proc.kill()
            proc.wait(10)


def test_kill_9_mid_stream_under_50_streams_loses_nothing(
    lt: LoopThread, sim_engines: list[tuple[subprocess.Popen[bytes], str]]
) -> None:
    (victim, victim_url), (_, other_url) = sim_engines
    r = Running(lt, [], routing={"policy": "round_robin"}, health_interval_s=0.5)
    try:
        for url in (victim_url, other_url):
            r.gw.pool.add(url, MODEL)
        num_tokens = 160  # long enough to be cut on a loaded machine
        first_token = asyncio.Event()

        async def one(i: int, client: openai.AsyncOpenAI) -> tuple[str, set[str], str | None]:
            ids: set[str] = set()
            text, finish = "", None
            kw: dict[str, Any] = {"max_tokens": num_tokens, "stream": True}
            kw["extra_body"] = {"ignore_eos": True}
            if i % 2:
                stream = await client.completions.create(
                    model=MODEL, prompt=f"request {i} tell me a story", **kw
                )
                async for ch in stream:
                    ids.add(ch.id)
                    first_token.set()
                    text += ch.choices[0].text if ch.choices else ""
                    finish = (ch.choices[0].finish_reason if ch.choices else None) or finish
            else:
                msgs = [{"role": "user", "content": f"request {i}: tell me a story"}]
                chat = await client.chat.completions.create(model=MODEL, messages=msgs, **kw)
                async for cch in chat:
                    ids.add(cch.id)
                    first_token.set()
                    text += (cch.choices[0].delta.content or "") if cch.choices else ""
                    finish = (cch.choices[0].finish_reason if cch.choices else None) or finish
            return text, ids, finish

        async def main() -> list[tuple[str, set[str], str | None]]:
            client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
            tasks = [asyncio.create_task(one(i, client)) for i in range(50)]
            await first_token.wait()
            # kill while the victim streams (the client may lag behind on a loaded machine)
            assert r.gw.pool.instances[victim_url].num_in_flight > 0
            os.kill(victim.pid, signal.SIGKILL)
            try:
                return await asyncio.gather(*tasks)
            finally:
                await client.close()

        results = asyncio.run(main())
        for text, ids, finish in results:
            assert len(ids) == 1  # one id for the whole stream, migrated or not
            assert finish == "length"
            assert 130 <= len(text.split()) <= 170  # about max_tokens words, no error text
        # the kill hit work in flight: streams past their head were continued (migrations),
        # those before it were sent again (retries), depending on where each one was
        moved = metric(r, 'flexpipe_migrations_total{outcome="ok"}')
        assert moved + metric(r, "flexpipe_retries_total") >= 1
        assert metric(r, 'flexpipe_migrations_total{outcome="failed"}') == 0
    finally:
        r.close()


def test_503_is_retried_once_on_another_instance_500_is_relayed(lt: LoopThread) -> None:
    r = Running(lt, [FakeEngine(mode="503"), FakeEngine()], routing={"policy": "round_robin"})
    try:
        for _ in range(4):
            out = r.client().completions.create(model="fake-model", prompt="x", max_tokens=2)
            assert out.choices[0].text == "t0 t1 "
        num_retries = metric(r, 'flexpipe_retries_total{reason="503"}')
        assert 1 <= num_retries == r.engines[0].num_requests <= 4  # one retry per 503, no more
    finally:
        r.close()
    r = Running(lt, [FakeEngine(mode="500")])
    try:
        with pytest.raises(openai.InternalServerError):
            r.client().completions.create(model="fake-model", prompt="x")
        assert r.engines[0].num_requests == 1  # not retried
        r.engines[0].mode = "ok"
        assert r.client().completions.create(model="fake-model", prompt="x", max_tokens=1)
    finally:
        r.close()


def test_connect_error_retries_and_dead_backend_is_ejected(lt: LoopThread) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    r = Running(lt, [FakeEngine()], routing={"policy": "round_robin"}, health_interval_s=0.1)
    try:
        r.gw.pool.add(dead, "fake-model")
        for _ in range(4):
            assert r.client().completions.create(model="fake-model", prompt="x", max_tokens=1)
        wait_for(lambda: not r.gw.pool.get(dead).healthy)
        assert metric(r, 'flexpipe_ejections_total{instance="' + dead) >= 1
    finally:
        r.close()


def test_hanging_engine_gets_a_504_and_is_ejected(lt: LoopThread) -> None:
    r = Running(lt, [FakeEngine(mode="hang")], ttfb_timeout_s=0.3, eject_after_failures=2)
    try:
        for _ in range(2):
            with pytest.raises(openai.APIStatusError) as info:
                r.client().completions.create(model="fake-model", prompt="x")
            assert info.value.status_code == 504
        assert not r.gw.pool.instances[r.engines[0].url].healthy
        with pytest.raises(openai.APIStatusError) as info:
            r.client().completions.create(model="fake-model", prompt="x")
        assert info.value.status_code == 503  # no healthy instance: clear error, not silence
    finally:
        r.close()


def test_stalled_stream_is_migrated_after_the_idle_timeout(lt: LoopThread) -> None:
    # engine and gateway share one loop: the idle bound (0.2 s after t0 arrives) falls due
    # 0.4 s before the next token, whatever t0's hop costs up to that
    slow, fast = FakeEngine(token_delay_s=0.6), FakeEngine()
    r = Running(lt, [slow, fast], idle_timeout_s=0.2)
    try:
        r.gw.pool.drain(fast.url)  # the stream starts on `slow`
        stream = r.client().completions.create(
            model="fake-model", prompt="x", max_tokens=4, stream=True
        )
        it = iter(stream)
        first = next(it)  # t0 after 0.6 s; the next one would take another 0.6 s > idle timeout
        r.gw.pool.activate(fast.url)
        chunks = [first, *(c for c in it if c.choices)]
        # the continuation asked `fast` for the 3 remaining tokens after prompt "x" + "t0 "
        assert "".join(c.choices[0].text for c in chunks) == "t0 t0 t1 t2 "
        assert fast.bodies[-1]["prompt"] == "xt0 " and fast.bodies[-1]["max_tokens"] == 3
        assert {c.id for c in chunks} == {first.id}
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        r.close()


def test_dying_engine_with_nowhere_to_go_ends_with_an_error_event(lt: LoopThread) -> None:
    r = Running(lt, [FakeEngine(mode="die", die_after=2)])
    try:
        stream = r.client().completions.create(
            model="fake-model", prompt="x", max_tokens=6, stream=True
        )
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
    finally:
        r.close()


def test_health_ejection_and_readmission(lt: LoopThread) -> None:
    sick, well = FakeEngine(), FakeEngine()
    r = Running(
        lt, [sick, well], health_interval_s=0.05, eject_after_failures=1,
        eject_base_backoff_s=0.1,
    )  # fmt: skip
    try:
        sick.healthy = False
        inst = r.gw.pool.instances[sick.url]
        wait_for(lambda: not inst.healthy)
        before = sick.num_requests
        for _ in range(3):
            r.client().completions.create(model="fake-model", prompt="x", max_tokens=1)
        assert sick.num_requests == before
        sick.healthy = True
        wait_for(lambda: inst.healthy)
    finally:
        r.close()


def test_drain_lets_in_flight_finish_and_sends_new_work_elsewhere(lt: LoopThread) -> None:
    a, b = FakeEngine(token_delay_s=0.05), FakeEngine()
    r = Running(lt, [a, b], routing={"policy": "round_robin"})
    try:
        stream = r.client().completions.create(
            model="fake-model", prompt="x", max_tokens=8, stream=True
        )
        it = iter(stream)
        next(it)
        served_by = a if a.num_active else b
        r.gw.pool.drain(served_by.url)
        other = b if served_by is a else a
        for _ in range(3):
            r.client().completions.create(model="fake-model", prompt="y", max_tokens=1)
        rest = [c.choices[0].text for c in it if c.choices]
        assert len(rest) == 7 and served_by.num_requests == 1 and other.num_requests == 3
    finally:
        r.close()


def test_client_disconnect_cancels_the_upstream(lt: LoopThread) -> None:
    slow = FakeEngine(token_delay_s=0.05)
    r = Running(lt, [slow])
    try:
        stream = r.client().completions.create(
            model="fake-model", prompt="x", max_tokens=200, stream=True
        )
        it = iter(stream)
        next(it)
        next(it)
        stream.close()
        wait_for(lambda: slow.num_cancelled == 1, 5)
        wait_for(lambda: r.gw.pool.instances[slow.url].num_in_flight == 0, 5)
    finally:
        r.close()


def test_full_pool_queues_then_answers_429_with_retry_after(lt: LoopThread) -> None:
    slow = FakeEngine(token_delay_s=0.5)
    r = Running(lt, [slow], max_concurrency_per_instance=1, max_queue=1, max_queue_wait_s=5)

    inst = r.gw.pool.instances[slow.url]

    async def until(cond: Any) -> None:
        deadline = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.01)

    async def burst() -> list[int]:
        client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)

        async def one() -> int:
            try:  # streamed: the fake engine paces streamed tokens only (3 x 0.5 s)
                stream = await client.completions.create(
                    model="fake-model", prompt="x", max_tokens=3, stream=True
                )
                async for _ in stream:
                    pass
                return 200
            except openai.RateLimitError as exc:
                assert int(exc.response.headers["retry-after"]) >= 1
                return 429

        try:  # in order (a loaded machine must not let the first finish before the third)
            first = asyncio.create_task(one())
            await until(lambda: inst.num_in_flight == 1)
            second = asyncio.create_task(one())
            await until(lambda: r.gw.num_waiting == 1)
            third = await one()
            return [await first, await second, third]
        finally:
            await client.close()

    try:
        codes = asyncio.run(burst())
        assert codes == [200, 200, 429]  # one runs, one waits in the queue, one refused
    finally:
        r.close()


def test_slow_engine_receives_less_traffic_under_least_load(lt: LoopThread) -> None:
    # 40x apart, so the gateway's and client's own time per request on a loaded 2-core
    # machine (tens of ms) cannot close the gap the assertion measures
    fast, slow = FakeEngine(token_delay_s=0.002), FakeEngine(token_delay_s=0.08)
    r = Running(lt, [fast, slow], routing={"policy": "least_load"}, scrape_interval_s=0.1)

    async def load() -> None:
        client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        sem = asyncio.Semaphore(6)

        async def one() -> None:
            async with sem:
                s = await client.completions.create(
                    model="fake-model", prompt="x", max_tokens=10, stream=True
                )
                async for _ in s:
                    pass

        try:
            await asyncio.gather(*(one() for _ in range(60)))
        finally:
            await client.close()

    try:
        asyncio.run(load())
        assert slow.num_requests < fast.num_requests / 2
    finally:
        r.close()
