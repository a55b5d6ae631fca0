"""The read and write timeouts of a client connection and its ways of closing (after a flush;
an error answer, then a linger; a refusal at the connection cap; a slow head shed to make
room), `_Closing`, a part of `_Connection` (connection.py), which sets the fields declared
here.

Timeouts use one lazily re-armed timer per connection: a phase change only moves a deadline,
and the timer, when it fires early, re-arms itself for it (no timer handle pushed and cancelled
per request). While a request is being answered, the read side is not timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, cast

from flexpipe.http.limits import HttpLimits
from flexpipe.http.messages import encode_head, error_response
from flexpipe.http.push import ChunkWriter

if TYPE_CHECKING:
    from flexpipe.http.connection import _Connection
    from flexpipe.http.server import HttpServer

log = logging.getLogger("flexpipe.http")

_IDLE, _HEAD, _BODY = 0, 1, 2  # what the read side waits for: a request, its head, its body
_MAX_REFUSING = 64  # connections lingering after a refusal; beyond, new ones are reset at once


class _Closing:
    """A connection's timeouts and closing (`_Connection`'s fields)."""

    server: HttpServer
    limits: HttpLimits
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport | None
    client: tuple[str, int] | None
    _read_phase: int
    _deadline_s: float
    _timer: asyncio.TimerHandle | None
    _write_timer: asyncio.TimerHandle | None
    _linger_timer: asyncio.TimerHandle | None
    _reading_paused: bool
    _closed: bool
    _refusing: bool
    _refused: bool
    _task: asyncio.Task[None] | None
    _pending: deque[Any]
    _push: ChunkWriter | None

    # --- timeouts -----------------------------------------------------------------------
    def _set_deadline(self, timeout_s: float) -> None:
        self._deadline_s = self.loop.time() + timeout_s
        self._arm()

    def _arm(self) -> None:
        timer = self._timer
        deadline_s = self._deadline_s
        if timer is None or timer.when() > deadline_s:
            if timer is not None:
                timer.cancel()
            self._timer = self.loop.call_at(deadline_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._closed or self._refusing or self._task is not None or self._pending:
            return  # answering: the read side is not timed; the answer's end re-arms
        if self.loop.time() < self._deadline_s:
            self._timer = self.loop.call_at(self._deadline_s, self._on_timer)
            return
        phase = self._read_phase
        if phase == _IDLE:
            self._close()  # an idle keep-alive connection (or a new one that sent nothing)
        elif phase == _HEAD:
            limit = self.limits.header_timeout_s
            self._fail(408, f"Request head not received within {limit:g} s")
        else:
            limit = self.limits.body_timeout_s
            self._fail(408, f"Request body not received within {limit:g} s")

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if self.transport is not None and not self._closed:
            log.info("client %s stopped reading: connection aborted", self.client)
            self._closed = True
            self.transport.abort()

    def _stop_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    # --- closing ------------------------------------------------------------------------
    def _close(self) -> None:
        """Close after what was written is flushed (aborted if the client never reads it)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.server._idle.pop(cast("_Connection", self), None)
        transport.close()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(
                self.limits.write_timeout_s, self._write_timed_out
            )

    def _fail(self, status: int, message: str) -> None:
        """Answer an error for a request that cannot be parsed or read, then close: the error
        is written, our side shut, and the rest of the request read and dropped until the
        client closes or `refusal_linger_s` passes (closing at once would reset the socket
        and the client could lose the error). A request being answered is cancelled."""
        transport = self.transport
        if transport is None or transport.is_closing() or self._refusing:
            return
        self._refusing = True
        conn = cast("_Connection", self)  # (what this is a part of)
        self.server._idle.pop(conn, None)
        self.server._heads.pop(conn, None)
        if self._task is not None or self._push is not None:
            # an answer is in progress: an error cannot follow it on this connection
            self._closed = True
            transport.abort()
            return
        resp = error_response(status, message)
        transport.write(encode_head(status, resp.content_type, None, len(resp.body), False))
        transport.write(resp.body)
        self._linger()

    def _refuse(self) -> None:
        """Over the connection cap with no idle connection to close: 503, then close."""
        server = self.server
        transport = self.transport
        assert transport is not None
        self._refusing = True
        if server._num_refusing >= _MAX_REFUSING:
            transport.abort()  # a flood of refusals: the cheapest answer
            return
        self._refused = True
        server._num_refusing += 1
        cap = server.max_connections
        resp = error_response(503, f"Server busy: at its limit of {cap} connections; retry")
        head = encode_head(503, resp.content_type, {"retry-after": "1"}, len(resp.body), False)
        transport.write(head + resp.body)
        self._linger()

    def _shed(self) -> None:
        """Shed at the connection cap (`HttpServer._reap_idle`) while its request head still
        arrives: 408 and close, lingering like a refusal (a flood of them is reset at once)."""
        server = self.server
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if server._num_refusing >= _MAX_REFUSING:
            self._refusing = self._closed = True
            transport.abort()
            return
        self._refused = True
        server._num_refusing += 1
        cap = server.max_connections
        self._fail(408, f"Request head too slow: the server is at its limit of {cap} connections")

    def _linger(self) -> None:
        transport = self.transport
        assert transport is not None
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        with contextlib.suppress(Exception):
            if transport.can_write_eof():
                transport.write_eof()
        self._linger_timer = self.loop.call_later(self.limits.refusal_linger_s, self._drop)

    def _drop(self) -> None:
        self._linger_timer = None
        if self.transport is not None and not self._closed:
            self._closed = True
            self.transport.abort()
