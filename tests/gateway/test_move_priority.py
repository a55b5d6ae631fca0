"""A stream moved onto a full instance (a shift's drain) lands there at once and is admitted
ahead of the requests already waiting in that engine: the gateway takes the controller's
target even at its limit and sends the move with a negative priority, and the engine
(`--scheduling-policy priority`) serves it first. Moved twice, it stays seamless. Real sim
engines, real HTTP, the official client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import openai
import orjson
import pytest
from test_gateway_fakes import LoopThread
from test_gateway_moves import ADMIN, AUTH, MODEL, requests_on
from test_gateway_moves import gateway as make_gateway

from flexpipe.engine.testing import EngineProc, sim_engine

BASE = [MODEL, "--load-time-s", "0", "--time-scale", "1", "--admin-token", ADMIN,
        "--scheduling-policy", "priority"]  # fmt: skip


@pytest.fixture(scope="module")
def engines() -> Iterator[list[EngineProc]]:
    with ExitStack() as stack:
        source = stack.enter_context(sim_engine(BASE))
        one_slot = stack.enter_context(sim_engine([*BASE, "--max-num-seqs", "1"]))
        other = stack.enter_context(sim_engine(BASE))
        yield [source, one_slot, other]


def register(r: Any, url: str, max_num_seqs: int = 0) -> None:
    body = {"url": url, "model": MODEL, "admin_token": ADMIN, "max_num_seqs": max_num_seqs}
    assert r.http("POST", "/admin/instances", orjson.dumps(body), AUTH)[0] == 200


def move(r: Any, call_id: int, method: str, target: str) -> str:
    moves = [{"id": call_id, "method": method, "target": target, "bandwidth_bytes_per_s": 50e9}]
    status, _, raw = r.http("POST", "/admin/requests/move", orjson.dumps({"moves": moves}), AUTH)
    assert status == 200
    return str(orjson.loads(raw)["results"][0]["outcome"])


@pytest.mark.parametrize("method", ["recompute", "kv"])
def test_a_move_onto_a_full_instance_goes_ahead_of_its_queue(
    lt: LoopThread, engines: list[EngineProc], method: str
) -> None:
    source, full = engines[0].url, engines[1].url
    r = make_gateway(lt, [engines[0]])
    register(r, full, max_num_seqs=1)  # its gateway limit: 1 request

    async def scenario() -> tuple[float, float, int, str]:
        gw_client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
        direct = openai.AsyncOpenAI(base_url=full + "/v1", api_key="x", max_retries=0)
        stream = await gw_client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=60, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        it = stream.__aiter__()
        for _ in range(5):
            await it.__anext__()
        (moved,) = requests_on(r, source)
        drain = orjson.dumps({"url": source, "wait_s": 0})  # a shift: nothing new goes there
        assert r.http("POST", "/admin/instances/drain", drain, AUTH)[0] == 200
        # `full`: one request running (through the gateway: at its limit there), one waiting
        # in the engine (sent to it directly), both before the move
        long = {"max_tokens": 80, "extra_body": {"ignore_eos": True}}
        running = asyncio.create_task(
            gw_client.completions.create(model=MODEL, prompt="busy " * 20, **long)
        )
        deadline = time.monotonic() + 20
        while not requests_on(r, full):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(
            direct.completions.create(model=MODEL, prompt="queued " * 20, **long)
        )
        await asyncio.sleep(0.05)
        outcome = await asyncio.to_thread(move, r, moved["id"], method, full)
        n = 5
        async for ch in it:
            n += 1 if ch.choices and ch.choices[0].text else 0
        stream_end = time.monotonic()
        await queued
        queued_end = time.monotonic()
        await running
        await gw_client.close()
        await direct.close()
        return stream_end, queued_end, n, outcome

    try:
        stream_end, queued_end, num_tokens, outcome = asyncio.run(scenario())
        assert outcome == method and num_tokens == 60
        # one slot: the moved stream ran to its end before the request that waited there
        assert stream_end < queued_end
        assert r.gw.num_active_calls == 0
    finally:
        r.close()


def test_a_stream_moved_twice_is_seamless(lt: LoopThread, engines: list[EngineProc]) -> None:
    """The second move takes a stream the gateway already relays from its first move (it was
    refused as "not running" before, and the drain waited until its instance stopped)."""
    first, second, third = engines[0].url, engines[2].url, engines[1].url
    r = make_gateway(lt, [engines[0]])
    try:
        stream = r.client().completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=90, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        register(r, second)  # after the stream started on `first`
        register(r, third, max_num_seqs=1)
        pieces: list[str] = []
        outcomes: list[str] = []
        ids, usage = set(), None
        for ch in stream:
            ids.add(ch.id)
            usage = ch.usage or usage
            if ch.choices and ch.choices[0].text:
                pieces.append(ch.choices[0].text)
            if len(pieces) == 10 and not outcomes:
                (req,) = requests_on(r, first)
                outcomes.append(move(r, req["id"], "kv", second))
            if len(pieces) == 40 and len(outcomes) == 1:
                (req,) = requests_on(r, second)
                assert req["num_output_tokens"] >= 40  # what the client got (priced on it)
                outcomes.append(move(r, req["id"], "kv", third))
        assert outcomes == ["kv", "kv"]
        assert len(pieces) == 90 and len(ids) == 1
        assert usage is not None and usage.completion_tokens == 90
        deadline = time.monotonic() + 5  # the relay ends its call just after the last write
        while r.gw.num_active_calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.gw.num_active_calls == 0
    finally:
        r.close()
