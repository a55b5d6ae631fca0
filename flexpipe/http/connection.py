"""One client connection of the HTTP server: parsing within `HttpLimits`, answering pipelined
requests in order, and the disconnect contract (a handler whose client leaves before the
response head is cancelled); its read and write timeouts and its ways of closing are
`_Closing` (closing.py). See `flexpipe.http.server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, NamedTuple, cast

import httptools

from flexpipe.http.closing import _BODY, _HEAD, _IDLE, _Closing
from flexpipe.http.messages import (
    Handler,
    HttpError,
    PushResponse,
    Request,
    Response,
    StreamResponse,
    encode_head,
    error_response,
)
from flexpipe.http.push import ChunkWriter

if TYPE_CHECKING:
    from flexpipe.http.server import HttpServer

log = logging.getLogger("flexpipe.http")

_PARSE_SLICE_BYTES = 16 * 1024  # parsed at a time (bounds the requests parsed per read)


class _LimitExceeded(Exception):
    """Raised in a parser callback to stop parsing; the answer is in `_Connection._error`."""


class _Parsed(NamedTuple):
    """A request parsed and waiting for its answer."""

    request: Request
    handler: Handler
    keep_alive: bool
    head_only: bool  # HEAD answered by the GET route: the head, no body
    http10: bool  # an HTTP/1.0 client: streams are not chunked, the connection closes


class _Connection(_Closing, asyncio.Protocol):
    """One client connection: parses requests within the limits and answers them in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.app = server.app
        self.limits = server.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.client: tuple[str, int] | None = None
        # the request being parsed
        self._url = b""
        self._headers: dict[str, str] = {}
        self._num_headers = 0
        self._body: list[bytes] = []  # chunks, joined once: no quadratic concatenation
        self._body_len = 0
        self._max_body_bytes = 0
        self._method = ""
        self._path = ""
        self._query = ""
        self._handler: Handler | None = None
        self._head_only = False
        self._error: tuple[int, str] | None = None  # set by a callback that stops parsing
        # the read side
        self._read_phase = _IDLE
        self._head_bytes = 0  # received while waiting for a request head
        self._num_requests = 0
        self._accepted_s = 0.0  # loop time (a new connection is not reaped at once at the cap)
        self._reading_paused = False
        self._unparsed = bytearray()  # read but held back while too many requests wait
        self._deadline_s = math.inf  # loop time at which the read side times out
        self._timer: asyncio.TimerHandle | None = None
        # the answering side
        self._pending: deque[_Parsed] = deque()  # parsed, not answered yet (pipelining)
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._refusing = False  # an error went out: read and drop until the client closes
        self._refused = False  # refused at the connection cap (not counted in it)
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._write_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None  # drops a refused connection
        self._push: ChunkWriter | None = None  # the pushed response in progress

    # --- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; they have its methods
        self.transport = cast(asyncio.Transport, transport)
        server = self.server
        if len(server._connections) >= server.max_connections and not server._reap_idle():
            self._refuse()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        self.client = (peer[0], peer[1]) if isinstance(peer, tuple) else None
        server._connections.add(self)
        server._idle[self] = None
        self._accepted_s = self.loop.time()
        self._set_deadline(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        server = self.server
        server._connections.discard(self)
        server._idle.pop(self, None)
        server._heads.pop(self, None)
        if self._refused:
            self._refused = False
            server._num_refusing -= 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._stop_write_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        self._can_write.set()
        if self._push is not None:
            self._push._lost()
        # the disconnect contract: a handler still working for this client is cancelled
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._pending.clear()

    def pause_writing(self) -> None:
        self._can_write.clear()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(
                self.limits.write_timeout_s, self._write_timed_out
            )

    def resume_writing(self) -> None:
        self._stop_write_timer()
        self._can_write.set()
        if self._push is not None:
            self._push._resumed()

    def data_received(self, data: bytes) -> None:
        if self._refusing:
            return  # an error went out: the rest of the request is dropped
        if self._unparsed:
            self._unparsed += data  # reading is paused: at most the read already under way
            return
        self._consume(data)

    def _consume(self, data: bytes | bytearray | memoryview) -> None:
        """Parse `data` a slice at a time, stopping (and pausing reading) once
        `max_pipelined_requests` are waiting: a flood of pipelined requests in one read
        never turns into thousands of parsed requests."""
        step = _PARSE_SLICE_BYTES
        if len(data) > step:
            data = memoryview(data)
        while data:
            if len(self._pending) >= self.limits.max_pipelined_requests:
                self._unparsed = bytearray(data)
                self._pause_reading()
                return
            piece, data = data[:step], data[step:]
            self._parse(piece)
            if self._refusing or self._closed:
                return

    def _parse(self, data: bytes | bytearray | memoryview) -> None:
        if self._read_phase != _BODY:
            # the head is counted before the parser sees it (httptools joins a long header
            # value piece by piece: unbounded, that is quadratic)
            max_bytes = self.limits.max_header_bytes
            room = max_bytes - self._head_bytes
            if len(data) > room:
                self._head_bytes += room
                self._feed(data[:room])  # what the limit allows: go on if the head ended in it
                if self._refusing or self._closed:
                    return
                if self._head_bytes >= max_bytes:
                    message = f"Request header fields too large: the limit is {max_bytes} bytes"
                    self._fail(431, message)
                    return
                self._parse(data[room:])
                return
            self._head_bytes += len(data)
        self._feed(data)

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        # the client closed its side: a disconnect (a half-closing HTTP client is not supported)
        return None

    def _feed(self, data: bytes | bytearray | memoryview) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "Protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            if self._error is not None:
                self._fail(*self._error)
            else:
                self._fail(400, f"Malformed HTTP request: {exc}")

    # --- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._num_headers = 0
        self._body = []
        self._body_len = 0
        self._read_phase = _HEAD
        server = self.server
        server._idle.pop(self, None)
        if self._task is None and not self._pending:  # (a pipelined head is not sheddable)
            server._heads[self] = None
        if self._num_requests:  # the first request's head is timed from the connection
            self._set_deadline(self.limits.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.limits.max_url_bytes:
            limit = self.limits.max_url_bytes
            self._error = (414, f"Request URL too long: the limit is {limit} bytes")
            raise _LimitExceeded

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.limits.max_header_count:
            limit = self.limits.max_header_count
            self._error = (431, f"Too many request header fields: the limit is {limit}")
            raise _LimitExceeded
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._read_phase = _BODY
        self.server._heads.pop(self, None)
        self._head_bytes = 0
        self._set_deadline(self.limits.body_timeout_s)
        try:
            url = httptools.parse_url(self._url)
        except httptools.HttpParserInvalidURLError:
            self._error = (400, "Malformed request URL")
            raise _LimitExceeded from None
        if "host" not in self._headers and self.parser.get_http_version() == "1.1":
            # RFC 9112 section 3.2: an HTTP/1.1 request without Host is answered 400
            # (HTTP/1.0 clients may leave it out)
            self._error = (400, "Bad request: an HTTP/1.1 request must carry a Host header")
            raise _LimitExceeded
        self._path = url.path.decode("latin-1")
        self._query = url.query.decode("latin-1") if url.query else ""
        self._method = self.parser.get_method().decode("latin-1")
        self._handler, self._max_body_bytes, self._head_only = self.app.match(
            self._method, self._path
        )
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body_bytes:
            self._error = self._body_too_large()
            raise _LimitExceeded
        expect = self._headers.get("expect")
        if expect is not None and expect.lower() == "100-continue" and self._task is None:
            # the body is welcome: say so now rather than let the client wait (curl: 1 s);
            # not while another answer is being written (the client sends the body anyway)
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self._max_body_bytes:
            self._error = self._body_too_large()
            raise _LimitExceeded
        self._body.append(body)

    def _body_too_large(self) -> tuple[int, str]:
        return 413, f"Request body too large: the limit is {self._max_body_bytes} bytes"

    def on_message_complete(self) -> None:
        self._read_phase = _IDLE
        self._head_bytes = 0
        self._num_requests += 1
        chunks = self._body
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._body = []
        req = Request(self._method, self._path, self._query, self._headers, body, self.client)
        handler = self._handler
        assert handler is not None
        parser = self.parser
        http10 = parser.get_http_version() == "1.0"
        self._pending.append(
            _Parsed(req, handler, parser.should_keep_alive(), self._head_only, http10)
        )
        if len(self._pending) >= self.limits.max_pipelined_requests:
            self._pause_reading()
        task = self._task
        if task is None or task.done():
            self._task = self.loop.create_task(self._serve_pending())

    # --- answering ----------------------------------------------------------------------
    async def _serve_pending(self) -> None:
        """Answer the parsed requests in order (one task per connection at a time)."""
        try:
            while self._pending and not self._closed:
                if not self._can_write.is_set():
                    await self._can_write.wait()  # the client is not reading: answer no more
                    if self._closed:
                        return
                parsed = self._pending.popleft()
                if self._reading_paused:
                    self._read_more()
                keep_alive = await self._serve_one(parsed)
                if not keep_alive:
                    self._close()
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
                self._answered()

    def _read_more(self) -> None:
        """Room in the queue again: parse what was held back, then read on."""
        if len(self._pending) >= self.limits.max_pipelined_requests or self._refusing:
            return
        held, self._unparsed = self._unparsed, bytearray()
        if held:
            self._consume(held)
        room = len(self._pending) < self.limits.max_pipelined_requests
        if self._reading_paused and room and not self._unparsed and not self._closed:
            self._reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()

    def _answered(self) -> None:
        """The answers are out: time the read side again."""
        transport = self.transport
        if self._closed or self._refusing or transport is None or transport.is_closing():
            return
        if self._read_phase == _IDLE:
            self.server._idle[self] = None
            self._set_deadline(self.limits.keep_alive_timeout_s)
        else:
            self._arm()  # a pipelined request's head or body keeps its deadline

    async def _serve_one(self, parsed: _Parsed) -> bool:
        """Answer one request; returns whether the connection stays open."""
        req = parsed.request
        try:
            resp = await parsed.handler(req)
        except HttpError as exc:
            resp = error_response(exc.status, exc.message, exc.type, exc.param)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("handler for %s %s failed", req.method, req.path)
            resp = error_response(500, f"Internal server error: {type(exc).__name__}: {exc}")
        transport = self.transport
        assert transport is not None
        if self._closed:
            if isinstance(resp, StreamResponse):
                await _aclose(resp.iterator)
            elif isinstance(resp, PushResponse):
                self._drop_push(resp)
            return False
        keep_alive = parsed.keep_alive
        if isinstance(resp, Response):
            body = resp.body
            head = encode_head(resp.status, resp.content_type, resp.headers, len(body), keep_alive)
            if parsed.head_only:
                transport.write(head)
            elif len(body) < 65536:
                transport.write(head + body)
            else:
                transport.write(head)
                transport.write(body)
            return keep_alive
        chunked = not parsed.http10
        keep_alive = keep_alive and chunked  # an HTTP/1.0 stream ends when the connection does
        head = encode_head(resp.status, resp.content_type, resp.headers, None, keep_alive, chunked)
        if parsed.head_only:
            transport.write(head)
            if isinstance(resp, StreamResponse):
                await _aclose(resp.iterator)
            else:
                self._drop_push(resp)
        elif isinstance(resp, PushResponse):
            await self._push_stream(resp, head, keep_alive, chunked)
        else:
            await self._stream(resp, head, chunked)
        return keep_alive

    def _drop_push(self, resp: PushResponse) -> None:
        """The pushed response will not be sent (the client left, or HEAD): start it on a
        closed writer and call its on_close, so the producer frees what it holds."""
        writer = ChunkWriter(self, b"", False)
        writer.closed = True
        try:
            resp.start(writer)
            if writer.on_close is not None:
                writer.on_close()
        except Exception:
            log.exception("push stream start failed")

    async def _push_stream(
        self, resp: PushResponse, head: bytes, keep_alive: bool, chunked: bool
    ) -> None:
        writer = ChunkWriter(self, head, keep_alive, chunked)
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

    async def _stream(self, resp: StreamResponse, head: bytes, chunked: bool) -> None:
        transport = self.transport
        assert transport is not None
        iterator = resp.iterator
        can_write = self._can_write
        pending_head: bytes | None = head
        try:
            async for chunk in iterator:
                if not chunk:
                    continue
                if self._closed:
                    break
                data = b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk
                if pending_head is not None:
                    data = pending_head + data
                    pending_head = None
                transport.write(data)
                if not can_write.is_set():
                    await can_write.wait()
            if not self._closed:
                transport.write((pending_head or b"") + (b"0\r\n\r\n" if chunked else b""))
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
