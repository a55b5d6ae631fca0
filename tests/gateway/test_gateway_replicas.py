"""Two gateway replicas sharing one real `redis-server` (started here on 127.0.0.1), in front
of a real sim engine: a registration and a hold made through one are seen by the other, a
tenant's budget is exact across both, prefix affinity is shared, and Redis killed and
restarted under load: the replicas keep serving, tenant requests fail closed meanwhile, and
everything resyncs when it returns (logged and in the metrics)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
from faultkit import MODEL, engine_args, gateway_process, wait_until

from flexpipe.engine.testing import free_port, request, scrape, sim_engine

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        shutil.which("redis-server") is None,
        reason="redis-server is not installed (the Makefile installs Debian's for `make test`)",
    ),
]

COMPLETION = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}


@contextlib.contextmanager
def redis_server(port: int | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A throwaway redis-server on 127.0.0.1 (no persistence); stopped on exit."""
    port = port or free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    proc = subprocess.Popen(
        [*argv, "--appendonly", "no", "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: _pong(port), 10, f"redis-server on {port}")
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.kill()
        proc.wait(5)


def _pong(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), 0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _post(url: str, body: object, key: str | None = None) -> int:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return request("POST", url + "/v1/completions", body, headers, timeout_s=20).status


def _own(url: str, name: str, **labels: str) -> float:
    return scrape(request("GET", url + "/metrics?scope=worker", timeout_s=10).text, name, **labels)


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    with sim_engine(engine_args(0.0)) as e:
        yield e


def _replica(redis_url: str, config: dict[str, object] | None = None):  # type: ignore[no-untyped-def]
    return gateway_process(
        [], config=config, args=["--workers", "1", "--redis", redis_url], wait_healthy=False
    )


def test_replicas_share_registrations_holds_and_budgets(engine) -> None:  # type: ignore[no-untyped-def]
    tenants = {"tenants": [{"key": "sk-a", "name": "a", "requests_per_min": 10}]}
    with redis_server() as (url, _), _replica(url, tenants) as a, _replica(url, tenants) as b:
        res = a.admin_post("/admin/instances", {"url": engine.url, "model": MODEL})
        assert res.status == 200, res.text
        assert a.admin_post("/admin/models/hold", {"model": "ghost", "seconds": 60}).status == 200
        wait_until(lambda: len(b.instances()) == 1, 10, "the registration on the other replica")
        # a controller that registers with every replica: the second is no error
        again = b.admin_post("/admin/instances", {"url": engine.url, "model": MODEL})
        assert again.status == 200 and again.json()["url"] == engine.url
        assert len(a.instances()) == len(b.instances()) == 1
        models = request("GET", b.url + "/v1/models", timeout_s=10).json()
        assert sorted(m["id"] for m in models["data"]) == ["ghost", MODEL]
        statuses = [_post((a, b)[i % 2].url, COMPLETION, "sk-a") for i in range(30)]
        assert statuses.count(200) == 10
        assert statuses.count(429) == 20
        # a replica started later replays the log
        with _replica(url, tenants) as c:
            wait_until(lambda: len(c.instances()) == 1, 10, "the log replayed on a new replica")
            assert _post(c.url, COMPLETION, "sk-a") == 429  # the same budget, spent
            assert _post(c.url, COMPLETION) == 401  # (tenants configured: a key is needed)


def test_prefix_affinity_shared_between_replicas() -> None:
    with sim_engine(engine_args(0.0)) as e1, sim_engine(engine_args(0.0)) as e2:
        config = {"backends": [{"url": e.url, "model": MODEL} for e in (e1, e2)]}
        with redis_server() as (url, _), _replica(url, config) as a, _replica(url, config) as b:
            prompt = "the same long system prompt, " * 20  # 9 blocks of 64 characters
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            for i in range(20):
                assert _post((a, b)[i % 2].url, body) == 200
                time.sleep(0.01)
            matched = sum(
                _own(g.url, "flexpipe_prefix_blocks_total", kind="matched") for g in (a, b)
            )
            assert matched == 19 * 9  # only the very first missed, on either replica


def test_redis_lost_and_back_under_load(engine) -> None:  # type: ignore[no-untyped-def]
    """Requests flow through a replica that fails closed (`a`) and one that falls back to
    its own budget (`b`, `budgets_when_down: local`) while Redis is killed and restarted:
    `b` answers every one, `a` answers 503 only while Redis is gone; both say so in their
    metrics and logs, and resync when it returns."""
    tenants = [{"key": "sk-a", "name": "a", "requests_per_min": 100000}]
    closed = {"tenants": tenants, "backends": [{"url": engine.url, "model": MODEL}]}
    local = {**closed, "shared_state": {"budgets_when_down": "local"}}
    port = free_port()
    with (
        redis_server(port) as (url, proc),
        _replica(url, closed) as a,
        _replica(url, local) as b,
    ):
        assert _post(a.url, COMPLETION, "sk-a") == 200
        assert _own(a.url, "flexpipe_shared_state_up") == 1
        statuses: dict[str, list[int]] = {"a": [], "b": []}
        stop = threading.Event()

        def load(name: str, url: str) -> None:
            while not stop.is_set():
                statuses[name].append(_post(url, COMPLETION, "sk-a"))

        threads = [threading.Thread(target=load, args=(n, g.url)) for n, g in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            proc.kill()
            proc.wait(5)
            wait_until(lambda: _own(a.url, "flexpipe_shared_state_up") == 0, 10, "Redis lost")
            time.sleep(0.5)
            res = request(
                "POST",
                a.url + "/v1/completions",
                COMPLETION,
                {"authorization": "Bearer sk-a"},
                timeout_s=20,
            )
            assert res.status == 503, res.text  # budgets fail closed
            assert "tenant budgets are unavailable" in res.text
            with redis_server(port):
                for g in (a, b):
                    wait_until(lambda g=g: _own(g.url, "flexpipe_shared_state_up") == 1, 10, "back")
                    assert _own(g.url, "flexpipe_shared_state_outages_total") == 1
                time.sleep(0.5)
                stop.set()
                for t in threads:
                    t.join(30)
                assert _post(a.url, COMPLETION, "sk-a") == 200
                assert "lost Redis" in a.log() and "is back; resynced" in a.log()
        finally:
            stop.set()
        assert set(statuses["b"]) == {200}, statuses["b"]  # never refused: its own budget
        assert set(statuses["a"]) == {200, 503}
        assert statuses["a"][-1] == 200  # served again once Redis was back


def test_kill_9_of_a_replica_gives_its_tenant_slots_back_after_its_ttl() -> None:
    """A replica killed while its tenant's streams fill the concurrency cap: the other
    replica refuses that tenant while the dead one's slots count (its heartbeat has not
    lapsed), then admits it once `member_ttl_s` passed: never above the cap, nothing leaked."""
    config: dict[str, object] = {
        "tenants": [{"key": "sk-c", "name": "c", "max_concurrency": 2}],
        "shared_state": {"member_ttl_s": 2.0},
    }
    with sim_engine(engine_args(1.0)) as slow, redis_server() as (url, _):
        config["backends"] = [{"url": slow.url, "model": MODEL}]
        with _replica(url, config) as b, _replica(url, config) as a:
            body = {**COMPLETION, "max_tokens": 400, "stream": True}
            conns = [_open_stream(a.url, body, "sk-c") for _ in range(2)]
            assert _post(b.url, COMPLETION, "sk-c") == 429  # 2 of 2 held, on a
            a.proc.kill()
            a.proc.wait(5)
            t_killed = time.monotonic()
            for c in conns:
                c.close()
            assert _post(b.url, COMPLETION, "sk-c") == 429  # still counted
            wait_until(lambda: _post(b.url, COMPLETION, "sk-c") == 200, 10, "slots back")
            assert time.monotonic() - t_killed >= 1.0


def _open_stream(url: str, body: object, key: str):  # type: ignore[no-untyped-def]
    """A stream started and left open (its first bytes read)."""
    import http.client
    import json

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()
    return conn


def test_a_silent_redis_is_taken_as_lost(engine) -> None:  # type: ignore[no-untyped-def]
    """Redis stopped (SIGSTOP: no connection breaks, as in a partition): a tenant's request
    waits at most the backend's timeout, then fails closed; Redis resumed: resynced."""
    config = {
        "tenants": [{"key": "sk-a", "name": "a", "requests_per_min": 100000}],
        "backends": [{"url": engine.url, "model": MODEL}],
    }
    with redis_server() as (url, proc), _replica(url, config) as a:
        assert _post(a.url, COMPLETION, "sk-a") == 200
        proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert _post(a.url, COMPLETION, "sk-a") == 503
            assert time.monotonic() - t0 < 3.0
            assert _own(a.url, "flexpipe_shared_state_up") == 0
        finally:
            proc.send_signal(signal.SIGCONT)
        wait_until(lambda: _own(a.url, "flexpipe_shared_state_up") == 1, 10, "Redis back")
        assert _post(a.url, COMPLETION, "sk-a") == 200
        assert "silent for 1.0 s" in a.log()
