"""The dashboard's routes on a real gateway (real sockets, fake engines on real ports): the page
and its files, the JSON view after real requests through the official openai client, the
server-sent events (the whole view first, then only what is new), and every way a stream
ends releasing it: the client leaving, and the gateway closing."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from test_gateway_fakes import FakeEngine, LoopThread, free_port

from flexpipe.gateway.app import Gateway
from flexpipe.gateway.config import ConfigError, config_from_dict

INTERVAL_S = 0.2


class Running:
    def __init__(self, lt: LoopThread, **cfg: Any) -> None:
        self.lt = lt
        self.engines = [lt.run(FakeEngine().start()) for _ in range(2)]
        data = {"backends": [{"url": e.url} for e in self.engines], "ui_interval_s": INTERVAL_S,
                "admin_token": "s3cret", **cfg}  # fmt: skip
        self.gw = Gateway(config_from_dict(data))
        self.port = lt.run(self.gw.start("127.0.0.1", 0)).port
        self.closed = False

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.lt.run(self.gw.close())
        for e in self.engines:
            self.lt.run(e.stop())


@pytest.fixture
def running() -> Iterator[Running]:
    lt = LoopThread()
    r = Running(lt)
    try:
        yield r
    finally:
        r.close()
        lt.stop()


def wait_until(check: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("timed out")


class EventStream:
    """A client of /ui/events on its own connection, reading one event at a time."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        self.conn.request("GET", "/ui/events")
        self.resp = self.conn.getresponse()

    def next_event(self) -> tuple[str, dict[str, Any]]:
        name, data = "", ""
        while True:
            line = self.resp.readline().decode()
            if not line:
                raise EOFError("the stream ended")
            line = line.rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data += line[6:]
            elif line == "" and name:
                return name, json.loads(data)

    def close(self) -> None:
        self.resp.close()
        self.conn.close()


def test_the_page_and_its_files(running: Running) -> None:
    status, headers, body = running.get("/ui")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b'src="/ui/static/dashboard.js"' in body and b'id="gpu-map"' in body
    assert running.get("/ui/") == (status, headers, body)
    for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css"),
                       ("favicon.svg", "image/svg+xml")):  # fmt: skip
        status, headers, body = running.get(f"/ui/static/{name}")
        assert status == 200 and headers["content-type"].startswith(kind) and body
    status, _, body = running.get("/ui/static/../app.py")
    assert status == 404 and json.loads(body)["error"]["code"] == 404


def test_the_view_counts_the_requests_it_saw(running: Running) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="x",
                           max_retries=0)  # fmt: skip
    for i in range(3):
        client.completions.create(model="fake-model", prompt=f"hi {i}", max_tokens=4)
    list(client.completions.create(model="fake-model", prompt="s", max_tokens=4, stream=True))
    time.sleep(3 * INTERVAL_S)

    def view() -> dict[str, Any]:
        status, headers, body = running.get("/ui/api/view")
        assert status == 200 and headers["content-type"] == "application/json"
        doc: dict[str, Any] = json.loads(body)
        return doc

    v = view()
    assert sorted(i["url"] for i in v["instances"]) == sorted(e.url for e in running.engines)
    assert {i["state"] for i in v["instances"]} == {"active"}
    assert [m["name"] for m in v["models"]] == ["fake-model"]
    assert v["cluster"] is None and v["controller"] is None and v["admin_enabled"] is True
    # every request is in exactly one interval of the series
    done = sum(p["models"]["fake-model"]["request_rate_per_s"] * p["dt_s"]
               for p in v["series"] if "fake-model" in p["models"])  # fmt: skip
    assert abs(done - 4.0) < 0.05  # rates and intervals are rounded in the view
    ttft = [p["models"]["fake-model"]["ttft_s"]["p99"] for p in v["series"]
            if "fake-model" in p["models"]]  # fmt: skip
    assert sum(x is not None for x in ttft) == 1  # the stream's first token, in one interval
    later = view()["series"][-1]["t"]
    status, _, body = running.get(f"/ui/api/view?since={later}")
    assert status == 200 and all(p["t"] > later for p in json.loads(body)["series"])
    status, _, body = running.get("/ui/api/view?since=yesterday")
    assert status == 400 and json.loads(body)["error"]["param"] == "since"
    status, _, body = running.get("/ui/api/view?shifts=all")
    assert status == 200 and json.loads(body)["shifts_scope"] == "all"
    assert view()["shifts_scope"] == "run"  # this run's shifts unless asked for every one
    status, _, body = running.get("/ui/api/view?shifts=some")
    assert status == 400 and json.loads(body)["error"]["param"] == "shifts"


def test_events_push_the_view_then_what_is_new_and_a_leaving_client_frees_its_stream(
    running: Running,
) -> None:
    a = EventStream(running.port)
    assert a.resp.status == 200 and a.resp.getheader("content-type") == "text/event-stream"
    name, first = a.next_event()
    assert name == "view" and first["source"] == "live" and len(first["instances"]) == 2
    b = EventStream(running.port)
    b.next_event()
    wait_until(lambda: running.gw.ui.num_streams == 2)
    last_t = first["series"][-1]["t"] if first["series"] else 0.0
    for _ in range(3):  # each later frame carries only the points this client lacks
        name, frame = a.next_event()
        assert name == "view" and len(frame["series"]) >= 1
        assert frame["series"][0]["t"] > last_t
        last_t = frame["series"][-1]["t"]
    a.close()
    wait_until(lambda: running.gw.ui.num_streams == 1)
    b.next_event()  # the other client is still served
    b.close()
    wait_until(lambda: running.gw.ui.num_streams == 0)


def test_closing_the_gateway_ends_the_streams(running: Running) -> None:
    s = EventStream(running.port)
    s.next_event()
    running.closed = True
    running.lt.run(running.gw.close())
    with pytest.raises(EOFError):
        while True:
            s.next_event()
    assert running.gw.ui.num_streams == 0
    s.close()


def test_an_unreachable_controller_is_said_not_fatal() -> None:
    lt = LoopThread()
    r = Running(lt, controller_url=f"http://127.0.0.1:{free_port()}")
    try:
        time.sleep(2 * INTERVAL_S)
        status, _, body = r.get("/ui/api/view")
        v = json.loads(body)
        assert status == 200 and v["cluster"] is None and len(v["instances"]) == 2
        assert v["controller"]["error"].startswith("cannot read the controller at http://")
    finally:
        r.close()
        lt.stop()


def test_the_dashboard_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="controller_url 'ftp://x': expected http://HOST:PORT"):
        config_from_dict({"controller_url": "ftp://x"})
    with pytest.raises(ConfigError, match="ui_interval_s must be > 0"):
        config_from_dict({"ui_interval_s": 0})
    monkeypatch.setenv("FLEXPIPE_CONTROLLER_TOKEN", "ctl-token")
    cfg = config_from_dict({"controller_url": "http://127.0.0.1:8100"})
    assert cfg.controller_token == "ctl-token" and cfg.ui_interval_s == 2.0
