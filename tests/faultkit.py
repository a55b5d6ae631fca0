"""Helpers for the fault suite and the soak bench (no tests here): the gateway as its own
process in front of real sim engines, what to read from both (in-flight counters, the
gateway's queue, the engines' running/waiting, RSS and descriptors), the text an
uninterrupted run generates, and a raw HTTP/1.1 client that can hang up at any byte.

Everything binds 127.0.0.1; every process started here is stopped by its context manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml

from flexpipe.engine.testing import ROOT, HttpResult, free_port, request, scrape
from flexpipe.engine.tokenizer import WORDS

MODEL = "llama-2-7b"
ADMIN_TOKEN = "fault-suite-admin"


def engine_args(time_scale: float, *extra: str) -> list[str]:
    """`python -m flexpipe.engine.sim` flags: the model, no cold start, `time_scale`."""
    return ["--model", MODEL, "--load-time-s", "0", "--time-scale", f"{time_scale:g}", *extra]


def config_knob(*candidates: str) -> tuple[str, ...] | None:
    """Where `GatewayConfig` keeps the first of `candidates` (limits and deadlines it may or
    may not have grown yet): ("name",) for a field of its own, ("outer", "name") for a field
    of a nested dataclass such as the HTTP limits; None if it has none of them."""
    from flexpipe.gateway.config import GatewayConfig

    cfg = GatewayConfig()
    for name in candidates:
        for f in dataclasses.fields(cfg):
            if f.name == name:
                return (name,)
            inner = getattr(cfg, f.name)
            if dataclasses.is_dataclass(inner) and hasattr(inner, name):
                return (f.name, name)
    return None


def knob_default(path: Sequence[str]) -> Any:
    from flexpipe.gateway.config import GatewayConfig

    value: Any = GatewayConfig()
    for name in path:
        value = getattr(value, name)
    return value


def set_knob(config: dict[str, Any], path: Sequence[str], value: Any) -> None:
    """Set `path` (from `config_knob`) in a gateway.yaml dict."""
    for name in path[:-1]:
        config = config.setdefault(name, {})
    config[path[-1]] = value


# ----------------------------------------------------------------------------- processes
def proc_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def proc_num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@dataclass
class GatewayProc:
    """A `flexpipe gateway` process; `get` and the counters use its admin API and /metrics."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def get(self, path: str, timeout_s: float = 5.0) -> HttpResult:
        auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        return request("GET", self.url + path, headers=auth, timeout_s=timeout_s)

    def admin_post(self, path: str, body: dict[str, Any]) -> HttpResult:
        auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        return request("POST", self.url + path, body, headers=auth, timeout_s=10)

    def instances(self) -> list[dict[str, Any]]:
        res = self.get("/admin/instances")
        assert res.status == 200, res.text
        out: list[dict[str, Any]] = res.json()["instances"]
        return out

    def num_in_flight(self) -> dict[str, int]:
        return {i["url"]: int(i["num_in_flight"]) for i in self.instances()}

    def num_queued(self) -> float:
        return scrape(self.get("/metrics").text, "flexpipe_queued_requests")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]


@contextlib.contextmanager
def gateway_process(
    backends: Sequence[str],
    config: dict[str, Any] | None = None,
    args: Sequence[str] = (),
    wait_healthy: bool = True,
    model: str | None = MODEL,
) -> Iterator[GatewayProc]:
    """`python -m flexpipe gateway --backend URL... --model MODEL` on a free port, with
    `config` (a gateway.yaml as a dict) if given; killed on exit. `model` None: the gateway
    discovers it; `wait_healthy` False: wait for the port only."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="faultkit-") as tmp:
        cmd = [sys.executable, "-m", "flexpipe", "gateway", "--port", str(port), "--workers", "1"]
        if model is not None:
            cmd += ["--model", model]
        for url in backends:
            cmd += ["--backend", url]
        if config is not None:
            path = Path(tmp) / "gateway.yaml"
            path.write_text(yaml.safe_dump(config))
            cmd += ["--config", str(path)]
        cmd += list(args)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "FLEXPIPE_ADMIN_TOKEN": ADMIN_TOKEN}
        log_path = Path(tmp) / "gateway.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        gw = GatewayProc(proc, port, log_path)
        try:
            wait_until(
                lambda: _up(gw, wait_healthy), 30, lambda: f"gateway up on {port}: {gw.log()}"
            )
            yield gw
        finally:
            stop_process(proc)


def _up(gw: GatewayProc, healthy: bool) -> bool:
    if gw.proc.poll() is not None:
        raise AssertionError(f"gateway exited with {gw.proc.returncode}: {gw.log()}")
    try:
        res = request("GET", gw.url + "/health", timeout_s=1)
    except OSError:
        return False
    return res.status == 200 or not healthy


def engine_load(url: str) -> tuple[float, float]:
    """(vllm:num_requests_running, vllm:num_requests_waiting) of one engine."""
    text = request("GET", url + "/metrics", timeout_s=5).text
    return scrape(text, "vllm:num_requests_running"), scrape(text, "vllm:num_requests_waiting")


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str | Callable[[], str]) -> None:
    """Poll `cond` every 50 ms; AssertionError naming `what` if it stays false."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            desc = what() if callable(what) else what
            raise AssertionError(f"not within {timeout_s:g} s: {desc}")
        time.sleep(0.05)


def leftovers(gw: GatewayProc, engine_urls: Sequence[str]) -> list[str]:
    """What is still counted after every client left: [] when all is back to zero."""
    out = [f"gateway num_in_flight {n} on {u}" for u, n in gw.num_in_flight().items() if n]
    queued = gw.num_queued()
    if queued:
        out.append(f"gateway queue length {queued:g}")
    for url in engine_urls:
        running, waiting = engine_load(url)
        if running or waiting:
            out.append(f"engine {url}: running {running:g}, waiting {waiting:g}")
    return out


def wait_settled(gw: GatewayProc, engine_urls: Sequence[str], timeout_s: float) -> None:
    """Every in-flight slot released, the queue empty, the engines idle, within `timeout_s`."""
    last: list[str] = []

    def ok() -> bool:
        nonlocal last
        last = leftovers(gw, engine_urls)
        return not last

    wait_until(ok, timeout_s, lambda: "counters back to zero; still: " + "; ".join(last))


# ----------------------------------------------------------------------------- texts
_WORD_SET = frozenset(WORDS)
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
# what the sim engine's detokenizer writes: words after a single space, punctuation glued
_COMPLETION_TEXT = re.compile(r"(?: \w+|[^\w\s])*")
_CHAT_TEXT = re.compile(r"(?:\w+|[^\w\s])(?: \w+|[^\w\s])*")


def text_problems(text: str, num_tokens: int, chat: bool) -> list[str]:
    """Why `text` is not a well-formed sim engine reply of `num_tokens` generated tokens (a
    join glued two words, doubled a space, lost or repeated tokens, or carries other text)."""
    out = []
    shape = _CHAT_TEXT if chat else _COMPLETION_TEXT
    if not shape.fullmatch(text):
        out.append(f"spacing is not the engine's ({text[:80]!r}...)")
    words = _TOKEN_RE.findall(text)
    if len(words) != num_tokens:
        out.append(f"{len(words)} tokens, expected {num_tokens}")
    strangers = sorted({w for w in words if w not in _WORD_SET})
    if strangers:
        out.append(f"words the engine never generates (glued at a join?): {strangers[:5]}")
    return out


# ----------------------------------------------------------------------------- raw HTTP
@dataclass
class RawResponse:
    """What a raw client saw: status (0: none), headers, body, SSE payloads, and whether the
    response ended properly (content-length reached or the terminal chunk read)."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    events: list[bytes] = field(default_factory=list)
    complete: bool = False
    error: str = ""

    @property
    def done(self) -> bool:
        return b"[DONE]" in self.events

    def json(self) -> Any:
        return orjson.loads(self.body)


def http_request_bytes(
    path: str, body: bytes, headers: dict[str, str] | None = None, method: str = "POST"
) -> bytes:
    hdrs = {"host": "127.0.0.1", "content-type": "application/json",
            "content-length": str(len(body)), **(headers or {})}  # fmt: skip
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    return head.encode() + b"\r\n" + body


async def raw_call(
    port: int,
    data: bytes,
    hang_up: Callable[[RawResponse], bool] | None = None,
    hang_up_after_s: float | None = None,
    rst: bool = False,
    timeout_s: float = 30.0,
) -> RawResponse:
    """Send `data` on a fresh connection and read one response (chunked or not, SSE events
    parsed). Hang up (FIN, or RST with `rst`) when `hang_up(resp)` says so after a read, or
    `hang_up_after_s` after sending; otherwise read to the end or `timeout_s`."""
    out = RawResponse()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    reading: asyncio.Future[None] | None = None
    try:
        writer.write(data)
        await writer.drain()
        reading = asyncio.ensure_future(_read_response(reader, out, hang_up))
        limit = timeout_s if hang_up_after_s is None else hang_up_after_s
        try:
            await asyncio.wait_for(asyncio.shield(reading), limit)
        except TimeoutError:
            if hang_up_after_s is None:
                out.error = "timeout"
    finally:  # also when cancelled: the client leaves
        if reading is not None:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reading
        if rst:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    return out


async def _read_response(
    reader: asyncio.StreamReader, out: RawResponse, hang_up: Callable[[RawResponse], bool] | None
) -> None:
    try:
        status_line = await reader.readline()
        if not status_line:
            out.error = "closed before the response head"
            return
        out.status = int(status_line.split()[1])
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            out.headers[name.strip().lower()] = value.strip()
        if hang_up is not None and hang_up(out):
            return
        buf = b""
        if out.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await reader.readline()
                if not size_line:
                    out.error = "closed mid-body (no terminal chunk)"
                    return
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    await reader.readline()
                    out.complete = True
                    return
                chunk = await reader.readexactly(size + 2)
                out.body += chunk[:-2]
                buf += chunk[:-2]
                while b"\n\n" in buf:
                    raw, buf = buf.split(b"\n\n", 1)
                    for ln in raw.split(b"\n"):
                        if ln.startswith(b"data:"):
                            out.events.append(ln[5:].strip())
                if hang_up is not None and hang_up(out):
                    return
        elif "content-length" in out.headers:
            out.body = await reader.readexactly(int(out.headers["content-length"]))
            out.complete = True
        else:
            out.body = await reader.read()
            out.complete = True
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        out.error = f"{type(exc).__name__} mid-response"


def openai_error_problems(res: RawResponse | HttpResult, statuses: Sequence[int]) -> list[str]:
    """Why `res` is not an OpenAI-shaped error with one of `statuses`."""
    status = res.status
    body = res.body
    if status not in statuses:
        return [f"status {status}, expected one of {list(statuses)} (body {body[:120]!r})"]
    try:
        err = orjson.loads(body)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return [f"status {status} without an OpenAI error body: {body[:120]!r}"]
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return [f"error body without a message: {body[:120]!r}"]
    missing = [k for k in ("type", "param", "code") if k not in err]
    return [f"error body lacks {missing}"] if missing else []
