"""The gateway's OpenAI API with the official `openai` client, its bad-input answers, the
admin API and tenants. Upstreams are fake engines on real sockets (tests/test_gateway_fakes)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest
from test_gateway_fakes import FakeEngine, LoopThread

from flexpipe.gateway.app import Gateway
from flexpipe.gateway.body_parser import PARSE_OFF_LOOP_BYTES
from flexpipe.gateway.config import config_from_dict


class Running:
    def __init__(self, lt: LoopThread, engines: list[FakeEngine], **cfg: Any) -> None:
        self.lt = lt
        self.engines = [lt.run(e.start()) for e in engines]
        data = {"backends": [{"url": e.url} for e in self.engines], **cfg}
        self.gw = Gateway(config_from_dict(data))
        server = lt.run(self.gw.start("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{server.port}"

    def client(self, key: str = "none", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def http(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        req = urllib.request.Request(self.url + path, body, headers or {}, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def close(self) -> None:
        self.lt.run(self.gw.close())
        for e in self.engines:
            self.lt.run(e.stop())


@pytest.fixture
def gw(lt: LoopThread) -> Iterator[Running]:
    r = Running(lt, [FakeEngine(), FakeEngine()], admin_token="s3cret")
    try:
        yield r
    finally:
        r.close()


def test_completions_and_chat_stream_and_not(gw: Running) -> None:
    c = gw.client()
    assert [m.id for m in c.models.list().data] == ["fake-model"]
    r = c.completions.create(model="fake-model", prompt="hello", max_tokens=5)
    assert r.choices[0].text == "t0 t1 t2 t3 t4 " and r.usage and r.usage.completion_tokens == 5
    chat = c.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.choices[0].message.content == "t0 t1 t2 "
    chunks = list(
        c.completions.create(
            model="fake-model",
            prompt="hello",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "t0 t1 t2 t3 t4 t5 "
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert len({ch.id for ch in chunks}) == 1
    stream = c.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == "t0 t1 t2 t3 "
    # both engines got traffic (round robin is not the default, but two idle engines tie)
    assert sum(e.num_requests for e in gw.engines) == 4


def test_health_and_metrics(gw: Running) -> None:
    gw.client().completions.create(model="fake-model", prompt="x" * 300, max_tokens=2)
    status, _, _ = gw.http("GET", "/health")
    assert status == 200
    status, headers, body = gw.http("GET", "/metrics")
    text = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert 'flexpipe_requests_total{instance="' in text and 'status="200"' in text
    assert 'flexpipe_routing_decisions_total{policy="prefix_affinity"' in text
    assert 'flexpipe_prefix_blocks_total{kind="all"} 4.0' in text
    assert "flexpipe_e2e_request_latency_seconds_bucket" in text


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "Invalid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"model": 3, "prompt": "x"}', 400, "model"),
        (b'{"model": "fake-model", "prompt": 5}', 400, "prompt"),
        (b'{"model": "fake-model", "prompt": "x", "max_tokens": "9"}', 400, "max_tokens"),
        (b'{"model": "fake-model", "prompt": "x", "stream": "yes"}', 400, "stream"),
        (b'{"model": "nope", "prompt": "x"}', 404, "does not exist"),
    ],
)
def test_bad_input_is_a_clear_4xx_and_the_gateway_keeps_serving(
    gw: Running, body: bytes, status: int, needle: str
) -> None:
    got, _, raw = gw.http("POST", "/v1/completions", body, {"content-type": "application/json"})
    err = orjson.loads(raw)["error"]
    assert got == status and needle in err["message"] and err["code"] == status
    assert gw.client().completions.create(model="fake-model", prompt="x", max_tokens=1)


def test_a_large_body_is_validated_off_the_loop_and_served_as_a_small_one(
    lt: LoopThread,
) -> None:
    """Over PARSE_OFF_LOOP_BYTES the body is validated in a parser process: the same answers
    (a 400 naming its field, usage with include_usage), and a stream that must continue
    elsewhere gets its continuation from the body parsed again on the gateway."""
    dying, healthy = FakeEngine(mode="die", die_after=2, token_delay_s=0.3), FakeEngine()
    r = Running(lt, [dying, healthy])
    prompt = "w" * (PARSE_OFF_LOOP_BYTES + 1000)
    try:
        bad = orjson.dumps({"model": "fake-model", "prompt": prompt, "max_tokens": "9"})
        status, _, raw = r.http(
            "POST", "/v1/completions", bad, {"content-type": "application/json"}
        )
        assert status == 400 and orjson.loads(raw)["error"]["param"] == "max_tokens", raw[:300]
        r.gw.pool.drain(healthy.url)  # the stream starts on the dying engine
        stream = r.client().completions.create(
            model="fake-model", prompt=prompt, max_tokens=5, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        it = iter(stream)
        first = next(it)
        r.gw.pool.activate(healthy.url)
        chunks = [first, *it]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == "t0 t1 t0 t1 t2 "  # two from the dying engine, three continued
        assert healthy.bodies[-1]["prompt"] == prompt + "t0 t1 "
        assert healthy.bodies[-1]["max_tokens"] == 3
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
        assert {c.id for c in chunks} == {first.id}
        # the slot is released as the relay ends, just after the client read the last chunk
        deadline_s = time.monotonic() + 5.0
        while sum(i.num_in_flight for i in r.gw.pool.instances.values()) and (
            time.monotonic() < deadline_s
        ):
            time.sleep(0.01)
        assert sum(i.num_in_flight for i in r.gw.pool.instances.values()) == 0
    finally:
        r.close()


def test_bad_chat_and_oversized_body(lt: LoopThread) -> None:
    r = Running(lt, [FakeEngine()], max_body_bytes=1000)
    try:
        with pytest.raises(openai.BadRequestError, match="messages"):
            r.client().chat.completions.create(model="fake-model", messages=[])
        status, _, raw = r.http("POST", "/v1/completions", b'{"prompt": "' + b"x" * 5000 + b'"}')
        assert status == 413 and b"too large" in raw
        assert r.client().completions.create(model="fake-model", prompt="x", max_tokens=1)
    finally:
        r.close()


def test_admin_api_needs_the_token_and_drives_the_pool(gw: Running) -> None:
    a, b = gw.engines
    status, _, raw = gw.http("GET", "/admin/instances")
    assert status == 401 and orjson.loads(raw)["error"]["code"] == 401
    status, _, _ = gw.http("GET", "/admin/instances", headers={"authorization": "Bearer wrong"})
    assert status == 401
    auth = {"authorization": "Bearer s3cret", "content-type": "application/json"}
    status, _, raw = gw.http("GET", "/admin/instances", headers=auth)
    assert status == 200 and len(orjson.loads(raw)["instances"]) == 2
    # drain a: all new traffic goes to b
    status, _, raw = gw.http("POST", "/admin/instances/drain", orjson.dumps({"url": a.url}), auth)
    assert status == 200 and orjson.loads(raw)["state"] == "draining"
    before = a.num_requests
    for _ in range(4):
        gw.client().completions.create(model="fake-model", prompt="x", max_tokens=1)
    assert a.num_requests == before
    # re-weight, remove, add back
    body = orjson.dumps({"url": b.url, "weight": 3})
    status, _, raw = gw.http("POST", "/admin/instances/weight", body, auth)
    assert status == 200 and orjson.loads(raw)["weight"] == 3
    body = orjson.dumps({"url": b.url, "weight": "heavy"})
    assert gw.http("POST", "/admin/instances/weight", body, auth)[0] == 400
    status, _, _ = gw.http("POST", "/admin/instances/remove", orjson.dumps({"url": b.url}), auth)
    assert status == 200
    assert gw.http("POST", "/admin/instances/remove", orjson.dumps({"url": b.url}), auth)[0] == 404
    status, _, raw = gw.http("POST", "/admin/instances", orjson.dumps({"url": b.url}), auth)
    assert status == 200 and orjson.loads(raw)["model"] == "fake-model"  # discovered
    assert gw.client().completions.create(model="fake-model", prompt="x", max_tokens=1)
    assert gw.http("POST", "/admin/instances/drain", b"{}", auth)[0] == 400


def test_admin_api_moves_an_instance_along_its_one_lifecycle(gw: Running) -> None:
    """starting → rehearsing → active → draining → gone in the pool, each move checked by
    flexpipe/lifecycle.py (an illegal one is a 409 naming both ends); only active takes
    traffic; health is a separate flag, shown in the list and in /metrics."""
    a, b = gw.engines
    auth = {"authorization": "Bearer s3cret", "content-type": "application/json"}

    def post(path: str, **body: Any) -> tuple[int, dict[str, Any]]:
        status, _, raw = gw.http("POST", path, orjson.dumps(body), auth)
        return status, orjson.loads(raw)

    def state_of(url: str) -> tuple[str, bool]:
        raw = gw.http("GET", "/admin/instances", headers=auth)[2]
        inst = next(i for i in orjson.loads(raw)["instances"] if i["url"] == url)
        return inst["state"], inst["healthy"]

    def served_by_b() -> int:
        before = b.num_requests
        for _ in range(4):
            gw.client().completions.create(model="fake-model", prompt="x", max_tokens=1)
        return b.num_requests - before

    assert post("/admin/instances/remove", url=b.url)[0] == 200
    status, doc = post("/admin/instances", url=b.url, model="fake-model", state="starting")
    assert status == 200 and (doc["state"], doc["healthy"]) == ("starting", True)
    assert served_by_b() == 0  # not routed while starting
    status, doc = post("/admin/instances/state", url=b.url, state="draining")
    assert status == 409 and "illegal transition starting → draining" in doc["error"]["message"]
    assert post("/admin/instances/state", url=b.url, state="rehearsing")[0] == 200
    assert state_of(b.url) == ("rehearsing", True) and served_by_b() == 0
    assert post("/admin/instances/state", url=b.url, state="active")[0] == 200
    assert [i.url for i in gw.gw.pool.routable("fake-model")] == [a.url, b.url]
    assert post("/admin/instances/drain", url=a.url)[1]["state"] == "draining"
    assert served_by_b() == 4  # a drains: b takes everything
    assert post("/admin/instances/activate", url=a.url)[1]["state"] == "active"
    metrics = gw.http("GET", "/metrics")[2].decode()
    assert f'flexpipe_instance_up{{instance="{b.url}",state="active"}} 1.0' in metrics
    assert post("/admin/instances/state", url=b.url, state="sleeping")[0] == 400
    assert post("/admin/instances", url=a.url + "/x", state="draining")[0] == 400
    # ejected: still active in its lifecycle, out of routing until a probe succeeds
    gw.lt.run(_eject(gw, b.url))
    assert state_of(b.url) == ("active", False) and served_by_b() == 0
    metrics = gw.http("GET", "/metrics")[2].decode()
    assert f'flexpipe_instance_up{{instance="{b.url}",state="active"}} 0.0' in metrics
    gw.gw.pool.readmit(gw.gw.pool.get(b.url))
    assert post("/admin/instances/drain", url=b.url)[1]["state"] == "draining"
    assert post("/admin/instances/state", url=b.url, state="gone")[0] == 200
    assert all(i.url != b.url for i in gw.gw.pool.instances.values())
    assert post("/admin/instances/state", url=b.url, state="active")[0] == 404


async def _eject(gw: Running, url: str) -> None:
    gw.gw.eject(gw.gw.pool.get(url))


def test_tenants_keys_and_quotas(lt: LoopThread) -> None:
    tenants = [
        {"key": "sk-a", "name": "a", "requests_per_min": 2},
        {"key": "sk-b", "name": "b", "tokens_per_min": 100},
    ]
    r = Running(lt, [FakeEngine()], tenants=tenants)
    try:
        with pytest.raises(openai.AuthenticationError):
            r.client("sk-unknown").completions.create(model="fake-model", prompt="x")
        status, _, _ = r.http("POST", "/v1/completions", b'{"model": "fake-model", "prompt": "x"}')
        assert status == 401
        a = r.client("sk-a")
        a.completions.create(model="fake-model", prompt="x", max_tokens=1)
        a.completions.create(model="fake-model", prompt="x", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as info:
            a.completions.create(model="fake-model", prompt="x", max_tokens=1)
        assert int(info.value.response.headers["retry-after"]) >= 1
        assert "sk-a" not in info.value.response.text
        b = r.client("sk-b")
        b.completions.create(model="fake-model", prompt="x", max_tokens=50)
        with pytest.raises(openai.RateLimitError, match="tokens per minute"):
            b.completions.create(model="fake-model", prompt="x", max_tokens=60)
    finally:
        r.close()
