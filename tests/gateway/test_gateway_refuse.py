"""A model no GPU free to us can place (`POST /admin/models/refuse`): its requests get a 503
with the reason and a Retry-After at once, those already queued for it too; it stays listed;
a hold lifts the refusal. Real HTTP on 127.0.0.1, the official `openai` client."""

from __future__ import annotations

import asyncio
import time

import openai
import orjson
import pytest
from test_gateway_api import Running
from test_gateway_exits import held_queue_then, idle
from test_gateway_fakes import FakeEngine, LoopThread

from flexpipe.gateway.core.holds import REFUSED_RETRY_AFTER_S, Holds

AUTH = {"authorization": "Bearer t", "content-type": "application/json"}
WHY = "no GPU free to us can place fake-model: every GPU is held by batch job"


def refuse(r: Running, reason: str = WHY) -> None:
    body = orjson.dumps({"model": "fake-model", "reason": reason})
    assert r.http("POST", "/admin/models/refuse", body, AUTH)[0] == 200


def test_holds_a_refusal_ends_the_hold_and_a_hold_lifts_the_refusal() -> None:
    holds = Holds()
    holds.hold("m", 600.0, now=0.0)
    holds.refuse("m", "too big", 600.0, now=10.0)
    assert holds.refused("m", 10.0) == "too big" and not holds.held("m", 10.0)
    assert holds.models(10.0) == {"m"}  # still listed
    assert holds.wait_deadline("m", 25.0, arrival_s=5.0, queue_wait_s=15.0) == 25.0
    holds.hold("m", 600.0, now=20.0)
    assert holds.refused("m", 20.0) is None and holds.held("m", 20.0)
    holds.refuse("m", "too big", 600.0, now=30.0)
    holds.hold("m", 0.0, now=40.0)  # the model serves again: the refusal is lifted too
    assert holds.refused("m", 40.0) is None and holds.models(40.0) == set()
    # a refusal nobody renews lapses (the controller renews it every tick), as a hold does
    holds.refuse("m", "too big", 600.0, now=50.0)
    assert holds.refused("m", 649.0) == "too big" and holds.models(649.0) == {"m"}
    assert holds.refused("m", 650.0) is None and holds.models(650.0) == set()


def test_a_refused_model_is_answered_503_with_its_reason_and_stays_listed(
    lt: LoopThread,
) -> None:
    r = Running(lt, [], admin_token="t")
    try:
        client = r.client()
        with pytest.raises(openai.NotFoundError):  # unknown and not refused: 404 as before
            client.completions.create(model="fake-model", prompt="x", max_tokens=2)
        refuse(r)
        assert [m.id for m in client.models.list().data] == ["fake-model"]
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="fake-model", prompt="x", max_tokens=2)
        assert time.monotonic() - t0 < 3.0
        err = refused.value
        assert err.status_code == 503
        assert err.response.headers["retry-after"] == str(int(REFUSED_RETRY_AFTER_S))
        body = err.response.json()["error"]
        assert "fake-model" in body["message"] and WHY in body["message"]
        assert body["param"] == "model"
        # a hold lifts the refusal: the request waits, and is served once an instance joins
        hold = b'{"model": "fake-model", "seconds": 30}'
        assert r.http("POST", "/admin/models/hold", hold, AUTH)[0] == 200
        assert r.gw.refused("fake-model") is None
        engine = lt.run(FakeEngine().start())
        r.engines.append(engine)

        async def served() -> str:
            aclient = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
            try:
                task = asyncio.create_task(
                    aclient.completions.create(model="fake-model", prompt="x", max_tokens=2)
                )
                await asyncio.sleep(0.3)
                assert not task.done()  # held: it waits for the instance
                add = {"url": engine.url, "model": "fake-model", "max_concurrency": 4}
                status = await asyncio.to_thread(
                    r.http, "POST", "/admin/instances", orjson.dumps(add), AUTH
                )
                assert status[0] == 200
                out = await asyncio.wait_for(task, 10)
                return out.choices[0].text
            finally:
                await aclient.close()

        assert asyncio.run(served())
    finally:
        r.close()


def test_requests_queued_for_a_held_model_get_the_503_when_it_is_refused(
    lt: LoopThread,
) -> None:
    r = Running(lt, [], max_queue_wait_s=0.2, admin_token="t")
    try:
        hold = b'{"model": "fake-model", "seconds": 300}'
        assert r.http("POST", "/admin/models/hold", hold, AUTH)[0] == 200

        errors, took_s = held_queue_then(r, lambda: refuse(r))
        assert took_s < 3.0  # at once, not the hold's 300 s
        for e in errors:
            assert isinstance(e, openai.APIStatusError) and e.status_code == 503
            assert WHY in e.response.json()["error"]["message"]
            assert e.response.headers["retry-after"]
        assert idle(r)
    finally:
        r.close()


def test_refuse_rejects_bad_input_with_an_openai_error(lt: LoopThread) -> None:
    r = Running(lt, [], admin_token="t")
    try:
        for body, param in (
            (b'{"model": "", "reason": "x"}', "model"),
            (b'{"model": "m"}', "reason"),
            (b'{"model": "m", "reason": "  "}', "reason"),
            (b'{"model": "m", "reason": "x", "seconds": -1}', "seconds"),
            (b'{"model": "m", "reason": "x", "seconds": true}', "seconds"),
        ):
            status, _, out = r.http("POST", "/admin/models/refuse", body, AUTH)
            assert status == 400 and orjson.loads(out)["error"]["param"] == param
        status, _, _ = r.http("POST", "/admin/models/refuse", b'{"model": "m", "reason": "x"}')
        assert status == 401  # the admin token is required
        assert r.gw.refused("m") is None
    finally:
        r.close()
