"""A minimal asyncio Redis client (RESP2): pipelined commands on one connection, and a
subscriber connection that hands each published message to a callback. Only what the
gateway's Redis backend needs (redis_state.py), so the gateway takes on no client library.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

__all__ = ["RedisConnection", "RedisError", "parse_url"]


class RedisError(Exception):
    """An error reply, or the connection is gone."""


class _Incomplete(Exception):
    pass


def _parse(buf: bytes | bytearray, pos: int) -> tuple[Any, int]:
    """One reply from `buf` at `pos`: (value, position after it); `_Incomplete` if cut."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind, line = buf[pos : pos + 1], bytes(buf[pos + 1 : end])
    pos = end + 2
    if kind == b"+":
        return line.decode(), pos
    if kind == b"-":
        return RedisError(line.decode()), pos
    if kind == b":":
        return int(line), pos
    if kind == b"$":
        n = int(line)
        if n < 0:
            return None, pos
        if len(buf) < pos + n + 2:
            raise _Incomplete
        return bytes(buf[pos : pos + n]), pos + n + 2
    if kind == b"*":
        n = int(line)
        if n < 0:
            return None, pos
        out = []
        for _ in range(n):
            value, pos = _parse(buf, pos)
            out.append(value)
        return out, pos
    raise RedisError(f"unexpected reply type {kind!r}")


def _encode(args: tuple[Any, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


def parse_url(url: str) -> tuple[str, int, int]:
    """redis://HOST:PORT/DB -> (host, port, db)."""
    parts = urlsplit(url)
    if parts.scheme != "redis":
        raise ValueError(f"expected redis://HOST:PORT/DB, got {url!r}")
    db = int(parts.path.strip("/") or 0)
    return parts.hostname or "127.0.0.1", parts.port or 6379, db


class RedisConnection(asyncio.Protocol):
    """One connection. `execute` and `pipeline` send commands and await their replies in
    order; with `on_message`, a subscriber: every published message goes there."""

    def __init__(self, on_message: Callable[[bytes, bytes], None] | None = None) -> None:
        self.on_message = on_message
        self.transport: asyncio.WriteTransport | None = None
        self._buf = bytearray()
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.lost = asyncio.Event()

    @classmethod
    async def connect(
        cls,
        url: str,
        on_message: Callable[[bytes, bytes], None] | None = None,
        timeout_s: float = 2.0,
    ) -> RedisConnection:
        host, port, db = parse_url(url)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout_s):
            _, conn = await loop.create_connection(lambda: cls(on_message), host, port)
            if db and on_message is None:
                await conn.execute("SELECT", db)
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        while pos < len(buf):
            try:
                value, pos_after = _parse(buf, pos)
            except _Incomplete:
                break
            pos = pos_after
            if (
                self.on_message is not None
                and isinstance(value, list)
                and len(value) == 3
                and value[0] == b"message"
            ):
                self.on_message(value[1], value[2])
                continue
            if self._waiting:
                fut = self._waiting.popleft()
                if not fut.done():
                    fut.set_result(value)
        del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        del exc
        self.transport = None
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_exception(RedisError("connection lost"))
        self.lost.set()

    @property
    def closed(self) -> bool:
        return self.transport is None

    def send(self, *args: Any) -> asyncio.Future[Any]:
        """Send one command; the future is its reply (an error reply is its exception)."""
        if self.transport is None:
            raise RedisError("not connected")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        self.transport.write(_encode(args))
        return fut

    async def execute(self, *args: Any) -> Any:
        value = await self.send(*args)
        if isinstance(value, RedisError):
            raise value
        return value

    async def pipeline(self, *commands: tuple[Any, ...]) -> list[Any]:
        """Several commands in one write; their replies (error replies as values)."""
        if self.transport is None:
            raise RedisError("not connected")
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in commands]
        self._waiting.extend(futs)
        self.transport.write(b"".join(_encode(c) for c in commands))
        return list(await asyncio.gather(*futs))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
