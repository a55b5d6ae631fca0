"""flexpipe.http.server: routing, keep-alive, pipelining, chunked streams, pushed streams, 413,
disconnects. Every client read has a timeout: a server bug fails a test, never hangs it."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

from flexpipe.http.server import (
    App,
    ChunkWriter,
    HttpError,
    PushResponse,
    Request,
    Response,
    StreamResponse,
    json_response,
    serve,
)

READ_TIMEOUT_S = 10.0


def make_app(closed: list[str]) -> App:
    app = App(max_body_bytes=1000)

    @app.route("GET", "/a")
    async def a(req: Request) -> Response:
        return json_response({"q": req.query, "ua": req.headers.get("user-agent")})

    @app.route("POST", "/json")
    async def js(req: Request) -> Response:
        body = req.json()
        if "fail" in body:
            raise HttpError(422, "told to fail", param="fail")
        return json_response(body)

    @app.route("GET", "/boom")
    async def boom(req: Request) -> Response:
        raise RuntimeError("kaput")

    @app.route("GET", "/stream")
    async def stream(req: Request) -> StreamResponse:
        async def gen() -> AsyncIterator[bytes]:
            try:
                for i in range(3):
                    yield b"data: %d\n\n" % i
                if req.query == "hang":
                    await asyncio.sleep(30)
            finally:
                closed.append(req.query)

        return StreamResponse(gen())

    @app.route("GET", "/push")
    async def push(req: Request) -> PushResponse:
        """Three chunks written from loop callbacks (as the engine loop does), then the end;
        ?hang: no end (the client leaves); ?fail: an error before anything was sent."""

        def start(writer: ChunkWriter) -> None:
            loop = asyncio.get_running_loop()
            writer.on_close = lambda: closed.append("push " + req.query)
            if req.query == "fail":
                writer.fail(409, "told to fail")
                return

            def step(i: int) -> None:  # one chunk per loop pass, then the end
                if i < 3:
                    writer.write(b"data: p%d\n\n" % i)
                    loop.call_soon(step, i + 1)
                elif req.query != "hang":
                    writer.end(b"data: [DONE]\n\n")

            loop.call_soon(step, 0)

        return PushResponse(start, headers={"x-kind": "push"})

    return app


# Pipelined requests and the answers they must get, in order.
PIPELINE = [
    (b"GET /a?x=1 HTTP/1.1\r\nhost: t\r\nuser-agent: t\r\n\r\n", 200, b'{"q":"x=1","ua":"t"}'),
    (b"GET /nope HTTP/1.1\r\nhost: t\r\n\r\n", 404, None),
    (b"POST /a HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n", 405, None),
    (b'POST /json HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\n\r\n{"a', 400, None),
    (b'POST /json HTTP/1.1\r\nhost: t\r\ncontent-length: 7\r\n\r\n{"a":1}', 200, b'{"a":1}'),
    (b"GET /stream HTTP/1.1\r\nhost: t\r\n\r\n", 200, b"data: 0\n\ndata: 1\n\ndata: 2\n\n"),
    (
        b"GET /push HTTP/1.1\r\nhost: t\r\n\r\n",
        200,
        b"data: p0\n\ndata: p1\n\ndata: p2\n\ndata: [DONE]\n\n",
    ),
    (b"GET /push?fail HTTP/1.1\r\nhost: t\r\n\r\n", 409, None),
    (b"GET /a?y HTTP/1.1\r\nhost: t\r\nuser-agent: zz\r\n\r\n", 200, b'{"q":"y","ua":"zz"}'),
]


def _split_points(total: int, how: str, rng: random.Random) -> list[int]:
    """Where to cut the pipelined bytes into separate writes."""
    if how == "whole":
        return []
    if how == "bytewise":
        return list(range(1, total))
    if how.startswith("every"):
        step = int(how[5:])
        return list(range(step, total, step))
    return sorted(rng.sample(range(1, total), rng.randint(1, 40)))


def test_pipelined_requests_split_anywhere() -> None:
    """The same pipelined requests, written whole, byte by byte, in fixed and seeded random
    cuts (bodies split from their heads, reads ending mid-request, several requests per read),
    with and without pauses between writes: every answer comes back, in order."""
    payload = b"".join(raw for raw, _, _ in PIPELINE)
    # cuts exactly at each head end and each request end
    boundaries: list[int] = []
    pos = 0
    for raw, _, _ in PIPELINE:
        boundaries.append(pos + raw.index(b"\r\n\r\n") + 4)
        pos += len(raw)
        boundaries.append(pos)

    async def one(port: int, cuts: list[int], pause: bool) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            start = 0
            for cut in [*cuts, len(payload)]:
                if cut <= start:
                    continue
                writer.write(payload[start:cut])
                start = cut
                if pause:
                    await writer.drain()
                    await asyncio.sleep(0)
            for raw, status, body in PIPELINE:
                got_status, _, got_body = await read_response(reader)
                assert got_status == status, (raw, got_status, cuts)
                if body is not None:
                    assert got_body == body, (raw, got_body)
        finally:
            writer.close()

    async def run() -> None:
        server = await serve(make_app([]), "127.0.0.1", 0)
        rng = random.Random(7)
        try:
            cases = [_split_points(len(payload), how, rng) for how in ("whole", "bytewise")]
            cases += [_split_points(len(payload), f"every{n}", rng) for n in (2, 3, 7, 31)]
            cases += [_split_points(len(payload), "random", rng) for _ in range(12)]
            cases += [sorted(set(boundaries)), [b - 1 for b in boundaries]]
            for i, cuts in enumerate(cases):
                await one(server.port, cuts, pause=i % 2 == 1)
            # several connections at once, interleaved
            await asyncio.gather(*(one(server.port, cuts, True) for cuts in cases[:6]))
            assert server.num_connections <= len(cases)
        finally:
            await server.close()

    asyncio.run(run())


def test_push_stream_disconnect_and_backpressure() -> None:
    async def run() -> None:
        closed: list[str] = []
        app = make_app(closed)
        state: dict[str, int] = {"paused_after": 0, "resumed": 0}
        big = b"x" * 65536

        @app.route("GET", "/flood")
        async def flood(req: Request) -> PushResponse:
            def start(writer: ChunkWriter) -> None:
                # write until the socket buffer is full, then wait for on_resume
                n = 0
                while writer.writable and n < 10_000:
                    writer.write(big)
                    n += 1
                state["paused_after"] = n

                def resumed() -> None:
                    state["resumed"] += 1
                    writer.end(b"end")

                writer.on_resume = resumed

            return PushResponse(start, content_type="application/octet-stream")

        server = await serve(app, "127.0.0.1", 0)
        try:
            # the client leaves mid-stream: on_close is called once
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /push?hang HTTP/1.1\r\nhost: t\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"data: p2\n\n"), READ_TIMEOUT_S)
            assert closed == []
            writer.close()
            for _ in range(200):
                if closed:
                    break
                await asyncio.sleep(0.01)
            assert closed == ["push hang"]
            # a slow reader: the producer sees writable False, then on_resume
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(
                b"GET /flood HTTP/1.1\r\nhost: t\r\n\r\nGET /a HTTP/1.1\r\nhost: t\r\n\r\n"
            )
            await asyncio.sleep(0.1)
            status, headers, body = await read_response(reader)
            assert status == 200 and headers["content-type"] == "application/octet-stream"
            assert 0 < state["paused_after"] < 10_000 and state["resumed"] == 1
            assert body == big * state["paused_after"] + b"end"
            assert (await read_response(reader))[0] == 200  # the next pipelined request
            writer.close()
        finally:
            await server.close()

    asyncio.run(run())


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response (content-length or chunked); fails after READ_TIMEOUT_S."""
    return await asyncio.wait_for(_read_response(reader), READ_TIMEOUT_S)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return status, headers, body
        body += data[:-2]


def test_routes_keepalive_pipelining_errors() -> None:
    async def run() -> None:
        server = await serve(make_app([]), "127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(
                b"GET /a?x=1 HTTP/1.1\r\nhost: t\r\nuser-agent: t\r\n\r\n"
                b"GET /nope HTTP/1.1\r\nhost: t\r\n\r\n"
                b"POST /a HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n"
                b'POST /json HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\n\r\n{"a'
            )
            status, _, body = await read_response(reader)
            assert status == 200 and body == b'{"q":"x=1","ua":"t"}'
            status, _, body = await read_response(reader)
            assert status == 404 and b'"code":404' in body
            status, _, _ = await read_response(reader)
            assert status == 405
            status, _, body = await read_response(reader)
            assert status == 400 and b'"type":"BadRequestError"' in body
            writer.write(b'POST /json HTTP/1.1\r\nhost: t\r\ncontent-length: 10\r\n\r\n{"fail":1}')
            status, _, body = await read_response(reader)
            assert status == 422 and b'"param":"fail"' in body
            writer.write(b"GET /boom HTTP/1.1\r\nhost: t\r\n\r\n")
            status, _, body = await read_response(reader)
            assert status == 500 and b"kaput" in body
            writer.write(b"GET /stream HTTP/1.1\r\nhost: t\r\n\r\n")
            status, headers, body = await read_response(reader)
            assert headers["transfer-encoding"] == "chunked"
            assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
            writer.close()
        finally:
            await server.close()

    asyncio.run(run())


def test_oversized_body_gets_413_and_connection_closes() -> None:
    async def run() -> None:
        server = await serve(make_app([]), "127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(
                b"POST /json HTTP/1.1\r\nhost: t\r\ncontent-length: 5000\r\n\r\n" + b"x" * 5000
            )
            status, headers, body = await read_response(reader)
            assert status == 413 and headers["connection"] == "close"
            assert b'"code":413' in body
            assert await asyncio.wait_for(reader.read(), READ_TIMEOUT_S) == b""
            # the server still serves new connections
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /a HTTP/1.1\r\nhost: t\r\n\r\n")
            assert (await read_response(reader))[0] == 200
            writer.close()
        finally:
            await server.close()

    asyncio.run(run())


def test_client_disconnect_closes_the_stream_iterator() -> None:
    async def run() -> None:
        closed: list[str] = []
        server = await serve(make_app(closed), "127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /stream?hang HTTP/1.1\r\nhost: t\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"data: 2\n\n"), READ_TIMEOUT_S)
            assert closed == []
            writer.close()
            for _ in range(100):
                if closed:
                    break
                await asyncio.sleep(0.01)
            assert closed == ["hang"]
        finally:
            await server.close()

    asyncio.run(run())


def test_failure_while_answering_aborts_instead_of_stalling() -> None:
    """A response that cannot even be encoded (a header outside latin-1) used to kill the
    connection's serving task silently and leave the client, and any request pipelined after
    it, waiting forever: now the connection is aborted at once."""

    async def run() -> None:
        app = make_app([])

        @app.route("GET", "/badheader")
        async def bad(req: Request) -> Response:
            return Response(b"{}", headers={"x-name": "\u20ac"})

        server = await serve(app, "127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(
                b"GET /badheader HTTP/1.1\r\nhost: t\r\n\r\nGET /a HTTP/1.1\r\nhost: t\r\n\r\n"
            )
            assert await asyncio.wait_for(reader.read(), READ_TIMEOUT_S) == b""
            writer.close()
            # the server still serves
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /a HTTP/1.1\r\nhost: t\r\n\r\n")
            assert (await read_response(reader))[0] == 200
            writer.close()
        finally:
            await server.close()

    asyncio.run(run())


def test_the_public_api_only_grows() -> None:
    """Other modules import these names from flexpipe.http.server: none may go away."""
    import flexpipe.http.server as server

    before = {"App", "ChunkWriter", "Handler", "HttpError", "HttpServer", "PushResponse",
              "Request", "Response", "StreamResponse", "error_body", "error_response",
              "install_uvloop", "json_response", "serve"}  # fmt: skip
    assert before | {"HttpLimits"} <= set(server.__all__)
    assert all(hasattr(server, name) for name in server.__all__)
    assert server.App(max_body_bytes=123).max_body_bytes == 123  # the old constructor
