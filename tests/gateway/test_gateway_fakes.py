"""Shared helpers for the gateway tests (no tests here): a fake OpenAI-compatible upstream
that can misbehave on demand, and an event loop in a background thread so the synchronous
official `openai` client can drive a gateway running in the same process.

Run as a script (`python tests/gateway/test_gateway_fakes.py PORT`) it serves a well-behaved fake
engine in its own process, for tests that need to kill -9 a real process.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from flexpipe.http.server import (
    App,
    HttpError,
    HttpServer,
    Request,
    Response,
    StreamResponse,
    json_response,
    serve,
)

T = TypeVar("T")


class LoopThread:
    """An asyncio loop running in a daemon thread; `run(coro)` waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@dataclass
class FakeEngine:
    """mode: "ok" | "500" | "503" | "hang" | "die" (abort the stream after `die_after` tokens).
    `token_delay_s` between streamed tokens."""

    model: str = "fake-model"
    mode: str = "ok"
    token_delay_s: float = 0.0
    die_after: int = 3
    healthy: bool = True
    num_requests: int = 0
    num_cancelled: int = 0
    num_active: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    server: HttpServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    def app(self) -> App:
        app = App()
        app.add_route("POST", "/v1/completions", self._completions)
        app.add_route("POST", "/v1/chat/completions", self._chat)
        app.add_route("GET", "/v1/models", self._models)
        app.add_route("GET", "/health", self._health)
        app.add_route("GET", "/metrics", self._metrics)
        return app

    async def start(self, port: int = 0) -> FakeEngine:
        self.server = await serve(self.app(), "127.0.0.1", port)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def _models(self, req: Request) -> Response:
        return json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _health(self, req: Request) -> Response:
        return Response(b"", 200 if self.healthy else 503)

    async def _metrics(self, req: Request) -> Response:
        text = (
            f'vllm:num_requests_running{{model_name="{self.model}"}} {self.num_active}.0\n'
            f'vllm:num_requests_waiting{{model_name="{self.model}"}} 0.0\n'
            f'vllm:kv_cache_usage_perc{{model_name="{self.model}"}} 0.1\n'
        )
        return Response(text.encode(), content_type="text/plain")

    async def _completions(self, req: Request) -> Response | StreamResponse:
        return await self._serve(req, chat=False)

    async def _chat(self, req: Request) -> Response | StreamResponse:
        return await self._serve(req, chat=True)

    async def _serve(self, req: Request, chat: bool) -> Response | StreamResponse:
        body = req.json()
        self.num_requests += 1
        self.bodies.append(body)
        if body.get("model") != self.model:
            raise HttpError(404, f"The model `{body.get('model')}` does not exist.")
        if self.mode == "500":
            raise HttpError(500, "boom")
        if self.mode == "503":
            raise HttpError(503, "overloaded")
        if self.mode == "hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:  # the gateway dropped the request
                self.num_cancelled += 1
                raise
        n = int(body.get("max_tokens") or 16)
        rid = f"cmpl-{self.num_requests}-{id(self) % 1000}"
        words = [f"t{i} " for i in range(n)]
        if not body.get("stream"):
            text = "".join(words)
            usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": text, "finish_reason": "length"}
                obj = "text_completion"
            return json_response(
                {"id": rid, "object": obj, "created": 1, "model": self.model,
                 "choices": [choice], "usage": usage}
            )  # fmt: skip
        return StreamResponse(self._stream(rid, words, chat, body))

    async def _stream(
        self, rid: str, words: list[str], chat: bool, body: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choice: dict[str, Any]) -> bytes:
            d = {"id": rid, "object": obj, "created": 1, "model": self.model, "choices": [choice]}
            return b"data: " + orjson.dumps(d) + b"\n\n"

        self.num_active += 1
        try:
            if chat:
                yield event({"index": 0, "delta": {"role": "assistant", "content": ""}})
            for i, w in enumerate(words):
                if self.mode == "die" and i == self.die_after:
                    raise ConnectionAbortedError("fake engine dies mid-stream")
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                last = i == len(words) - 1
                fr = "length" if last else None
                if chat:
                    yield event({"index": 0, "delta": {"content": w}, "finish_reason": fr})
                else:
                    yield event({"index": 0, "text": w, "finish_reason": fr})
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 5, "completion_tokens": len(words)}
                usage["total_tokens"] = 5 + len(words)
                d = {"id": rid, "object": obj, "created": 1, "model": self.model,
                     "choices": [], "usage": usage}  # fmt: skip
                yield b"data: " + orjson.dumps(d) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.num_cancelled += 1
            raise
        finally:
            self.num_active -= 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float = 30.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not come up")
        time.sleep(0.05)


@contextlib.contextmanager
def fake_engine_process(
    token_delay_s: float = 0.0,
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, str(port), str(token_delay_s)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        yield proc, url
    finally:
        proc.kill()
        proc.wait(10)


async def _main(port: int, delay_s: float) -> None:
    engine = FakeEngine(token_delay_s=delay_s)
    await engine.start(port)
    assert engine.server is not None
    await engine.server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0))
