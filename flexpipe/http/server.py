"""A small, fast HTTP/1.1 server: asyncio protocol + httptools parser (+ uvloop when present),
with the limits and timeouts an internet-facing API needs (`HttpLimits`; docs/http.md).

Generic on purpose (no engine or gateway logic): the sim engine and the gateway both serve on it.

API (stable; other modules depend on it)::

    from flexpipe.http.server import App, HttpLimits, Request, Response, StreamResponse, serve

    app = App(limits=HttpLimits(max_body_bytes=8 << 20))

    @app.route("GET", "/health")
    async def health(req: Request) -> Response:
        return Response(b"")

    @app.route("POST", "/v1/echo", max_body_bytes=1 << 20)   # this route's own body limit
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
  `error_response(status, message, type=None, param=None)` gives OpenAI's (and vLLM's) error
  body ``{"error": {"message", "type", "param", "code"}}`` (code = the HTTP status, as vLLM).
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
  -> 405 (with `Allow`). HEAD on a GET route is answered by the GET handler with the same
  head (Content-Length of the GET body) and no body. `App.fallback` (a handler) takes every
  unrouted request when set (a proxy uses it).
- Connections: keep-alive (HTTP/1.1 default, `Connection: close` honoured), TCP_NODELAY on
  every accepted socket, pipelined requests answered in order (at most
  `max_pipelined_requests` queued: beyond, the connection is not read), write back-pressure
  honoured for streams. An HTTP/1.0 client gets streams without chunked encoding, delimited by
  the connection's close.
- Limits (`HttpLimits`, given to `App`, `serve` or `HttpServer`): head bytes and header count
  (431), URL bytes (414), body bytes per route (413, as soon as Content-Length or the bytes
  received exceed it, without reading the rest), header and body read timeouts (408), idle
  keep-alive timeout (closed), write timeout (a client that stops reading is aborted), a cap
  on connections (the longest-idle keep-alive connection is closed to make room, else the
  connection whose request head has been arriving longest gets 408 and is closed, else 503),
  and 400 for an HTTP/1.1 request without Host (RFC 9112 section 3.2).
  Every error body is OpenAI's error shape; after an error the connection closes.

Disconnect contract: when a client's connection closes (or a timeout aborts it) while its
request is being handled, before the response is complete, the server cancels the handler's
task: the handler sees `asyncio.CancelledError` at its current `await` and its `finally`
blocks run (the gateway releases its slot and aborts the upstream request there; the engine
aborts its generation). A `StreamResponse` iterator is closed (`aclose()`); a `PushResponse`
producer gets `writer.on_close` — also when the client left before the stream started (then
`start` is called with an already closed writer and `on_close` right after). A client that
half-closes its side after sending a request counts as gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

from flexpipe.http.connection import _Connection
from flexpipe.http.limits import HttpLimits
from flexpipe.http.messages import (
    Handler,
    HttpError,
    PushResponse,
    Request,
    Response,
    StreamResponse,
    error_body,
    error_response,
    json_response,
)
from flexpipe.http.push import ChunkWriter

__all__ = [
    "App",
    "ChunkWriter",
    "Handler",
    "HttpError",
    "HttpLimits",
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

DEFAULT_MAX_BODY_BYTES = HttpLimits().max_body_bytes
# a new connection that has sent nothing yet is not closed at the cap before this age: a
# working client's first request is on its way
NEW_CONNECTION_GRACE_S = 0.25


class App:
    """Routes by exact (method, path); each route may set its own body limit."""

    def __init__(self, max_body_bytes: int | None = None, limits: HttpLimits | None = None) -> None:
        self.limits = limits or HttpLimits()
        # the body limit of routes that set none
        self.max_body_bytes = max_body_bytes or self.limits.max_body_bytes
        self.routes: dict[tuple[str, str], Handler] = {}
        self._body_limits: dict[tuple[str, str], int] = {}  # (method, path) -> max bytes
        self._methods: dict[str, list[str]] = {}  # path -> its methods
        self.fallback: Handler | None = None

    def add_route(
        self, method: str, path: str, handler: Handler, max_body_bytes: int | None = None
    ) -> None:
        key = (method.upper(), path)
        if key in self.routes:
            raise ValueError(f"route {method} {path} registered twice")
        self.routes[key] = handler
        if max_body_bytes is not None:
            if max_body_bytes < 0:
                raise ValueError(f"route {method} {path}: max_body_bytes must be >= 0")
            self._body_limits[key] = max_body_bytes
        self._methods.setdefault(path, []).append(key[0])

    def route(
        self, method: str, path: str, max_body_bytes: int | None = None
    ) -> Callable[[Handler], Handler]:
        def deco(handler: Handler) -> Handler:
            self.add_route(method, path, handler, max_body_bytes)
            return handler

        return deco

    def resolve(self, method: str, path: str) -> Handler:
        return self.match(method, path)[0]

    def match(self, method: str, path: str) -> tuple[Handler, int, bool]:
        """The handler for a request, its body limit in bytes, and whether only the head is
        sent (HEAD answered by the GET route)."""
        key = (method, path)
        handler = self.routes.get(key)
        if handler is not None:
            return handler, self._body_limits.get(key, self.max_body_bytes), False
        if method == "HEAD":
            handler = self.routes.get(("GET", path))
            if handler is not None:
                return handler, self._body_limits.get(("GET", path), self.max_body_bytes), True
        if self.fallback is not None:
            return self.fallback, self.max_body_bytes, False
        if path in self._methods:
            return self._method_not_allowed, self.max_body_bytes, False
        return _not_found, self.max_body_bytes, False

    async def _method_not_allowed(self, req: Request) -> Response:
        resp = error_response(405, f"Method Not Allowed: {req.method} {req.path}")
        methods = self._methods.get(req.path, [])
        if "GET" in methods and "HEAD" not in methods:
            methods = [*methods, "HEAD"]
        resp.headers = {"allow": ", ".join(methods)}
        return resp


async def _not_found(req: Request) -> Response:
    return error_response(404, f"Not Found: {req.method} {req.path}", "NotFoundError")


class HttpServer:
    """A running server; `await close()` stops it and drops its connections."""

    def __init__(self, app: App, limits: HttpLimits | None = None) -> None:
        self.app = app
        self.limits = limits or app.limits
        self.max_connections = self.limits.connection_cap()
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        # connections with no request in progress, oldest first (closed first at the cap)
        self._idle: dict[_Connection, None] = {}
        # connections whose request head is still arriving, in the order their heads began
        # (the oldest, i.e. slowest, is shed first at the cap when none is idle)
        self._heads: dict[_Connection, None] = {}
        self._num_refusing = 0  # refused connections still lingering
        self.num_refused = 0
        self.num_reaped = 0
        self.num_shed = 0  # slow heads closed to make room
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

    def _reap_idle(self) -> bool:
        """At the cap: close the longest-idle connection to make room, else shed the one whose
        request head has been arriving longest (a slow client must not hold a place a working
        one needs: docs/http.md); False if there is neither. A new connection that has not
        sent a byte yet is spared for NEW_CONNECTION_GRACE_S. A head of any age may be shed
        (oldest first): a client that reconnects its slow heads as soon as they are shed would
        otherwise keep every head young, and every newcomer out."""
        now_s = asyncio.get_running_loop().time()
        for conn in self._idle:
            if not conn._num_requests and now_s - conn._accepted_s < NEW_CONNECTION_GRACE_S:
                continue
            del self._idle[conn]
            self._connections.discard(conn)
            conn._close()
            self.num_reaped += 1
            return True
        for conn in self._heads:
            del self._heads[conn]
            self._connections.discard(conn)
            conn._shed()
            self.num_shed += 1
            return True
        self.num_refused += 1
        return False

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
    app: App,
    host: str = "127.0.0.1",
    port: int = 0,
    sock: socket.socket | None = None,
    limits: HttpLimits | None = None,
) -> HttpServer:
    """Start serving `app` on host:port (port 0 picks a free one); returns the running server.
    `limits` (default: the app's) bounds every connection; body limits are the app's routes'."""
    server = HttpServer(app, limits)
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
