"""`ChunkWriter`: the producer's handle on a `PushResponse` (see `flexpipe.http.server`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from flexpipe.http.messages import encode_head, error_response

if TYPE_CHECKING:
    from flexpipe.http.connection import _Connection

__all__ = ["ChunkWriter"]

log = logging.getLogger("flexpipe.http")


class ChunkWriter:
    """The producer's handle on one pushed response (chunked, or raw to an HTTP/1.0 client)."""

    __slots__ = (
        "_chunked",
        "_conn",
        "_done",
        "_head",
        "_keep_alive",
        "closed",
        "on_close",
        "on_resume",
    )

    def __init__(
        self, conn: _Connection, head: bytes, keep_alive: bool, chunked: bool = True
    ) -> None:
        self._conn = conn
        self._head: bytes | None = head
        self._keep_alive = keep_alive
        self._chunked = chunked
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
        out = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
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
        if not self._chunked:
            out = data
        elif data:
            out = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)
        else:
            out = b"0\r\n\r\n"
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
                encode_head(status, resp.content_type, None, len(resp.body), keep) + resp.body
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
