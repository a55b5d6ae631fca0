"""The servers `bench/http_layer.py` measures, each run in its own process
(`python bench/http_layer.py --serve NAME`): the fixed upstream, flexpipe.http, uvicorn."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

EVENT = (
    b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1700000000,'
    b'"model":"llama-2-7b","choices":[{"index":0,"text":" token","logprobs":null,'
    b'"finish_reason":null}]}\n\n'
)
DONE = b"data: [DONE]\n\n"
JSON_BODY = (
    b'{"id":"cmpl-0123456789abcdef","object":"text_completion","created":1700000000,'
    b'"model":"llama-2-7b","choices":[{"index":0,"text":"a small answer","logprobs":null,'
    b'"finish_reason":"length"}],"usage":{"prompt_tokens":8,"completion_tokens":16,'
    b'"total_tokens":24}}'
)


# --- the fixed upstream ----------------------------------------------------------------------
def run_upstream(num_events: int) -> None:
    import httptools
    import uvloop

    stream_head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    stream_head += b"transfer-encoding: chunked\r\n\r\n"
    chunks = [b"%x\r\n%b\r\n" % (len(EVENT), EVENT)] * (num_events - 1)
    chunks.append(b"%x\r\n%b\r\n0\r\n\r\n" % (len(DONE), DONE))
    json_resp = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    json_resp += b"content-length: %d\r\n\r\n%b" % (len(JSON_BODY), JSON_BODY)

    class Upstream(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: Any = transport
            self.parser = httptools.HttpRequestParser(self)
            self.url = b""
            self.loop = asyncio.get_running_loop()

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_url(self, url: bytes) -> None:
            self.url = url

        def on_message_complete(self) -> None:
            if self.url.startswith(b"/json"):
                self.transport.write(json_resp)
            else:
                self.transport.write(stream_head)
                self._next(0)

        def _next(self, i: int) -> None:
            if self.transport.is_closing():
                return
            self.transport.write(chunks[i])
            if i + 1 < len(chunks):
                self.loop.call_soon(self._next, i + 1)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Upstream, "127.0.0.1", 0)
        print("PORT", server.sockets[0].getsockname()[1], flush=True)
        await server.serve_forever()

    uvloop.run(main())


# --- flexpipe.http ---------------------------------------------------------------------------
def run_flexpipe(upstream: str, num_events: int) -> None:
    from flexpipe.http.client import ClientPool, UpstreamError, UpstreamResponse
    from flexpipe.http.server import (
        App,
        ChunkWriter,
        PushResponse,
        Request,
        Response,
        install_uvloop,
        serve,
    )

    pool = ClientPool()
    headers = {"content-type": "application/json"}

    class Relay:
        """The gateway's `_PushRelay` hot path without its accounting and failover."""

        def __init__(self, resp: UpstreamResponse) -> None:
            self.resp = resp
            self.pending: list[bytes] = []
            self.writer: ChunkWriter | None = None

        def start(self, writer: ChunkWriter) -> None:
            self.writer = writer
            writer.on_close = self.resp.release
            writer.on_resume = self.resp.resume_reading
            if writer.closed:
                self.resp.release()
                return
            self.resp.pipe(self._data, self._end)

        def _data(self, chunk: bytes) -> None:
            if not self.pending:
                self.resp.loop.call_soon(self._flush)
            self.pending.append(chunk)

        def _flush(self) -> None:
            writer = self.writer
            if not self.pending or writer is None or writer.closed:
                return
            writer.write(b"".join(self.pending))
            self.pending.clear()
            if not writer.writable:
                self.resp.pause_reading()

        def _end(self, error: UpstreamError | None) -> None:
            writer = self.writer
            assert writer is not None
            if error is not None:
                writer.fail(502, str(error))
            else:
                writer.end(b"".join(self.pending))
                self.pending.clear()
            self.resp.release()

    async def relay(req: Request) -> PushResponse | Response:
        resp = await pool.request(upstream, "POST", "/stream", req.body, headers)
        return PushResponse(Relay(resp).start)

    async def proxy(req: Request) -> Response:
        resp = await pool.request(upstream, "POST", "/json", req.body, headers)
        try:
            body = await resp.read()
        finally:
            resp.release()
        return Response(body, resp.status)

    async def sse(req: Request) -> PushResponse:
        def start(writer: ChunkWriter) -> None:
            loop = asyncio.get_running_loop()

            def step(i: int) -> None:
                if writer.closed:
                    return
                if i + 1 < num_events:
                    writer.write(EVENT)
                    loop.call_soon(step, i + 1)
                else:
                    writer.end(DONE)

            step(0)

        return PushResponse(start)

    async def small_json(req: Request) -> Response:
        return Response(JSON_BODY)

    async def ticks(req: Request) -> PushResponse:
        """One small event every 5 ms for 3 s (the body-stall check's concurrent stream)."""

        def start(writer: ChunkWriter) -> None:
            loop = asyncio.get_running_loop()

            def tick(i: int) -> None:
                if writer.closed:
                    return
                if i < 600:
                    writer.write(b"data: tick\n\n")
                    loop.call_later(0.005, tick, i + 1)
                else:
                    writer.end()

            tick(0)

        return PushResponse(start)

    async def parse(req: Request) -> Response:
        body = req.json()
        return Response(b'{"num_keys":%d}' % len(body))

    async def main() -> None:
        app = App(max_body_bytes=32 << 20)
        app.add_route("GET", "/ticks", ticks)
        app.add_route("POST", "/parse", parse)
        app.add_route("POST", "/relay", relay)
        app.add_route("POST", "/proxy", proxy)
        app.add_route("GET", "/sse", sse)
        app.add_route("GET", "/json", small_json)
        server = await serve(app, "127.0.0.1", 0)
        print("PORT", server.port, flush=True)
        await server.serve_forever()

    install_uvloop()
    asyncio.run(main())


# --- uvicorn ---------------------------------------------------------------------------------
Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


def run_uvicorn(upstream: str, num_events: int) -> None:
    import uvicorn

    from flexpipe.http.client import ClientPool

    pools: list[ClientPool] = []
    headers = {"content-type": "application/json"}
    sse_head = {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"text/event-stream")],
    }
    json_head = {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"application/json")],
    }

    async def read_body(receive: Receive) -> bytes:
        parts = []
        while True:
            msg = await receive()
            parts.append(msg.get("body", b""))
            if not msg.get("more_body"):
                return b"".join(parts)

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if not pools:
            pools.append(ClientPool())
        pool = pools[0]
        path = scope["path"]
        if path == "/relay":
            body = await read_body(receive)
            resp = await pool.request(upstream, "POST", "/stream", body, headers)
            try:
                await send(sse_head)
                async for chunk in resp.iter_chunks():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            finally:
                resp.release()
        elif path == "/proxy":
            body = await read_body(receive)
            resp = await pool.request(upstream, "POST", "/json", body, headers)
            try:
                data = await resp.read()
            finally:
                resp.release()
            head = dict(json_head, status=resp.status)
            await send(head)
            await send({"type": "http.response.body", "body": data})
        elif path == "/sse":
            await send(sse_head)
            for _ in range(num_events - 1):
                await send({"type": "http.response.body", "body": EVENT, "more_body": True})
                await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": DONE})
        else:
            await send(json_head)
            await send({"type": "http.response.body", "body": JSON_BODY})

    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        loop="uvloop",
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
        backlog=2048,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    print("PORT", sock.getsockname()[1], flush=True)
    uvicorn.Server(config).run(sockets=[sock])
