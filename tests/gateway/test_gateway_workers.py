"""`flexpipe gateway --workers 2` as real processes on 127.0.0.1 in front of a real sim engine:
both workers serve the one port; an admin change made through one is seen by the other; a
tenant's budget is exact whatever worker a request lands on; a worker killed with SIGKILL is
restarted and resyncs the control log; SIGTERM drains both."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from faultkit import MODEL, engine_args, engine_load, gateway_process, wait_until
from prometheus_client.parser import text_string_to_metric_families

from flexpipe.engine.testing import request, scrape, sim_engine

pytestmark = pytest.mark.timeout(120)


def _fresh(url: str, path: str, body: object = None, key: str | None = None) -> int:
    """One request on a new connection (the kernel picks the worker anew); its status."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return request(
        "POST" if body is not None else "GET", url + path, body, headers, timeout_s=20
    ).status


def _worker_of(url: str) -> str:
    """The worker that answers a new connection (its own metrics name it)."""
    text = request("GET", url + "/metrics?scope=worker", timeout_s=10).text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("flexpipe_gateway_member{")]
    return line.split('member="')[1].split('"')[0]


def _both_serve(url: str) -> None:
    """Until a new connection has reached each of the two workers (each listens once it has
    replayed the control log: the first may answer before the second listens)."""
    seen: set[str] = set()

    def both() -> bool:
        seen.add(_worker_of(url))
        return seen == {"0", "1"}

    wait_until(both, 20, lambda: f"both workers answering; seen {sorted(seen)}")


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _worker_pids(pid: int) -> set[int]:
    """The gateway workers among the supervisor's children (spawn also runs a tracker)."""
    out = set()
    for child in _children(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            out.add(child)
    return out


COMPLETION = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    with sim_engine(engine_args(0.0)) as e:
        yield e


def test_both_workers_serve_and_share_admin_changes(engine) -> None:  # type: ignore[no-untyped-def]
    with gateway_process([], args=["--workers", "2"], wait_healthy=False) as gw:
        _both_serve(gw.url)
        # registered through one worker (this connection's), served by both
        res = gw.admin_post("/admin/instances", {"url": engine.url, "model": MODEL})
        assert res.status == 200, res.text
        assert gw.admin_post("/admin/models/hold", {"model": "ghost", "seconds": 60}).status == 200
        seen = set()
        for _ in range(40):
            seen.add(_worker_of(gw.url))
            assert _fresh(gw.url, "/v1/completions", COMPLETION) == 200
            models = request("GET", gw.url + "/v1/models", timeout_s=10).json()
            assert sorted(m["id"] for m in models["data"]) == ["ghost", MODEL]
        assert seen == {"0", "1"}
        # the whole gateway's metrics, whatever worker is asked: 40 requests in all
        total = scrape(gw.get("/metrics").text, "flexpipe_requests_total", status="200")
        assert total == 40
        assert scrape(gw.get("/metrics").text, "flexpipe_gateway_member") == 2
        # and a well-formed exposition (each family's samples together)
        families = list(text_string_to_metric_families(gw.get("/metrics").text))
        assert len({f.name for f in families}) == len(families)
        # removed through one: gone from both (a 404 for the model from any worker)
        assert gw.admin_post("/admin/instances/remove", {"url": engine.url}).status == 200
        assert {_fresh(gw.url, "/v1/completions", COMPLETION) for _ in range(20)} == {404}


def test_tenant_budget_exact_across_workers(engine) -> None:  # type: ignore[no-untyped-def]
    config = {
        "tenants": [{"key": "sk-a", "name": "a", "requests_per_min": 10}],
        "backends": [{"url": engine.url, "model": MODEL}],
    }
    with gateway_process([], config=config, args=["--workers", "2"]) as gw:
        _both_serve(gw.url)
        statuses = [_fresh(gw.url, "/v1/completions", COMPLETION, "sk-a") for _ in range(30)]
        assert statuses.count(200) == 10
        assert statuses.count(429) == 20


def test_tenant_concurrency_exact_across_workers() -> None:
    config = {"tenants": [{"key": "sk-c", "name": "c", "max_concurrency": 3}]}
    with sim_engine(engine_args(1.0)) as slow:
        config["backends"] = [{"url": slow.url, "model": MODEL}]  # type: ignore[assignment]
        with gateway_process([], config=config, args=["--workers", "2"]) as gw:
            _both_serve(gw.url)
            body = {**COMPLETION, "max_tokens": 60}
            statuses: list[int] = []
            lock = threading.Lock()

            def one() -> None:
                status = _fresh(gw.url, "/v1/completions", body, "sk-c")
                with lock:
                    statuses.append(status)

            threads = [threading.Thread(target=one) for _ in range(10)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert sorted(statuses) == [200] * 3 + [429] * 7
            # every slot came back: three more fit now
            after = [threading.Thread(target=one) for _ in range(3)]
            statuses.clear()
            for t in after:
                t.start()
            for t in after:
                t.join(60)
            assert statuses == [200] * 3


def test_killed_worker_is_restarted_and_resynced(engine) -> None:  # type: ignore[no-untyped-def]
    with gateway_process([], args=["--workers", "2"], wait_healthy=False) as gw:
        _both_serve(gw.url)
        res = gw.admin_post("/admin/instances", {"url": engine.url, "model": MODEL})
        assert res.status == 200, res.text
        gw.admin_post("/admin/models/hold", {"model": "ghost", "seconds": 60})
        before = _worker_pids(gw.pid)
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        wait_until(
            lambda: len(_worker_pids(gw.pid) - before) == 1 and len(_worker_pids(gw.pid)) == 2,
            20,
            "a new worker in place of the killed one",
        )
        wait_until(
            lambda: scrape(gw.get("/metrics").text, "flexpipe_gateway_member") == 2,
            20,
            "both workers answering",
        )
        seen = set()
        for _ in range(40):  # the new worker replayed the log: it serves and lists the hold
            seen.add(_worker_of(gw.url))
            assert _fresh(gw.url, "/v1/completions", COMPLETION) == 200
            models = request("GET", gw.url + "/v1/models", timeout_s=10).json()
            assert sorted(m["id"] for m in models["data"]) == ["ghost", MODEL]
        assert seen == {"0", "1"}
        assert "exited with -9; restarting it" in gw.log()


def _stream(url: str, out: list[str], key: str | None = None, max_tokens: int = 100) -> None:
    """One stream of `max_tokens`; its text, or "CUT" when the connection broke mid-way."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {**COMPLETION, "max_tokens": max_tokens, "stream": True}
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    try:
        text = resp.read().decode() if resp.status == 200 else f"status {resp.status}"
    except (http.client.IncompleteRead, ConnectionError):
        text = "CUT"
    out.append(text)
    conn.close()


def test_sigterm_drains_both_workers() -> None:
    with sim_engine(engine_args(1.0)) as slow:
        config = {"backends": [{"url": slow.url, "model": MODEL}], "shutdown_grace_s": 30}
        with gateway_process([], config=config, args=["--workers", "2"]) as gw:
            _both_serve(gw.url)
            outs: list[str] = []
            threads = [threading.Thread(target=_stream, args=(gw.url, outs)) for _ in range(8)]
            for t in threads:
                t.start()
            wait_until(
                lambda: scrape(gw.get("/metrics").text, "flexpipe_in_flight_requests") == 8,
                20,
                "eight streams in flight",
            )
            busy = {_worker_of(gw.url) for _ in range(20)}
            assert busy == {"0", "1"}
            # the admin API's view is the whole gateway's too: both workers' streams
            assert [i["num_in_flight"] for i in gw.instances()] == [8]
            workers = _worker_pids(gw.pid)
            t0 = time.monotonic()
            gw.proc.send_signal(signal.SIGTERM)
            for t in threads:
                t.join(60)
            assert gw.proc.wait(40) == 0, gw.log()
            assert time.monotonic() - t0 < 35
            assert len(outs) == 8
            for text in outs:  # every stream finished whole, none cut by the shutdown
                assert text.rstrip().endswith("data: [DONE]"), text[-300:]
                assert "error" not in text
            assert not any(Path(f"/proc/{p}").exists() for p in workers)


def test_prefix_affinity_shared_between_workers() -> None:
    """A prompt routed by one worker is in the other's prefix index: of 20 identical prompts
    on new connections (both workers serving), only the very first misses. Without the
    sharing each worker's first would miss (18 x the blocks matched, not 19)."""
    with sim_engine(engine_args(0.0)) as a, sim_engine(engine_args(0.0)) as b:
        config = {"backends": [{"url": e.url, "model": MODEL} for e in (a, b)]}
        with gateway_process([], config=config, args=["--workers", "2"]) as gw:
            _both_serve(gw.url)
            prompt = "the same long system prompt, " * 20  # 580 characters: 9 blocks of 64
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            for _ in range(20):
                assert _fresh(gw.url, "/v1/completions", body) == 200
            metrics = gw.get("/metrics").text
            num_blocks = scrape(metrics, "flexpipe_prefix_blocks_total", kind="all")
            assert num_blocks == 20 * 9
            assert scrape(metrics, "flexpipe_prefix_blocks_total", kind="matched") == 19 * 9


def test_kill_9_of_a_worker_ends_only_its_own_streams() -> None:
    """SIGKILL of one worker under load: its streams break (the client sees the connection
    cut, no [DONE]), the other worker's finish whole; the engine aborts what the dead one sent
    it, and the tenant's slots the dead worker held come back at once."""
    config = {"tenants": [{"key": "sk-k", "name": "k", "max_concurrency": 8}]}
    with sim_engine(engine_args(1.0)) as slow:
        config["backends"] = [{"url": slow.url, "model": MODEL}]  # type: ignore[assignment]
        with gateway_process([], config=config, args=["--workers", "2"]) as gw:
            _both_serve(gw.url)
            outs: list[str] = []
            threads = [
                threading.Thread(target=_stream, args=(gw.url, outs, "sk-k", 400)) for _ in range(8)
            ]
            for t in threads:
                t.start()
            wait_until(
                lambda: scrape(gw.get("/metrics").text, "flexpipe_in_flight_requests") == 8,
                20,
                "eight streams in flight",
            )
            views: dict[str, tuple[int, float]] = {}  # worker -> (its pid, streams it relays)

            def both_seen() -> bool:
                text = request("GET", gw.url + "/metrics?scope=worker", timeout_s=10).text
                (line,) = [ln for ln in text.splitlines() if ln.startswith("flexpipe_gateway_")
                           and "member=" in ln and "pid=" in ln]  # fmt: skip
                member = line.split('member="')[1].split('"')[0]
                pid = int(line.split('pid="')[1].split('"')[0])
                views[member] = (pid, scrape(text, "flexpipe_in_flight_requests"))
                return len(views) == 2

            wait_until(both_seen, 20, "each worker's own view")
            pid, num_streams = max(views.values(), key=lambda v: v[1])  # one that holds some
            os.kill(pid, signal.SIGKILL)
            for t in threads:
                t.join(60)
            cut = [o for o in outs if o == "CUT"]
            whole = [o for o in outs if o.rstrip().endswith("data: [DONE]")]
            assert len(cut) + len(whole) == 8, outs
            assert len(cut) == num_streams  # the dead worker's, and only those
            wait_until(
                lambda: engine_load(slow.url) == (0.0, 0.0), 20, "the engine aborted the orphans"
            )
            _both_serve(gw.url)  # restarted
            again: list[str] = []
            threads = [
                threading.Thread(target=_stream, args=(gw.url, again, "sk-k")) for _ in range(8)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert len(again) == 8
            assert all(o.rstrip().endswith("data: [DONE]") for o in again), again


def test_a_port_in_use_is_refused_not_shared(engine) -> None:  # type: ignore[no-untyped-def]
    """A second `--workers` gateway on a port another serves: exit 2, "in use" (SO_REUSEPORT
    would otherwise let it take half the first one's connections)."""
    import subprocess
    import sys

    from flexpipe.engine.testing import ROOT

    with gateway_process([engine.url], args=["--workers", "2"]) as gw:
        cmd = [sys.executable, "-m", "flexpipe", "gateway", "--port", str(gw.port)]
        cmd += ["--workers", "2", "--backend", engine.url, "--model", MODEL]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=60)
        assert done.returncode == 2
        assert b"cannot listen on 127.0.0.1:" in done.stderr
        assert b"in use" in done.stderr


def test_workers_of_a_dead_supervisor_drain_and_exit(engine) -> None:  # type: ignore[no-untyped-def]
    """kill -9 of the supervisor: its workers lose the state service, drain, and exit (no
    orphan keeps the port)."""
    with gateway_process([engine.url], args=["--workers", "2"]) as gw:
        _both_serve(gw.url)
        workers = _worker_pids(gw.pid)
        assert len(workers) == 2
        gw.proc.kill()
        gw.proc.wait(10)
        wait_until(
            lambda: not any(Path(f"/proc/{p}/cmdline").exists() for p in workers),
            20,
            "the workers gone",
        )


def test_admin_questions_span_both_workers() -> None:
    """The controller's drain-and-move through one worker reaches the other's requests: the
    requests of an instance are listed from both, a drain is not done while either holds
    one, and each move is carried out by the worker holding its request."""
    with (
        sim_engine(engine_args(1.0)) as a,
        sim_engine(engine_args(1.0)) as b,
        gateway_process([], args=["--workers", "2"], wait_healthy=False) as gw,
    ):
        _both_serve(gw.url)
        assert gw.admin_post("/admin/instances", {"url": a.url, "model": MODEL}).status == 200
        outs: list[str] = []
        threads = [
            threading.Thread(target=_stream, args=(gw.url, outs, None, 300)) for _ in range(6)
        ]
        for t in threads:
            t.start()
        wait_until(lambda: [i["num_in_flight"] for i in gw.instances()] == [6], 20, "six streams")
        assert gw.admin_post("/admin/instances", {"url": b.url, "model": MODEL}).status == 200
        listed = gw.get(f"/admin/instances/requests?url={a.url}").json()["requests"]
        assert len({q["id"] for q in listed}) == 6
        mine = gw.get(f"/admin/instances/requests?url={a.url}&scope=member").json()
        assert len(mine["requests"]) <= 6
        res = gw.admin_post("/admin/instances/drain", {"url": a.url, "wait_s": 0.3})
        assert res.json()["drained"] is False
        moves = [{"id": q["id"], "method": "recompute", "target": b.url} for q in listed]
        res = gw.admin_post("/admin/requests/move", {"moves": moves})
        assert res.status == 200, res.text
        results = res.json()["results"]
        assert sorted(r["id"] for r in results) == sorted(q["id"] for q in listed)
        assert {r["outcome"] for r in results} == {"recompute"}
        res = gw.admin_post("/admin/instances/drain", {"url": a.url, "wait_s": 10})
        assert res.json()["drained"] is True
        for t in threads:
            t.join(60)
        assert len(outs) == 6
        for text in outs:  # continued on b, whole
            assert text.rstrip().endswith("data: [DONE]"), text[-300:]
            assert '"error"' not in text
