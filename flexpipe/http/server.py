"""A small, fast HTTP/1.1 server: asyncio protocol + httptools parser (+ uvloop when present).

Generic on purpose (no engine or gateway logic): the sim engine and the gateway both serve on it.

API (stable; other modules depend on it)::

    from flexpipe.http.server import App, Request, Response, StreamResponse, HttpError, serve

    app = App(max_body_bytes=8 << 20)

    @app.route("GET", "/health")
    async def health(req: Request) -> Response:
        return Response(b"")

    @app.route("POST", "/v1/echo")
    async def echo(req: Request) -> Response | StreamResponse:
        body = req.json()                      # orjson; raises HttpError(400) on bad JSON
        if not body:
            raise HttpError(400, "empty body")  # -> OpenAI/vLLM error JSON, status 400
        async def chunks() -> AsyncIterator[bytes]:
            yield b"data: 1\\n\\n"
        return StreamResponse(chunks())        # chunked transfer encoding, text/event-stream

    server = await serve(app, "127.0.0.1", 0)  # port 0: pick a free one
    print(server.port)
    ...
    await server.close()

- `Request`: `method` (str), `path` (str, no query), `query` (str), `headers` (dict with
  lower-case names), `body` (bytes), `json()`, `query_params()`, `client` (peer address).
- `Response(body, status=200, content_type=..., headers=None)`; `json_response(obj, status)`;
  `error_response(status, message, type=None, param=None)` gives vLLM's error body
  ``{"error": {"message", "type", "param", "code"}}`` (code = the HTTP status, as vLLM does).
- `StreamResponse(iterator, status=200, content_type="text/event-stream", headers=None)`: the
  iterator's byte strings are written as HTTP chunks as soon as they are produced (empty ones
  are skipped). When the client disconnects, the handler task is cancelled and the iterator is
  closed at once (`aclose()`), so a `finally:` in an async generator frees its resources.
- `PushResponse(start, status=200, content_type="text/event-stream", headers=None)`: a stream
  its producer writes to directly, with no task woken per chunk (the sim engine's loop writes
  every stream's tokens right after each step). The server calls `start(writer)` with a
  `ChunkWriter` and moves on to the connection's next pipelined request once the producer
  calls `writer.end()` (or the client goes away). `writer.write(data)` sends one HTTP chunk
  (the head goes out with the first); `writer.writable` is False while the socket buffer is
  full: the producer should hold its data back until `writer.on_resume` is called;
  `writer.on_close` is called once if the client disconnects before `end()`; `writer.fail(status,
  message)` answers an error body when nothing was sent yet, else breaks the stream.
- `HttpError(status, message, type=None, param=None)`: raise it in a handler to answer with an
  error body. Any other exception answers 500 (and is logged).
- Routing is by exact (method, path); unknown path -> 404, known path with another method
  -> 405. `App.fallback` (a handler) takes every unrouted request when set (a proxy uses it).
- Connections: keep-alive (HTTP/1.1 default, `Connection: close` honoured), TCP_NODELAY on
  every accepted socket, pipelined requests answered in order, write back-pressure honoured
  for streams (the iterator is not pulled while the socket buffer is full), bodies over
  `max_body_bytes` answered 413 and the connection closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import parse_qs

import httptools
import orjson

__all__ = [
    "App",
    "ChunkWriter",
    "Handler",
    "HttpError",
    "HttpServer",
    "PushResponse",
    "Request",
    "Response",
    "StreamResponse",
    "error_body",
    "error_response",
    "install_uvloop",
    "json_response",
    "serve",
]

log = logging.getLogger("flexpipe.http")

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024

# vLLM's error "type" per status (vllm/entrypoints/openai: create_error_response).
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


_STATUS_LINES = {s: b"HTTP/1.1 %d %s\r\n" % (s, _reason(s)) for s in range(100, 600)}


class HttpError(Exception):
    """Raise in a handler to answer `status` with an OpenAI/vLLM error body."""

    def __init__(
        self, status: int, message: str, type: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param


class Request:
    __slots__ = ("_json", "body", "client", "headers", "method", "path", "query")

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        headers: dict[str, str],
        body: bytes,
        client: tuple[str, int] | None = None,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.client = client
        self._json: Any = None

    def json(self) -> Any:
        """The body parsed as JSON; HttpError(400) when it is not JSON."""
        if self._json is None:
            try:
                self._json = orjson.loads(self.body)
            except orjson.JSONDecodeError as exc:
                raise HttpError(400, f"Invalid JSON body: {exc}") from None
        return self._json

    def query_params(self) -> dict[str, list[str]]:
        return parse_qs(self.query)


class Response:
    __slots__ = ("body", "content_type", "headers", "status")

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.body = body
        self.status = status
        self.content_type = content_type
        self.headers = headers


class StreamResponse:
    __slots__ = ("content_type", "headers", "iterator", "status")

    def __init__(
        self,
        iterator: AsyncIterator[bytes],
        status: int = 200,
        content_type: str = "text/event-stream",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.iterator = iterator
        self.status = status
        self.content_type = content_type
        self.headers = headers


class PushResponse:
    """A streamed response written by its producer through a `ChunkWriter` (see the module
    docstring); `start(writer)` is called once the connection is ready for it."""

    __slots__ = ("content_type", "headers", "start", "status")

    def __init__(
        self,
        start: Callable[[ChunkWriter], None],
        status: int = 200,
        content_type: str = "text/event-stream",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.start = start
        self.status = status
        self.content_type = content_type
        self.headers = headers


class ChunkWriter:
    """The producer's handle on one pushed (chunked) response."""

    __slots__ = ("_conn", "_done", "_head", "_keep_alive", "closed", "on_close", "on_resume")

    def __init__(self, conn: _Connection, head: bytes, keep_alive: bool) -> None:
        self._conn = conn
        self._head: bytes | None = head
        self._keep_alive = keep_alive
        self._done: asyncio.Future[None] = conn.loop.create_future()
        self.closed = False  # ended by the producer or lost by the client
        self.on_close: Callable[[], None] | None = None  # the client left before end()
        self.on_resume: Callable[[], None] | None = None  # writable again after a pause

    @property
    def writable(self) -> bool:
        """False while the socket buffer is full (hold data back until `on_resume`)."""
        return not self.closed and self._conn._can_write.is_set()

    @property
    def started(self) -> bool:
        """Whether the response head has gone out."""
        return self._head is None

    def write(self, data: bytes) -> None:
        """Send `data` as one HTTP chunk (nothing for empty data or a closed stream)."""
        if self.closed or not data:
            return
        out = b"%x\r\n%b\r\n" % (len(data), data)
        if self._head is not None:
            out = self._head + out
            self._head = None
        transport = self._conn.transport
        assert transport is not None
        transport.write(out)

    def end(self, data: bytes = b"") -> None:
        """Send the last `data` and the terminal chunk: the response is complete."""
        if self.closed:
            return
        out = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n"
        if self._head is not None:
            out = self._head + out
            self._head = None
        transport = self._conn.transport
        assert transport is not None
        transport.write(out)
        self._finish()

    def fail(self, status: int, message: str, type: str | None = None) -> None:
        """An error: as an error body when nothing was sent yet, else a broken stream."""
        if self.closed:
            return
        transport = self._conn.transport
        assert transport is not None
        if self._head is not None:
            resp = error_response(status, message, type)
            keep = self._keep_alive
            transport.write(
                _encode_head(status, resp.content_type, None, len(resp.body), keep) + resp.body
            )
            self._head = None
        else:
            self._conn._closed = True
            transport.abort()
        self._finish()

    def _finish(self) -> None:
        self.closed = True
        if not self._done.done():
            self._done.set_result(None)

    def _lost(self) -> None:
        """The client went away (or the server is dropping the connection)."""
        if self.closed:
            return
        self._finish()
        cb = self.on_close
        if cb is not None:
            try:
                cb()
            except Exception:
                log.exception("push stream on_close failed")

    def _resumed(self) -> None:
        cb = self.on_resume
        if cb is not None and not self.closed:
            try:
                cb()
            except Exception:
                log.exception("push stream on_resume failed")


Handler = Callable[[Request], Awaitable[Response | StreamResponse | PushResponse]]


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status, "application/json", headers)


def error_body(
    status: int, message: str, type: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """vLLM's error shape: {"error": {"message", "type", "param", "code": <status>}}."""
    err_type = type or _ERROR_TYPES.get(status, "Error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(
    status: int, message: str, type: str | None = None, param: str | None = None
) -> Response:
    return json_response(error_body(status, message, type, param), status)


class App:
    """Routes by exact (method, path)."""

    def __init__(self, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.max_body_bytes = max_body_bytes
        self.routes: dict[tuple[str, str], Handler] = {}
        self._paths: set[str] = set()
        self.fallback: Handler | None = None

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        key = (method.upper(), path)
        if key in self.routes:
            raise ValueError(f"route {method} {path} registered twice")
        self.routes[key] = handler
        self._paths.add(path)

    def route(self, method: str, path: str) -> Callable[[Handler], Handler]:
        def deco(handler: Handler) -> Handler:
            self.add_route(method, path, handler)
            return handler

        return deco

    def resolve(self, method: str, path: str) -> Handler:
        handler = self.routes.get((method, path))
        if handler is not None:
            return handler
        if self.fallback is not None:
            return self.fallback
        if path in self._paths:
            return _method_not_allowed
        return _not_found


async def _not_found(req: Request) -> Response:
    return error_response(404, f"Not Found: {req.method} {req.path}", "NotFoundError")


async def _method_not_allowed(req: Request) -> Response:
    return error_response(405, f"Method Not Allowed: {req.method} {req.path}")


def _encode_head(
    status: int,
    content_type: str,
    headers: dict[str, str] | None,
    length: int | None,
    keep_alive: bool,
) -> bytes:
    parts = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status]
    parts.append(b"content-type: " + content_type.encode("latin-1") + b"\r\n")
    if length is None:
        parts.append(b"transfer-encoding: chunked\r\n")
    else:
        parts.append(b"content-length: %d\r\n" % length)
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    if headers:
        for name, value in headers.items():
            parts.append(f"{name}: {value}\r\n".encode("latin-1"))
    parts.append(b"\r\n")
    return b"".join(parts)


class _Connection(asyncio.Protocol):
    """One client connection: parses requests and answers them in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.app = server.app
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.client: tuple[str, int] | None = None
        # current request being parsed
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_len = 0
        self._too_large = False
        # requests parsed but not yet answered (pipelining)
        self._pending: deque[tuple[Request, bool]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._push: ChunkWriter | None = None  # the pushed response in progress

    # --- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; they have its methods
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        self.client = (peer[0], peer[1]) if isinstance(peer, tuple) else None
        self.server._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.server._connections.discard(self)
        self._can_write.set()
        if self._push is not None:
            self._push._lost()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._pending.clear()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()
        if self._push is not None:
            self._push._resumed()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._write_error_and_close(400, "Protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._write_error_and_close(400, f"Malformed HTTP request: {exc}")

    # --- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_len = 0
        self._too_large = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.app.max_body_bytes:
            self._too_large = True
            if int(length) > 4 * self.app.max_body_bytes + (1 << 20):
                self._reject_too_large()  # not worth reading: answer now and close

    def on_body(self, body: bytes) -> None:
        if self._too_large:
            return  # read and drop the rest, then answer 413 (closing early resets the socket)
        self._body_len += len(body)
        if self._body_len > self.app.max_body_bytes:
            self._too_large = True
            self._body = []
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._too_large:
            self._reject_too_large()
            return
        url = httptools.parse_url(self._url)
        path = url.path.decode("latin-1")
        query = url.query.decode("latin-1") if url.query else ""
        method = self.parser.get_method().decode("latin-1")
        body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        req = Request(method, path, query, self._headers, body, self.client)
        self._pending.append((req, self.parser.should_keep_alive()))
        task = self._task
        if task is None or task.done():
            self._task = self.loop.create_task(self._serve_pending())

    # --- answering ----------------------------------------------------------------------
    def _reject_too_large(self) -> None:
        self._too_large = True
        limit = self.app.max_body_bytes
        self._write_error_and_close(413, f"Request body too large: the limit is {limit} bytes")

    def _write_error_and_close(self, status: int, message: str, type: str | None = None) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if self._task is not None:
            # a request is in progress: finish nothing more on this connection
            self._task.cancel()
        resp = error_response(status, message, type)
        head = _encode_head(status, resp.content_type, None, len(resp.body), False)
        self.transport.write(head + resp.body)
        self.transport.close()

    async def _serve_pending(self) -> None:
        """Answer the parsed requests in order (one task per connection at a time)."""
        try:
            while self._pending and not self._closed:
                req, keep_alive = self._pending.popleft()
                await self._serve_one(req, keep_alive)
                if not keep_alive:
                    if self.transport is not None:
                        self.transport.close()
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            # never leave the client waiting on requests nobody will answer
            log.exception("connection failed")
            self._closed = True
            if self.transport is not None:
                self.transport.abort()
        finally:
            if self._task is asyncio.current_task():
                self._task = None

    async def _serve_one(self, req: Request, keep_alive: bool) -> None:
        transport = self.transport
        assert transport is not None
        handler = self.app.resolve(req.method, req.path)
        try:
            resp = await handler(req)
        except HttpError as exc:
            resp = error_response(exc.status, exc.message, exc.type, exc.param)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("handler for %s %s failed", req.method, req.path)
            resp = error_response(500, f"Internal server error: {type(exc).__name__}: {exc}")
        if self._closed:
            if isinstance(resp, StreamResponse):
                await _aclose(resp.iterator)
            elif isinstance(resp, PushResponse):
                self._drop_push(resp)
            return
        if isinstance(resp, PushResponse):
            await self._push_stream(resp, keep_alive)
            return
        if isinstance(resp, Response):
            head = _encode_head(
                resp.status, resp.content_type, resp.headers, len(resp.body), keep_alive
            )
            transport.write(head + resp.body if len(resp.body) < 65536 else head)
            if len(resp.body) >= 65536:
                transport.write(resp.body)
            return
        await self._stream(resp, keep_alive)

    def _drop_push(self, resp: PushResponse) -> None:
        """The client left before the pushed response started: start it on a closed writer
        and call its on_close, so the producer frees what it holds."""
        writer = ChunkWriter(self, b"", False)
        writer.closed = True
        try:
            resp.start(writer)
            if writer.on_close is not None:
                writer.on_close()
        except Exception:
            log.exception("push stream start failed")

    async def _push_stream(self, resp: PushResponse, keep_alive: bool) -> None:
        head = _encode_head(resp.status, resp.content_type, resp.headers, None, keep_alive)
        writer = ChunkWriter(self, head, keep_alive)
        self._push = writer
        try:
            try:
                resp.start(writer)
            except Exception as exc:
                log.exception("push stream start failed")
                writer.fail(500, f"Internal server error: {type(exc).__name__}: {exc}")
            await writer._done
        finally:
            self._push = None
            writer._lost()  # cancelled (connection dropped): tell the producer

    async def _stream(self, resp: StreamResponse, keep_alive: bool) -> None:
        transport = self.transport
        assert transport is not None
        head = _encode_head(resp.status, resp.content_type, resp.headers, None, keep_alive)
        iterator = resp.iterator
        can_write = self._can_write
        pending_head: bytes | None = head
        try:
            async for chunk in iterator:
                if not chunk:
                    continue
                if self._closed:
                    break
                data = b"%x\r\n%b\r\n" % (len(chunk), chunk)
                if pending_head is not None:
                    data = pending_head + data
                    pending_head = None
                transport.write(data)
                if not can_write.is_set():
                    await can_write.wait()
            if not self._closed:
                transport.write((pending_head or b"") + b"0\r\n\r\n")
        except asyncio.CancelledError:
            await _aclose(iterator)
            raise
        except Exception:
            log.exception("stream failed")
            # the head may be out: abort the connection so the client sees a broken stream
            transport.abort()
            self._closed = True
        finally:
            await _aclose(iterator)


async def _aclose(iterator: AsyncIterator[bytes]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


class HttpServer:
    """A running server; `await close()` stops it and drops its connections."""

    def __init__(self, app: App) -> None:
        self.app = app
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self.host = ""
        self.port = 0

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> None:
        loop = asyncio.get_running_loop()
        if sock is not None:
            self._server = await loop.create_server(
                lambda: _Connection(self), sock=sock, backlog=2048
            )
        else:
            self._server = await loop.create_server(
                lambda: _Connection(self), host, port, backlog=2048, reuse_address=True
            )
        sockname = self._server.sockets[0].getsockname()
        self.host, self.port = sockname[0], sockname[1]

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.serve_forever()

    def stop_accepting(self) -> None:
        """Close the listening socket; open connections stay (a graceful shutdown's start)."""
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for conn in list(self._connections):
            if conn.transport is not None:
                conn.transport.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2.0)
        self._server = None


async def serve(
    app: App, host: str = "127.0.0.1", port: int = 0, sock: socket.socket | None = None
) -> HttpServer:
    """Start serving `app` on host:port (port 0 picks a free one); returns the running server."""
    server = HttpServer(app)
    await server.start(host, port, sock)
    return server


def install_uvloop() -> bool:
    """Use uvloop's event loop policy when it is installed; returns whether it is."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True
