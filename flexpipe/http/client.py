"""A small fast HTTP/1.1 client for talking to upstream engines: keep-alive connection pool
per backend, TCP_NODELAY, bodies streamed chunk by chunk as they arrive, and three separate
timeouts (connect, time to first byte, between chunks) and no total timeout, so a healthy
long stream is never cut.

    pool = ClientPool()
    resp = await pool.request("http://127.0.0.1:8001", "POST", "/v1/completions", body,
                              timeouts=Timeouts(connect_s=2, ttfb_s=60, idle_s=30))
    resp.status, resp.headers
    async for chunk in resp.iter_chunks(): ...     # or: body = await resp.read()
    resp.release()          # back to the pool if complete; aborts the upstream if not
    await pool.close()

Closing a response that is not complete aborts its TCP connection, which is how an engine
(vLLM, the sim engine) learns that the client went away and cancels the request.

Built on an `asyncio.Protocol` with httptools' response parser: no per-chunk task or queue,
one future per wait. Timeouts are one lazily re-armed timer per connection: a wait only moves
a deadline, and the timer, when it fires early, re-arms itself for the deadline (a
`call_later` per chunk would push and cancel a heap entry for every token). `next_chunk`
returns everything that has already arrived as one piece, so a relay that fell behind
catches up with one write instead of one per event (no data is ever held back).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

__all__ = ["ClientPool", "Timeouts", "UpstreamError", "UpstreamResponse"]

_MAX_BUFFERED_CHUNKS = 64  # pause reading the socket beyond this many unread chunks
MAX_HEAD_BYTES = 64 * 1024  # an upstream response head larger than this is a protocol error


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = 5.0
    ttfb_s: float = 300.0  # request sent -> response head (prefill can be long)
    idle_s: float = 120.0  # between two body chunks


class UpstreamError(Exception):
    """`kind`: "connect" (could not connect), "ttfb", "idle" (timeouts), "closed" (the
    upstream went away mid-response), "protocol" (unparsable response)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class _Conn(asyncio.Protocol):
    """One upstream connection; parses one response at a time."""

    def __init__(self, max_head_bytes: int = MAX_HEAD_BYTES) -> None:
        # kept: `get_running_loop()` costs a getpid() system call on every call
        self.loop = asyncio.get_running_loop()
        self.max_head_bytes = max_head_bytes
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.num_uses = 0
        self._timer: asyncio.TimerHandle | None = None
        self._deadline_s = 0.0  # loop time at which the current wait times out
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: deque[bytes] = deque()
        self.head_done = False
        self.complete = False
        self.keep_alive = True
        self.error: UpstreamError | None = None
        self.got_bytes = False
        self.head_bytes = 0  # received before the head was complete
        self.waiter: asyncio.Future[bool] | None = None
        self.paused = False
        # pipe mode (`UpstreamResponse.pipe`): body chunks go straight to the sink
        self.sink_data: Callable[[bytes], None] | None = None
        self.sink_end: Callable[[UpstreamError | None], None] | None = None
        self.idle_s = 0.0

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(False)

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if not self.head_done:
            # the head is counted before parsing (httptools joins a long header value piece
            # by piece): feed what the limit allows, and the rest only if the head ended in it
            room = self.max_head_bytes - self.head_bytes
            if len(data) > room:
                self.head_bytes += room
                self._feed(data[:room])
                if self.error is not None:
                    return
                if not self.head_done:
                    self._protocol_error(f"response head over {self.max_head_bytes} bytes")
                    return
                data = data[room:]
            else:
                self.head_bytes += len(data)
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._protocol_error(str(exc))

    def _protocol_error(self, message: str) -> None:
        self.error = UpstreamError("protocol", message)
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()
        self._wake()
        self._sink_failed()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            self.error = UpstreamError("closed", "upstream closed the connection")
        self._wake()
        self._sink_failed()

    def _sink_failed(self) -> None:
        end = self.sink_end
        if end is not None and self.error is not None:
            self.sink_data = self.sink_end = None
            self.stop_timer()
            end(self.error)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        sink = self.sink_data
        if sink is not None:
            self._deadline_s = self.loop.time() + self.idle_s
            sink(body)
            return
        self.chunks.append(body)
        if len(self.chunks) > _MAX_BUFFERED_CHUNKS and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()
        end = self.sink_end
        if end is not None:
            self.sink_data = self.sink_end = None
            self.stop_timer()
            end(None)

    async def wait(self, timeout_s: float, kind: str) -> None:
        loop = self.loop
        fut: asyncio.Future[bool] = loop.create_future()
        self.waiter = fut
        deadline_s = loop.time() + timeout_s
        self._deadline_s = deadline_s
        timer = self._timer
        if timer is None or timer.when() > deadline_s:
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(deadline_s, self._on_timer)
        try:
            timed_out = await fut
        finally:
            self.waiter = None
        if timed_out:
            raise UpstreamError(kind, f"no data for {timeout_s:g} s")

    def _on_timer(self) -> None:
        self._timer = None
        if self.sink_end is not None:  # pipe mode: idle since the last chunk?
            now_s = self.loop.time()
            if self.paused:  # we stopped reading (a slow client): no silence of the upstream's
                self._deadline_s = now_s + self.idle_s
            if now_s >= self._deadline_s:
                self.error = UpstreamError("idle", f"no data for {self.idle_s:g} s")
                self.keep_alive = False
                self._sink_failed()
                if self.transport is not None:
                    self.transport.abort()
            else:
                self._timer = self.loop.call_at(self._deadline_s, self._on_timer)
            return
        w = self.waiter
        if w is None or w.done():
            return  # not waiting now: the next wait arms a new timer
        if self.loop.time() >= self._deadline_s:
            w.set_result(True)
        else:
            self._timer = self.loop.call_at(self._deadline_s, self._on_timer)

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class UpstreamResponse:
    def __init__(self, pool: ClientPool, key: str, conn: _Conn, timeouts: Timeouts) -> None:
        self._pool = pool
        self._key = key
        self._conn = conn
        self._idle_s = timeouts.idle_s  # between two body chunks (`set_idle_timeout`)
        self.status = conn.status
        self.headers = conn.headers
        self.loop = conn.loop  # the event loop the response lives on
        self._released = False

    @property
    def complete(self) -> bool:
        return self._conn.complete and not self._conn.chunks

    async def next_chunk(self) -> bytes | None:
        """The body bytes received since the last call (waiting for some if none), or None
        at the end of the body."""
        conn = self._conn
        while True:
            chunks = conn.chunks
            if chunks:
                if len(chunks) == 1:
                    chunk = chunks.popleft()
                else:  # all that already arrived, as one piece
                    chunk = b"".join(chunks)
                    chunks.clear()
                if conn.paused:
                    conn.paused = False
                    if conn.transport is not None:
                        conn.transport.resume_reading()
                return chunk
            if conn.complete:
                return None
            if conn.error is not None:
                raise conn.error
            try:
                await conn.wait(self._idle_s, "idle")
            except UpstreamError:
                self.close()
                raise

    def pipe(
        self, on_data: Callable[[bytes], None], on_end: Callable[[UpstreamError | None], None]
    ) -> None:
        """From now on, call `on_data(chunk)` for each body chunk as it arrives, from the
        connection's own callback (no task is woken per chunk), then `on_end(None)` at the end
        of the body or `on_end(error)` once on a failure or an idle timeout. Chunks already
        received are delivered first, before this returns. Call `release()` when done (in
        `on_end`, or earlier to abort); `pause_reading()` / `resume_reading()` for back-pressure.
        """
        conn = self._conn
        if conn.chunks:
            data = b"".join(conn.chunks)
            conn.chunks.clear()
            on_data(data)
        if conn.paused:
            self.resume_reading()
        if conn.complete:
            on_end(None)
            return
        if conn.error is not None:
            on_end(conn.error)
            return
        conn.sink_data, conn.sink_end = on_data, on_end
        conn.idle_s = self._idle_s
        conn._deadline_s = conn.loop.time() + conn.idle_s
        conn.stop_timer()
        conn._timer = conn.loop.call_at(conn._deadline_s, conn._on_timer)

    def set_idle_timeout(self, idle_s: float) -> None:
        """From now on, wait at most `idle_s` between two body chunks (a stream that has
        started may be held to a tighter bound than the wait for its first chunk)."""
        self._idle_s = idle_s
        conn = self._conn
        if conn.sink_end is None:
            return  # `next_chunk` reads the new bound at its next wait
        conn.idle_s = idle_s
        deadline_s = conn._deadline_s = conn.loop.time() + idle_s
        timer = conn._timer
        if timer is None or timer.when() > deadline_s:
            if timer is not None:
                timer.cancel()
            conn._timer = conn.loop.call_at(deadline_s, conn._on_timer)

    def pause_reading(self) -> None:
        conn = self._conn
        if not conn.paused and conn.transport is not None and not conn.closed:
            conn.paused = True
            conn.transport.pause_reading()

    def resume_reading(self) -> None:
        conn = self._conn
        if conn.paused:
            conn.paused = False
            if conn.transport is not None and not conn.closed:
                conn.transport.resume_reading()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the response: the connection goes back to the pool when the body was
        read to the end, and is aborted otherwise (cancelling the upstream request)."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.sink_data = conn.sink_end = None
        conn.stop_timer()
        if conn.complete and conn.keep_alive and not conn.closed and conn.error is None:
            self._pool._put(self._key, conn)
        elif conn.transport is not None:
            conn.transport.abort()

    close = release


class ClientPool:
    """Keep-alive connections per backend (`scheme://host:port`), reused LIFO."""

    def __init__(
        self, max_idle_per_backend: int = 512, max_head_bytes: int = MAX_HEAD_BYTES
    ) -> None:
        self.max_idle_per_backend = max_idle_per_backend
        self.max_head_bytes = max_head_bytes
        self._idle: dict[str, list[_Conn]] = {}  # backend -> idle connections
        self._addrs: dict[str, tuple[str, int, str]] = {}  # backend -> host, port, host header
        self._heads: dict[tuple[str, str, str], bytes] = {}  # (backend, method, path) -> line
        self.num_connects = 0

    def _addr(self, backend: str) -> tuple[str, int, str]:
        addr = self._addrs.get(backend)
        if addr is None:
            parts = urlsplit(backend)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"only http://host:port backends are supported: {backend!r}")
            port = parts.port or 80
            addr = (parts.hostname, port, f"{parts.hostname}:{port}")
            self._addrs[backend] = addr
        return addr

    def _put(self, key: str, conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) >= self.max_idle_per_backend:
            if conn.transport is not None:
                conn.transport.close()
            return
        if conn.paused and conn.transport is not None:
            conn.transport.resume_reading()  # the body ended while reading was paused
        conn._reset()
        idle.append(conn)

    async def _connect(self, backend: str, timeout_s: float) -> _Conn:
        host, port, _ = self._addr(backend)
        loop = asyncio.get_running_loop()
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for returns a connection made as
            # the caller is cancelled, swallowing the cancellation (the client's leaving)
            async with asyncio.timeout(timeout_s):
                _, proto = await loop.create_connection(
                    lambda: _Conn(self.max_head_bytes), host, port
                )
        except TimeoutError:
            raise UpstreamError("connect", f"connect to {backend} timed out") from None
        except OSError as exc:
            raise UpstreamError("connect", f"{backend}: {exc.strerror or exc}") from None
        self.num_connects += 1
        return proto

    async def request(
        self,
        backend: str,
        method: str,
        path: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        timeouts: Timeouts = Timeouts(),
    ) -> UpstreamResponse:
        """Send a request and wait for the response head (status and headers)."""
        key = (backend, method, path)
        prefix = self._heads.get(key)
        if prefix is None:
            _, _, host_header = self._addr(backend)
            prefix = f"{method} {path} HTTP/1.1\r\nhost: {host_header}\r\n".encode("latin-1")
            if len(self._heads) < 1024:
                self._heads[key] = prefix
        parts = [prefix]
        if body or method in ("POST", "PUT", "PATCH"):
            parts.append(b"content-length: %d\r\n" % len(body))
        if headers:
            for k, v in headers.items():
                parts.append(f"{k}: {v}\r\n".encode("latin-1"))
        parts.append(b"\r\n")
        parts.append(body)
        data = b"".join(parts)
        for attempt in range(2):
            conn, reused = self._take(backend)
            if conn is None:
                conn = await self._connect(backend, timeouts.connect_s)
            assert conn.transport is not None
            conn.num_uses += 1
            try:
                if conn.closed or conn.transport.is_closing():
                    # lost between connect (or take) and now: an engine that just died
                    raise UpstreamError("closed", "upstream closed the connection")
                try:
                    conn.transport.write(data)
                except RuntimeError as exc:  # uvloop: writing to a transport closed under us
                    raise UpstreamError("closed", str(exc)) from None
                while not conn.head_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait(timeouts.ttfb_s, "ttfb")
            except UpstreamError as exc:
                conn.stop_timer()
                if conn.transport is not None:
                    conn.transport.abort()
                # A reused keep-alive connection the server had just closed: retry once.
                if exc.kind == "closed" and reused and not conn.got_bytes and attempt == 0:
                    continue
                raise
            except BaseException:
                # cancelled while waiting for the head (the client left): abort, so the
                # upstream sees the disconnect and the connection is not left open
                conn.stop_timer()
                if conn.transport is not None:
                    conn.transport.abort()
                raise
            return UpstreamResponse(self, backend, conn, timeouts)
        raise AssertionError("unreachable")

    def _take(self, backend: str) -> tuple[_Conn | None, bool]:
        idle = self._idle.get(backend)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn, True
        return None, False

    def drop_backend(self, backend: str) -> None:
        for conn in self._idle.pop(backend, []):
            if conn.transport is not None:
                conn.transport.close()

    async def close(self) -> None:
        for backend in list(self._idle):
            self.drop_backend(backend)
        await asyncio.sleep(0)
