"""One `flexpipe controller` driving two `flexpipe gateway` processes (replicas of one
service) on 127.0.0.1, with sim engines at a time scale: both replicas get the pool and serve
it; one killed with SIGKILL is reported down without holding the other up, and once it is
started again (empty, on the same port) the controller gives it the pool back within a few
ticks, after which it serves; `flexpipe status --json` shows both replicas; the deployment id
is the sorted set of replicas, recorded in the store."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import orjson

from flexpipe.engine.testing import free_port, request, scrape

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "examples/clusters/fragmented-4gpu.yaml"
TOKEN = "fleet-admin"
MODELS = """
models:
  - name: chat
    model: llama-2-7b
    demand: {request_rate_per_s: 0.5, input_tokens: 256, output_tokens: 32}
    slo: {ttft_p99_ms: 2000, tpot_p99_ms: 100}
    dtypes: [bf16]
    min_instances: 1
"""


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLEXPIPE_ADMIN_TOKEN": TOKEN}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "flexpipe", *args], cwd=ROOT, env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def _wait(cond: Callable[[], Any], timeout_s: float, what: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError):
            got = cond()
            if got:
                return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what()}")
        time.sleep(0.1)


def _get(url: str) -> Any:
    res = request("GET", url, headers={"authorization": f"Bearer {TOKEN}"}, timeout_s=5)
    assert res.status == 200, res.text
    return orjson.loads(res.body)


def _pool(gateway: str) -> dict[str, str]:
    return {i["url"]: i["state"] for i in _get(gateway + "/admin/instances")["instances"]}


def _ask(gateway: str) -> int:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0, timeout=20)
    r = client.completions.create(model="chat", prompt="hello", max_tokens=4)
    assert r.usage is not None
    return r.usage.completion_tokens


def _gateway(port: int, log: Path) -> subprocess.Popen[bytes]:
    proc = _spawn(["gateway", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"], log)
    _wait(
        lambda: request("GET", f"http://127.0.0.1:{port}/v1/models", timeout_s=1).status == 200,
        30,
        lambda: f"gateway on {port}: {log.read_text()[-1500:]}",
    )
    return proc


@contextlib.contextmanager
def _processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in reversed(procs):  # the controller first: it stops its engines
            _stop(p)


def test_a_controller_drives_two_gateway_replicas_and_catches_up_one_killed_and_restarted(
    tmp_path: Path,
) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(MODELS)
    (tmp_path / "token").write_text(TOKEN)
    ports = [free_port(), free_port()]
    g1, g2 = (f"http://127.0.0.1:{p}" for p in ports)
    ctl_port = free_port()
    ctl = f"http://127.0.0.1:{ctl_port}"
    store = tmp_path / "fleet.db"
    log = tmp_path / "log.txt"
    with _processes() as procs:
        procs += [_gateway(p, log) for p in ports]
        argv = [
            "controller", "--gateway", f"{g2},{g1}", "--gateway-token-file",
            str(tmp_path / "token"), "--token-file", str(tmp_path / "token"), "--cluster",
            str(CLUSTER), "--models", str(models), "--store", f"sqlite:///{store}", "--port",
            str(ctl_port), "--time-scale", "0.05", "--sim-load-time-s", "2", "--tick-s", "0.5",
        ]  # fmt: skip
        procs.append(_spawn(argv, log))

        def status() -> dict[str, Any]:
            doc: dict[str, Any] = _get(ctl + "/admin/status")
            return doc

        def replicas() -> dict[str, tuple[bool, str]]:
            return {g["url"]: (g["up"], g["pool"]) for g in status()["gateways"]}

        def said() -> str:
            return log.read_text()[-3000:]

        _wait(lambda: "controller: admin API on" in log.read_text(), 60, said)
        served = _wait(
            lambda: replicas() == {g2: (True, "in sync"), g1: (True, "in sync")} and _pool(g1),
            10,
            said,
        )
        assert set(served.values()) == {"active"}
        assert _pool(g2) == served
        deployment = ",".join(sorted([g1, g2]))  # whichever is listed first
        assert status()["deployment"] == deployment
        assert _ask(g1) == 4 and _ask(g2) == 4

        procs[1].send_signal(signal.SIGKILL)  # replica 2, under no controller's control
        procs[1].wait(5)
        _wait(lambda: replicas()[g2][0] is False, 10, said)
        assert replicas()[g1] == (True, "in sync") and _ask(g1) == 4
        procs[1] = _gateway(ports[1], log)  # back, empty, on the same port
        t0 = time.monotonic()
        _wait(lambda: replicas()[g2] == (True, "in sync"), 10, said)
        caught_up_s = time.monotonic() - t0
        assert _pool(g2) == _pool(g1) == served and _ask(g2) == 4
        assert f"controller: gateway {g2} caught up" in log.read_text()
        assert caught_up_s < 3.0, caught_up_s  # within a few 0.5 s ticks

        shown = subprocess.run(
            [sys.executable, "-m", "flexpipe", "status", "--controller", ctl, "--token",
             TOKEN, "--json"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
            timeout=30, check=True,
        )  # fmt: skip
        metrics = request("GET", ctl + "/metrics", timeout_s=5).text
        for g in (g1, g2):
            assert scrape(metrics, "flexpipe_gateway_replica_up", gateway=g) == 1.0
            assert scrape(metrics, "flexpipe_gateway_replica_in_sync", gateway=g) == 1.0
        caught = scrape(metrics, "flexpipe_gateway_replica_catch_ups_total", gateway=g2)
        assert caught >= 1.0
        fleet = json.loads(shown.stdout)["gateways"]
        assert [(g["url"], g["up"], g["pool"]) for g in fleet] == [
            (g2, True, "in sync"),
            (g1, True, "in sync"),
        ]
    with sqlite3.connect(store) as db:
        rows = db.execute("SELECT deployment, url FROM gateway_replicas ORDER BY url").fetchall()
    assert rows == [(deployment, url) for url in sorted([g1, g2])]
