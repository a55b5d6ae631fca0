"""flexpipe.http.server: routing, keep-alive, pipelining, chunked streams, 413, disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from flexpipe.http.server import (
    App,
    HttpError,
    Request,
    Response,
    StreamResponse,
    json_response,
    serve,
)


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

    return app


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
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
                b"GET /a?x=1 HTTP/1.1\r\nuser-agent: t\r\n\r\n"
                b"GET /nope HTTP/1.1\r\n\r\n"
                b"POST /a HTTP/1.1\r\ncontent-length: 0\r\n\r\n"
                b'POST /json HTTP/1.1\r\ncontent-length: 3\r\n\r\n{"a'
            )
            status, _, body = await read_response(reader)
            assert status == 200 and body == b'{"q":"x=1","ua":"t"}'
            status, _, body = await read_response(reader)
            assert status == 404 and b'"code":404' in body
            status, _, _ = await read_response(reader)
            assert status == 405
            status, _, body = await read_response(reader)
            assert status == 400 and b'"type":"BadRequestError"' in body
            writer.write(b'POST /json HTTP/1.1\r\ncontent-length: 10\r\n\r\n{"fail":1}')
            status, _, body = await read_response(reader)
            assert status == 422 and b'"param":"fail"' in body
            writer.write(b"GET /boom HTTP/1.1\r\n\r\n")
            status, _, body = await read_response(reader)
            assert status == 500 and b"kaput" in body
            writer.write(b"GET /stream HTTP/1.1\r\n\r\n")
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
            writer.write(b"POST /json HTTP/1.1\r\ncontent-length: 5000\r\n\r\n" + b"x" * 5000)
            status, headers, body = await read_response(reader)
            assert status == 413 and headers["connection"] == "close"
            assert b'"code":413' in body
            assert await reader.read() == b""
            # the server still serves new connections
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /a HTTP/1.1\r\n\r\n")
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
            writer.write(b"GET /stream?hang HTTP/1.1\r\n\r\n")
            await reader.readuntil(b"data: 2\n\n")
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
