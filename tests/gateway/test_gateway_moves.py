"""The controller's moves at a drain deadline, through the gateway's admin API: a stream
moved with its KV cache (the engines' export/import hooks) or by recompute, a non-streamed
request re-run, each seamless for the client. Real sim engines, the official client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import openai
import orjson
import pytest
from test_gateway_api import Running
from test_gateway_fakes import LoopThread

from flexpipe.engine.testing import EngineProc, sim_engine
from flexpipe.engine.tokenizer import WORDS
from flexpipe.gateway import moves
from flexpipe.gateway.core.cut_over import MAX_FENCE_S
from flexpipe.gateway.core.pool import Pool

MODEL = "llama-2-7b"
ADMIN = "engine-admin"
AUTH = {"authorization": "Bearer gw-admin", "content-type": "application/json"}


@pytest.fixture(scope="module")
def engines() -> Iterator[list[EngineProc]]:
    args = [MODEL, "--load-time-s", "0", "--time-scale", "1", "--admin-token", ADMIN]
    with ExitStack() as stack:
        yield [stack.enter_context(sim_engine(args)) for _ in range(2)]


def gateway(lt: LoopThread, engines: list[EngineProc]) -> Running:
    r = Running(lt, [], admin_token="gw-admin", routing={"policy": "round_robin"})
    for e in engines:
        body = orjson.dumps({"url": e.url, "model": MODEL, "admin_token": ADMIN})
        assert r.http("POST", "/admin/instances", body, AUTH)[0] == 200
    return r


def requests_on(r: Running, url: str) -> list[dict[str, Any]]:
    status, _, raw = r.http("GET", f"/admin/instances/requests?url={url}", None, AUTH)
    assert status == 200
    return list(orjson.loads(raw)["requests"])


def move_all(
    r: Running, source: str, target: str, method: str, bandwidth_bytes_per_s: float = 50e9
) -> list[str]:
    """Wait until `source` serves something, then move all of it to `target`."""
    deadline = time.monotonic() + 10
    while not (reqs := requests_on(r, source)) or any(q["num_output_tokens"] < 5 for q in reqs):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    moves = [{"id": q["id"], "method": method, "target": target,
              "bandwidth_bytes_per_s": bandwidth_bytes_per_s} for q in reqs]  # fmt: skip
    status, _, raw = r.http("POST", "/admin/requests/move", orjson.dumps({"moves": moves}), AUTH)
    assert status == 200
    return [x["outcome"] for x in orjson.loads(raw)["results"]]


@pytest.mark.parametrize("method", ["kv", "recompute"])
@pytest.mark.parametrize("chat", [True, False])
def test_a_moved_stream_is_seamless(
    lt: LoopThread,
    engines: list[EngineProc],
    method: str,
    chat: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source, target = engines[0].url, engines[1].url
    fenced: list[tuple[str, object, float, float]] = []
    lifted: list[tuple[str, object]] = []
    fence, unfence = Pool.fence, Pool.unfence
    exports: list[dict[str, Any] | None] = []
    export_state = moves.export_state

    async def spy_export(*args: Any) -> dict[str, Any] | None:
        exports.append(await export_state(*args))
        return exports[-1]

    def spy_fence(self: Pool, url: str, key: object, until_s: float, now: float) -> Any:
        fenced.append((url, key, until_s, now))
        return fence(self, url, key, until_s, now)

    def spy_unfence(self: Pool, url: str, key: object) -> None:
        lifted.append((url, key))
        call = r.gw.call(key) if isinstance(key, int) else None
        state = call.stream_state if call is not None else None
        assert state is not None and state.num_tokens > state.num_tokens_at_join, (
            "lifted before a token came from the destination (chat's role-only event?)"
        )
        unfence(self, url, key)

    monkeypatch.setattr(Pool, "fence", spy_fence)
    monkeypatch.setattr(Pool, "unfence", spy_unfence)
    monkeypatch.setattr(moves, "export_state", spy_export)
    r = gateway(lt, [engines[0]])
    try:
        client = r.client()
        kw: dict[str, Any] = {"model": MODEL, "max_tokens": 120, "stream": True,
                              "stream_options": {"include_usage": True},
                              "extra_body": {"ignore_eos": True}}  # fmt: skip
        if chat:
            stream: Any = client.chat.completions.create(
                messages=[{"role": "user", "content": "tell me a long story"}], **kw
            )
        else:
            stream = client.completions.create(prompt="Once upon a time", **kw)
        body = orjson.dumps({"url": target, "model": MODEL, "admin_token": ADMIN})
        assert r.http("POST", "/admin/instances", body, AUTH)[0] == 200
        # a measured speed (a fresh instance has none, and is then fenced for MAX_FENCE_S
        # whatever the wait): two of its steps are 2 ms, so the fence is the wait's
        r.gw.pool.instances[target].speed_tokens_per_s = 1000.0
        outcomes: list[str] = []
        pieces, ids, finish, usage = [], set(), None, None
        for ch in stream:
            ids.add(ch.id)
            if ch.usage is not None:
                usage = ch.usage
            if ch.choices:
                c = ch.choices[0]
                piece = c.delta.content if chat else c.text
                if piece:
                    pieces.append(piece)
                finish = c.finish_reason or finish
                if len(pieces) == 10 and not outcomes:
                    # a slow link (50 MB/s): the KV's 7-13 MB take 0.15-0.26 s, longer than
                    # two steps of the target and shorter than MAX_FENCE_S
                    outcomes = move_all(r, source, target, method, 50e6)
        assert outcomes == [method]
        assert len(ids) == 1 and finish == "length"
        assert len(pieces) == 120  # every token once: none lost, none repeated
        text = "".join(pieces)
        assert not chat or not text[0].isspace()
        assert all(w.strip(",.;:") in WORDS or w in WORDS for w in text.split())  # no glue
        assert usage is not None and usage.completion_tokens == 120
        assert requests_on(r, source) == [] and requests_on(r, target) == []
        assert r.gw.num_active_calls == 0
        # new requests kept off the target while it cut over, until its first token there
        ((url, key, until_s, now),) = fenced
        assert url == target and 0 < until_s - now <= MAX_FENCE_S
        if method == "kv":  # ... and through the KV's transfer there, as the engine priced it
            ((export,),) = [exports]
            assert export is not None and 0.1 < export["transfer_s"] < MAX_FENCE_S, export
            assert until_s - now >= min(export["transfer_s"], MAX_FENCE_S)
        assert lifted == [(target, key)] and not r.gw.pool.instances[target].fences
    finally:
        r.close()


def test_a_moved_non_streamed_request_is_re_run_and_drain_waits_for_the_event(
    lt: LoopThread, engines: list[EngineProc]
) -> None:
    source, target = engines[0].url, engines[1].url
    r = gateway(lt, [engines[0]])
    try:

        async def scenario() -> tuple[Any, list[str], dict[str, Any]]:
            client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
            task = asyncio.create_task(
                client.completions.create(model=MODEL, prompt="hi", max_tokens=300)
            )
            while not requests_on(r, source):
                await asyncio.sleep(0.02)
            body = orjson.dumps({"url": target, "model": MODEL, "admin_token": ADMIN})
            assert r.http("POST", "/admin/instances", body, AUTH)[0] == 200
            drain = asyncio.to_thread(
                r.http, "POST", "/admin/instances/drain",
                orjson.dumps({"url": source, "wait_s": 20}), AUTH,
            )  # fmt: skip
            drain_task = asyncio.ensure_future(drain)
            await asyncio.sleep(0.2)
            outcomes = await asyncio.to_thread(move_all_now, r, source, target)
            out = await task
            _, _, raw = await drain_task
            await client.close()
            return out, outcomes, orjson.loads(raw)

        out, outcomes, drained = asyncio.run(scenario())
        assert outcomes == ["rerun"]
        assert out.usage.completion_tokens == 300 and out.choices[0].finish_reason == "length"
        assert drained["drained"] is True and drained["state"] == "draining"
    finally:
        r.close()


def move_all_now(r: Running, source: str, target: str) -> list[str]:
    moves = [{"id": q["id"], "method": "kv", "target": target} for q in requests_on(r, source)]
    status, _, raw = r.http("POST", "/admin/requests/move", orjson.dumps({"moves": moves}), AUTH)
    assert status == 200
    return [x["outcome"] for x in orjson.loads(raw)["results"]]


@pytest.mark.parametrize("bandwidth_bytes_per_s", [None, 0])
def test_a_kv_move_that_names_no_link_is_priced_at_the_default_one(
    lt: LoopThread, engines: list[EngineProc], bandwidth_bytes_per_s: float | None
) -> None:
    """No link (or 0) in the move: export and import are both priced at the default link
    (`sse.DEFAULT_KV_LINK_BYTES_PER_S`), and the move is still a KV move."""
    source, target = engines[0].url, engines[1].url
    r = gateway(lt, engines)
    try:
        client = r.client()
        stream = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=60, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        pieces: list[str] = []
        outcomes: list[str] = []
        for ch in stream:
            if ch.choices and ch.choices[0].text:
                pieces.append(ch.choices[0].text)
            if len(pieces) == 10 and not outcomes:
                on = source if requests_on(r, source) else target
                (q,) = requests_on(r, on)
                move = {"id": q["id"], "method": "kv", "target": target if on == source else source}
                if bandwidth_bytes_per_s is not None:
                    move["bandwidth_bytes_per_s"] = bandwidth_bytes_per_s
                status, _, raw = r.http(
                    "POST", "/admin/requests/move", orjson.dumps({"moves": [move]}), AUTH
                )
                assert status == 200
                outcomes = [x["outcome"] for x in orjson.loads(raw)["results"]]
        assert outcomes == ["kv"] and len(pieces) == 60
    finally:
        r.close()
