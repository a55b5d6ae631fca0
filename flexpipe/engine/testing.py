"""Start and stop real sim engine processes (for tests and benchmarks, ours and the gateway's).

with sim_engine(["llama-2-7b", "--time-scale", "0", "--load-time-s", "0"]) as eng:
    openai.OpenAI(base_url=eng.url + "/v1", api_key="x")...
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout holding the flexpipe package


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EngineProc:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _wait_port(proc: subprocess.Popen[bytes], port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"sim engine exited with {proc.returncode}: {err}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"sim engine did not listen on {port} within {timeout_s} s")


@contextlib.contextmanager
def sim_engine(
    args: Sequence[str], timeout_s: float = 30.0, env: dict[str, str] | None = None
) -> Iterator[EngineProc]:
    """A sim engine subprocess on a free 127.0.0.1 port (`env`: added to this process's
    environment); always stopped on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "flexpipe.engine.sim", *args, "--port", str(port)]
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        _wait_port(proc, port, timeout_s)
        yield EngineProc(proc, port)
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if proc.stderr:
            proc.stderr.close()


def scrape(text: str, name: str, **labels: str) -> float:
    """The value of one series in a Prometheus exposition (sum over matching series)."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
            found = True
    if not found:
        raise KeyError(name)
    return total


@dataclass
class HttpResult:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


def request(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout_s: float = 30.0,
) -> HttpResult:
    """One request with the standard library (JSON body if `body` is given)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    hdrs = {"content-type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            hdrs = {k.lower(): v for k, v in resp.headers.items()}
            return HttpResult(resp.status, hdrs, resp.read())
    except urllib.error.HTTPError as err:
        return HttpResult(err.code, {k.lower(): v for k, v in err.headers.items()}, err.read())


@contextlib.contextmanager
def http_stream(
    url: str, body: Any, headers: dict[str, str] | None = None
) -> Iterator[Iterator[str]]:
    """POST `body` and iterate the response's non-empty lines; closing drops the connection."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    try:
        conn.request(
            "POST",
            parts.path,
            json.dumps(body).encode(),
            {"content-type": "application/json", **(headers or {})},
        )
        resp = conn.getresponse()

        def lines() -> Iterator[str]:
            while True:
                line = resp.readline()
                if not line:
                    return
                text = line.decode().strip()
                if text:
                    yield text

        yield lines()
    finally:
        conn.close()
