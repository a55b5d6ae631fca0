"""The embedded shared-state backend: every gateway worker of one host shares through a small
service the supervisor runs on a Unix socket (workers.py); `EmbeddedState` is a worker's side
of `SharedState` (shared_state.py).

Why a service and not shared memory: one place decides each tenant's budget (the same
`Tenant` code a lone gateway runs, so exact by construction), the control log lives where a
restarted worker finds it, and a worker that dies (even kill -9) closes its socket, so the
service gives its tenants' concurrency back at once; a lock in shared memory would stay held
by a dead worker. The price is one round trip per request of a tenant with a budget (measured
in docs/gateway.md, "Workers and replicas"); requests without tenants pay none, and prefix
inserts go out batched, one message per event loop pass, never awaited.

Frames: a 4-byte big-endian length, then an orjson object with `t`, its kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import struct
import time
from collections.abc import Callable
from typing import Any

import orjson

from flexpipe.gateway.config import TenantConfig
from flexpipe.gateway.shared_state import (
    ControlOp,
    OnAsk,
    OnOp,
    OnPrefix,
    SharedStateDown,
    TenantVerdict,
    compact,
)
from flexpipe.gateway.tenants import Tenant, tenant_ids

__all__ = ["EmbeddedState", "StateService"]

log = logging.getLogger("flexpipe.gateway")

_LEN = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20  # a control log or an answer (the metrics) stays far below


class _Framed(asyncio.Protocol):
    """Length-prefixed orjson frames in both directions over one stream socket."""

    def __init__(
        self, on_message: Callable[[dict[str, Any]], None], on_lost: Callable[[], None]
    ) -> None:
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: asyncio.WriteTransport | None = None
        self._buf = bytearray()
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are no asyncio.Transport subclasses: no isinstance check)
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        while len(buf) - pos >= 4:
            (n,) = _LEN.unpack_from(buf, pos)
            if n > MAX_FRAME_BYTES:
                log.error("shared state: a frame of %d bytes; closing", n)
                assert self.transport is not None
                self.transport.close()
                return
            if len(buf) - pos - 4 < n:
                break
            msg = orjson.loads(bytes(buf[pos + 4 : pos + 4 + n]))
            pos += 4 + n
            self.on_message(msg)
        del buf[:pos]

    def send(self, msg: dict[str, Any]) -> None:
        if self.closed or self.transport is None:
            return
        data = orjson.dumps(msg)
        self.transport.write(_LEN.pack(len(data)) + data)

    def connection_lost(self, exc: Exception | None) -> None:
        del exc
        self.closed = True
        self.on_lost()


class _Member:
    """One connected worker, as the service sees it."""

    def __init__(self, service: StateService) -> None:
        self.service = service
        self.name = "?"
        self.joined = False
        self.in_flight: dict[str, int] = {}  # tenant id -> its requests admitted here, open
        self.conn = _Framed(self._message, self._lost)

    def _message(self, msg: dict[str, Any]) -> None:
        self.service.handle(self, msg)

    def _lost(self) -> None:
        self.service.left(self)


class StateService:
    """The supervisor's side: the control log, the tenants' budgets, and the relay of ops,
    prefix inserts and questions between workers."""

    def __init__(
        self, path: str, tenants: list[TenantConfig], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = path
        self.clock = clock
        now = clock()
        self.tenants = {tid: Tenant(cfg, now) for tid, cfg in tenant_ids(tenants).items()}
        self.log: list[ControlOp] = []
        self.members: list[_Member] = []
        self._asks: dict[int, tuple[_Member, int, set[_Member], list[Any], bool]] = {}
        self._ask_ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._connect, self.path)
        os.chmod(self.path, 0o600)

    def _connect(self) -> _Framed:
        member = _Member(self)
        self.members.append(member)
        return member.conn

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for m in list(self.members):
                if m.conn.transport is not None:
                    m.conn.transport.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _others(self, member: _Member) -> list[_Member]:
        return [m for m in self.members if m is not member and m.joined]

    def handle(self, member: _Member, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "adm":
            member.conn.send({"t": "r", "id": msg["id"], "v": self._admit(member, msg)})
        elif kind == "end":
            self._end(member, msg["n"], msg["c"], msg["u"])
        elif kind == "px":
            for m in self._others(member):
                m.conn.send(msg)
        elif kind == "op":
            self.log = compact(self.log, msg["op"])
            for m in self._others(member):
                m.conn.send(msg)
        elif kind == "ask":
            self._ask(member, msg)
        elif kind == "ans":
            self._answer(member, msg["id"], msg["v"])
        elif kind == "hello":
            member.name = str(msg["m"])
            member.joined = True
            member.conn.send({"t": "r", "id": msg["id"], "v": self.log})
        else:
            log.warning("shared state: unknown message %r from worker %s", kind, member.name)

    def _admit(self, member: _Member, msg: dict[str, Any]) -> TenantVerdict:
        tid = msg["n"]
        tenant = self.tenants.get(tid)
        if tenant is None:
            return False, 1.0, "unknown tenant"
        ok, wait_s, why = tenant.admit(float(msg["k"]), self.clock())
        if ok:
            tenant.num_in_flight += 1
            member.in_flight[tid] = member.in_flight.get(tid, 0) + 1
        return ok, wait_s, why

    def _end(self, member: _Member, tid: str, charged: float, used: float) -> None:
        tenant = self.tenants.get(tid)
        if tenant is None or not member.in_flight.get(tid):
            return
        member.in_flight[tid] -= 1
        tenant.num_in_flight -= 1
        tenant.settle(charged, used, self.clock())

    def _ask(self, member: _Member, msg: dict[str, Any]) -> None:
        others = self._others(member)
        if not others:
            member.conn.send({"t": "r", "id": msg["id"], "v": []})
            return
        sid = next(self._ask_ids)
        self._asks[sid] = (member, msg["id"], set(others), [], bool(msg.get("first")))
        for m in others:
            m.conn.send({"t": "ask", "id": sid, "k": msg["k"], "b": msg["b"]})

    def _answer(self, member: _Member, sid: int, value: Any) -> None:
        entry = self._asks.get(sid)
        if entry is None or member not in entry[2]:
            return
        asker, rid, waiting, answers, first = entry
        waiting.discard(member)
        answers.append(value)
        if not waiting or (first and value):
            del self._asks[sid]
            asker.conn.send({"t": "r", "id": rid, "v": answers})

    def left(self, member: _Member) -> None:
        """A worker's socket closed (it exited or was killed): its tenants' open requests
        died with it, and it answers no question any more."""
        if member in self.members:
            self.members.remove(member)
        for tid, num in member.in_flight.items():
            tenant = self.tenants.get(tid)
            if tenant is not None:
                tenant.num_in_flight -= num
        member.in_flight.clear()
        for sid, (asker, rid, waiting, answers, _) in list(self._asks.items()):
            if asker is member:
                del self._asks[sid]
            elif member in waiting:
                waiting.discard(member)
                if not waiting:
                    del self._asks[sid]
                    asker.conn.send({"t": "r", "id": rid, "v": answers})


class EmbeddedState:
    """A worker's side of the embedded backend (`SharedState`)."""

    def __init__(self, path: str, member: str, on_lost: Callable[[], None] | None = None) -> None:
        self.path = path
        self._member = member
        self.on_lost = on_lost
        self._conn: _Framed | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._on_op: OnOp | None = None
        self._on_prefix: OnPrefix | None = None
        self._on_ask: OnAsk | None = None
        self._prefixes: list[list[Any]] = []  # inserts of this loop pass, sent together
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        # ops that came while the log was on its way: applied after it, in order
        self._early: list[ControlOp] | None = None

    @property
    def member(self) -> str:
        return self._member

    @property
    def member_salted(self) -> bool:
        return False

    @property
    def up(self) -> bool:
        return self._conn is not None and not self._conn.closed

    @property
    def num_outages(self) -> int:
        return 0  # (a worker that loses its supervisor stops)

    async def start(self, on_op: OnOp, on_prefix: OnPrefix, on_ask: OnAsk) -> list[ControlOp]:
        self._on_op, self._on_prefix, self._on_ask = on_op, on_prefix, on_ask
        self._loop = loop = asyncio.get_running_loop()
        _, conn = await loop.create_unix_connection(
            lambda: _Framed(self._message, self._lost), self.path
        )
        self._conn = conn
        self._early = []
        ops: list[ControlOp] = await self._call({"t": "hello", "m": self._member})
        ops += self._early
        self._early = None
        return ops

    def _call(self, msg: dict[str, Any]) -> asyncio.Future[Any]:
        conn = self._conn
        if conn is None or conn.closed:
            raise SharedStateDown("the gateway's state service is gone")
        assert self._loop is not None
        rid = msg["id"] = next(self._ids)
        fut = self._pending[rid] = self._loop.create_future()
        conn.send(msg)
        return fut

    def _message(self, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "r":
            fut = self._pending.pop(msg["id"], None)
            if fut is not None and not fut.done():
                fut.set_result(msg["v"])
        elif kind == "px":
            assert self._on_prefix is not None
            for url, hashes in msg["l"]:
                self._on_prefix(url, tuple(hashes))
        elif kind == "op":
            if self._early is not None:
                self._early.append(msg["op"])
            else:
                assert self._on_op is not None
                self._on_op(msg["op"])
        elif kind == "ask":
            assert self._loop is not None
            task = self._loop.create_task(self._answer(msg["id"], msg["k"], msg["b"]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, sid: int, kind: str, body: dict[str, Any]) -> None:
        assert self._on_ask is not None
        try:
            value = await self._on_ask(kind, body)
        except Exception:
            log.exception("answering a peer's %s", kind)
            value = None
        if self._conn is not None:
            self._conn.send({"t": "ans", "id": sid, "v": value})

    def _lost(self) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(SharedStateDown("the gateway's state service is gone"))
        self._pending.clear()
        if self.on_lost is not None:
            self.on_lost()

    def publish(self, op: ControlOp) -> None:
        if self._conn is not None:
            self._conn.send({"t": "op", "op": op})

    def share_prefix(self, url: str, hashes: tuple[int, ...]) -> None:
        if not self._prefixes:
            assert self._loop is not None
            self._loop.call_soon(self._flush_prefixes)
        self._prefixes.append([url, hashes])

    def _flush_prefixes(self) -> None:
        if self._conn is not None:
            self._conn.send({"t": "px", "l": self._prefixes})
        self._prefixes = []

    async def tenant_admit(self, name: str, num_tokens: float) -> TenantVerdict:
        ok, wait_s, why = await self._call({"t": "adm", "n": name, "k": num_tokens})
        return bool(ok), float(wait_s), str(why)

    def tenant_end(self, name: str, charged_tokens: float, used_tokens: float) -> None:
        if self._conn is not None:
            self._conn.send({"t": "end", "n": name, "c": charged_tokens, "u": used_tokens})

    async def ask_peers(
        self, kind: str, body: dict[str, Any], timeout_s: float, first: bool = False
    ) -> list[Any]:
        fut = self._call({"t": "ask", "k": kind, "b": body, "first": first})
        try:
            async with asyncio.timeout(timeout_s):
                answers: list[Any] = await fut
        except TimeoutError:
            return []
        return answers

    async def close(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            self.on_lost = None
            self._conn.transport.close()
        for t in list(self._tasks):
            t.cancel()
