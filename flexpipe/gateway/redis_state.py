"""The Redis backend of `SharedState` (shared_state.py): gateway replicas on several hosts
(or workers of one host) share through one `redis-server`.

- Tenant budgets: each tenant's buckets live in one Redis hash, changed by an optimistic
  transaction (WATCH, read, decide with the same `Tenant` code a lone gateway runs, MULTI /
  EXEC, again on a conflict), on Redis's clock (TIME): exact across replicas, whatever one a
  request lands on. Concurrency is counted per member (`if:<member>` fields); a member whose
  heartbeat (every `member_ttl_s` / 3) stops for `member_ttl_s` is dead, and its slots no
  longer count.
- The control log: a Redis list every member appends its admin changes to (and compacts),
  and a channel that carries each one to the others at once.
- Prefix inserts and questions to the other members: channels.

Redis down: every member keeps serving on its own state (pool, holds, prefix index);
a tenant's request is refused with 503 (`budgets_when_down: closed`, the default) or
admitted on this member's own buckets (`local`); admin changes made meanwhile wait and are
published on reconnection, when the member also replays what it missed. Each loss and
return is logged and counted (`flexpipe_shared_state_up`, `..._outages_total`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from flexpipe.gateway.config import SharedStateConfig, TenantConfig
from flexpipe.gateway.redis_resp import RedisConnection, RedisError
from flexpipe.gateway.shared_state import (
    ControlOp,
    OnAsk,
    OnOp,
    OnPrefix,
    SharedStateDown,
    TenantVerdict,
    compact,
)
from flexpipe.gateway.tenants import Tenant, TokenBucket, tenant_ids

__all__ = ["RedisState"]

log = logging.getLogger("flexpipe.gateway")

MAX_TX_TRIES = 50  # optimistic transactions on one tenant, before a 503
RECONNECT_S = 0.5
# Redis silent this long (a partition sends no FIN): taken as lost, its connections closed
REDIS_TIMEOUT_S = 1.0


def _bucket_fields(prefix: str, b: TokenBucket | None) -> list[Any]:
    return [] if b is None else [f"{prefix}l", repr(b.level), f"{prefix}u", repr(b.updated_s)]


def _restore(b: TokenBucket | None, fields: dict[str, float], prefix: str, now: float) -> None:
    """A bucket's level from Redis (a tenant seen for the first time: full, as now)."""
    if b is None:
        return
    b.level = fields.get(f"{prefix}l", b.capacity)
    b.updated_s = fields.get(f"{prefix}u", now)


class _Silent(Exception):
    """Redis did not answer within REDIS_TIMEOUT_S."""


@dataclass(slots=True)
class _Item:
    """One budget decision: an admission (`used` None; `fut` gets the verdict) or the end
    of an admitted request (`num_tokens` charged, `used` used)."""

    name: str
    num_tokens: float
    used: float | None
    fut: asyncio.Future[TenantVerdict] | None


class RedisState:
    def __init__(
        self,
        cfg: SharedStateConfig,
        tenants: list[TenantConfig],
        member: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert cfg.url is not None
        self.cfg = cfg
        self.url = cfg.url
        self._member = member
        self.clock = clock
        self._tenant_cfgs = tenant_ids(tenants)
        now = clock()
        self._local = {tid: Tenant(c, now) for tid, c in self._tenant_cfgs.items()}  # when down
        p = cfg.prefix
        self.k_log, self.k_members = f"{p}:log", f"{p}:members"
        self.c_ops, self.c_px, self.c_ask = f"{p}:ops", f"{p}:px", f"{p}:ask"
        self.c_ans = f"{p}:ans:{member}"
        self._cmd: RedisConnection | None = None
        self._tx: RedisConnection | None = None  # WATCH is per connection: transactions here
        self._tx_lock = asyncio.Lock()  # (the log's trim; budgets commit one batch at a time)
        self._batch: list[_Item] = []  # budget decisions waiting for the next transaction
        self._committer: asyncio.Task[None] | None = None
        self._sub: RedisConnection | None = None
        self.up = False
        self.num_outages = 0
        self._on_op: OnOp | None = None
        self._on_prefix: OnPrefix | None = None
        self._on_ask: OnAsk | None = None
        self._seen: set[str] = set()  # uids of the ops applied here (ours included)
        self._op_ids = itertools.count(1)
        self._unsent: list[ControlOp] = []  # admin changes made while Redis was down
        self._unsettled: list[tuple[str, float, float]] = []  # requests ended meanwhile
        self._prefixes: list[list[Any]] = []
        self._asks: dict[int, tuple[asyncio.Future[list[Any]], list[Any], int, bool]] = {}
        self._ask_ids = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        # ops that came while the log was read (subscribed first): applied after it
        self._early: list[ControlOp] | None = None

    @property
    def member(self) -> str:
        return self._member

    @property
    def member_salted(self) -> bool:
        return True

    # ------------------------------------------------------------------ connection
    async def start(self, on_op: OnOp, on_prefix: OnPrefix, on_ask: OnAsk) -> list[ControlOp]:
        self._on_op, self._on_prefix, self._on_ask = on_op, on_prefix, on_ask
        ops: list[ControlOp] = []
        try:
            ops = await self._connect()
        except (OSError, RedisError, TimeoutError) as exc:
            log.warning(
                "shared state: Redis at %s unreachable (%s); serving on local state", self.url, exc
            )
            self._spawn(self._reconnect())
        self._spawn(self._heartbeat())
        return ops

    async def _connect(self) -> list[ControlOp]:
        """Connect, subscribe, and the control log's ops not seen here yet."""
        self._early = []
        try:
            return await self._sync()
        finally:
            self._early = None

    async def _sync(self) -> list[ControlOp]:
        cmd = await RedisConnection.connect(self.url)
        tx = await RedisConnection.connect(self.url)
        sub = await RedisConnection.connect(self.url, self._message)
        for channel in (self.c_ops, self.c_px, self.c_ask, self.c_ans):
            await sub.execute("SUBSCRIBE", channel)
        self._cmd, self._tx, self._sub = cmd, tx, sub
        await self._beat()
        raw = await cmd.execute("LRANGE", self.k_log, 0, -1)
        logged: list[ControlOp] = []
        for item in raw:
            logged = compact(logged, orjson.loads(item))
        assert self._early is not None
        for op in self._early:  # (published after the subscription: the log may have it)
            logged = compact([o for o in logged if o.get("uid") != op.get("uid")], op)
        new = [op for op in logged if op.get("uid") not in self._seen]
        self._seen.update(str(op.get("uid")) for op in new)
        self.up = True
        for conn in (cmd, tx, sub):
            self._spawn(self._watch(conn))
        unsent, self._unsent = self._unsent, []
        for op in unsent:
            await self._push(op)
        unsettled, self._unsettled = self._unsettled, []
        for name, charged, used in unsettled:
            self._enqueue(_Item(name, charged, used, None))
        return new

    async def _watch(self, conn: RedisConnection) -> None:
        await conn.lost.wait()
        if self.up and not self._closing:
            self.up = False
            self.num_outages += 1
            log.warning(
                "shared state: lost Redis at %s; serving on local state, tenant budgets %s",
                self.url,
                "refused (503)" if self.cfg.budgets_when_down == "closed" else "per replica",
            )
            for c in (self._cmd, self._tx, self._sub):
                if c is not None:
                    c.close()
            for fut, answers, _, _ in self._asks.values():
                if not fut.done():
                    fut.set_result(answers)
            self._asks.clear()
            self._spawn(self._reconnect())

    async def _reconnect(self) -> None:
        while not self._closing:
            await asyncio.sleep(RECONNECT_S)
            try:
                ops = await self._connect()
            except (OSError, RedisError, TimeoutError):
                continue
            assert self._on_op is not None
            for op in ops:
                self._on_op(op)
            log.warning(
                "shared state: Redis at %s is back; resynced (%d control op(s) replayed)",
                self.url,
                len(ops),
            )
            return

    async def _beat(self) -> None:
        assert self._cmd is not None
        now = await self._redis_now(self._cmd)
        await self._cmd.execute(
            "HSET", self.k_members, self._member, repr(now + self.cfg.member_ttl_s)
        )

    async def _heartbeat(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.cfg.member_ttl_s / 3)
            if self.up:
                try:
                    async with asyncio.timeout(REDIS_TIMEOUT_S):
                        await self._beat()
                except TimeoutError:
                    self._silent()
                except (RedisError, OSError):
                    pass

    @staticmethod
    async def _redis_now(conn: RedisConnection) -> float:
        sec, usec = await conn.execute("TIME")
        return int(sec) + int(usec) / 1e6

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self._closing = True
        if self.up and self._cmd is not None:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._cmd.execute("HDEL", self.k_members, self._member)
        for c in (self._cmd, self._tx, self._sub):
            if c is not None:
                c.close()
        for t in list(self._tasks):
            t.cancel()

    # ------------------------------------------------------------------ messages
    def _message(self, channel: bytes, data: bytes) -> None:
        msg = orjson.loads(data)
        if msg.get("m") == self._member:
            return
        ch = channel.decode()
        if ch == self.c_px:
            assert self._on_prefix is not None
            for url, hashes in msg["l"]:
                self._on_prefix(url, tuple(hashes))
        elif ch == self.c_ops:
            op = msg["op"]
            if self._early is not None:
                self._early.append(op)
            elif op.get("uid") not in self._seen:
                self._seen.add(op["uid"])
                assert self._on_op is not None
                self._on_op(op)
        elif ch == self.c_ask:
            self._spawn(self._answer(msg))
        elif ch == self.c_ans:
            entry = self._asks.get(msg["id"])
            if entry is not None:
                fut, answers, expected, first = entry
                answers.append(msg["v"])
                if (len(answers) >= expected or (first and msg["v"])) and not fut.done():
                    fut.set_result(answers)

    async def _answer(self, msg: dict[str, Any]) -> None:
        assert self._on_ask is not None
        try:
            value = await self._on_ask(msg["k"], msg["b"])
        except Exception:
            log.exception("answering a peer's %s", msg.get("k"))
            value = None
        if self.up and self._cmd is not None:
            reply = orjson.dumps({"m": self._member, "id": msg["id"], "v": value})
            with contextlib.suppress(RedisError, OSError):
                await self._cmd.execute("PUBLISH", f"{self.cfg.prefix}:ans:{msg['m']}", reply)

    # ------------------------------------------------------------------ control log
    def publish(self, op: ControlOp) -> None:
        op = {**op, "uid": f"{self._member}:{next(self._op_ids)}"}
        self._seen.add(op["uid"])
        if not self.up:
            self._unsent.append(op)
            return
        self._spawn(self._push(op))

    async def _push(self, op: ControlOp) -> None:
        assert self._cmd is not None
        data = orjson.dumps(op)
        try:
            _, _, length = await self._cmd.pipeline(
                ("RPUSH", self.k_log, data),
                ("PUBLISH", self.c_ops, orjson.dumps({"m": self._member, "op": op})),
                ("LLEN", self.k_log),
            )
        except RedisError:
            self._unsent.append(op)
            return
        if isinstance(length, int) and length > 256:
            await self._trim()

    async def _trim(self) -> None:
        """Replace the log by its compaction (WATCHed: an op pushed meanwhile retries)."""
        async with self._tx_lock:
            tx = self._tx
            if tx is None:
                return
            for _ in range(5):
                _, raw = await tx.pipeline(("WATCH", self.k_log), ("LRANGE", self.k_log, 0, -1))
                logged: list[ControlOp] = []
                for item in raw:
                    logged = compact(logged, orjson.loads(item))
                cmds: list[tuple[Any, ...]] = [("MULTI",), ("DEL", self.k_log)]
                if logged:
                    cmds.append(("RPUSH", self.k_log, *[orjson.dumps(o) for o in logged]))
                if (await tx.pipeline(*cmds, ("EXEC",)))[-1] is not None:
                    return

    # ------------------------------------------------------------------ prefixes
    def share_prefix(self, url: str, hashes: tuple[int, ...]) -> None:
        if not self.up:
            return
        if not self._prefixes:
            asyncio.get_running_loop().call_soon(self._flush_prefixes)
        self._prefixes.append([url, hashes])

    def _flush_prefixes(self) -> None:
        batch, self._prefixes = self._prefixes, []
        if self.up and self._cmd is not None:
            msg = orjson.dumps({"m": self._member, "l": batch})
            self._cmd.send("PUBLISH", self.c_px, msg)  # (its reply is not awaited)

    # ------------------------------------------------------------------ budgets
    # Group commit: the admissions and ends that arrive while a transaction is in flight go
    # together in the next one (read every tenant they touch once, decide each in arrival
    # order with the same `Tenant` code, write once): one transaction per Redis round trip
    # pair whatever the load, and the order of decisions is the order of arrival.
    async def tenant_admit(self, name: str, num_tokens: float) -> TenantVerdict:
        if not self.up:
            return self._admit_locally(name, num_tokens)
        fut: asyncio.Future[TenantVerdict] = asyncio.get_running_loop().create_future()
        self._enqueue(_Item(name, num_tokens, None, fut))
        try:
            return await fut
        except _Silent:
            return self._admit_locally(name, num_tokens)
        except (RedisError, OSError) as exc:
            if self.up:
                raise SharedStateDown(str(exc)) from None
            return self._admit_locally(name, num_tokens)

    def _silent(self) -> None:
        """Redis stopped answering: close its connections (`_watch` then takes it as lost
        and reconnects)."""
        log.warning("shared state: Redis at %s silent for %.1f s", self.url, REDIS_TIMEOUT_S)
        for c in (self._cmd, self._tx, self._sub):
            if c is not None:
                c.close()

    def _admit_locally(self, name: str, num_tokens: float) -> TenantVerdict:
        if self.cfg.budgets_when_down != "local":
            raise SharedStateDown("Redis is unreachable")
        tenant = self._local.get(name)
        if tenant is None:
            return False, 1.0, "unknown tenant"
        verdict = tenant.admit(num_tokens, self.clock())
        if verdict[0]:
            tenant.num_in_flight += 1
        return verdict

    def tenant_end(self, name: str, charged_tokens: float, used_tokens: float) -> None:
        """Settle where the request was admitted: this member's own buckets while it holds
        requests admitted there (Redis was down), else Redis, now or once it is back (its
        slot must not stay counted there)."""
        tenant = self._local.get(name)
        if tenant is not None and tenant.num_in_flight > 0:
            tenant.num_in_flight -= 1
            tenant.settle(charged_tokens, used_tokens, self.clock())
        elif self.up:
            self._enqueue(_Item(name, charged_tokens, used_tokens, None))
        else:
            self._unsettled.append((name, charged_tokens, used_tokens))

    def _enqueue(self, item: _Item) -> None:
        self._batch.append(item)
        if self._committer is None or self._committer.done():
            self._committer = asyncio.get_running_loop().create_task(self._commit_batches())

    async def _commit_batches(self) -> None:
        while self._batch:
            items, self._batch = self._batch, []
            error: Exception
            try:
                async with asyncio.timeout(REDIS_TIMEOUT_S):
                    verdicts = await self._commit(items)
            except TimeoutError:
                self._silent()
                error = _Silent()
            except (RedisError, OSError) as exc:
                error = exc
            else:
                for item, verdict in zip(items, verdicts, strict=True):
                    if item.fut is not None and not item.fut.done():
                        item.fut.set_result(verdict)
                continue
            for item in items:
                if item.fut is None:
                    self._unsettled.append((item.name, item.num_tokens, item.used or 0.0))
                elif not item.fut.done():
                    item.fut.set_exception(error)

    async def _commit(self, items: list[_Item]) -> list[TenantVerdict]:
        """Decide `items` in order, atomically in Redis (WATCHed: again on a conflict)."""
        tx = self._tx
        if tx is None:
            raise RedisError("not connected")
        names = sorted({i.name for i in items if i.name in self._tenant_cfgs})
        keys = [f"{self.cfg.prefix}:tenant:{n}" for n in names]
        mine = f"if:{self._member}"
        for _ in range(MAX_TX_TRIES):
            reads: list[tuple[Any, ...]] = [("HGETALL", k) for k in keys]
            replies = await tx.pipeline(
                ("WATCH", *keys) if keys else ("PING",),
                *reads,
                ("HGETALL", self.k_members),
                ("TIME",),
            )
            members, (sec, usec) = replies[-2], replies[-1]
            now = int(sec) + int(usec) / 1e6
            alive = {
                members[i].decode()
                for i in range(0, len(members), 2)
                if float(members[i + 1]) > now
            }
            tenants: dict[str, tuple[Tenant, int, list[str]]] = {}  # name -> (it, mine, dead)
            for name, raw in zip(names, replies[1:-2], strict=True):
                fields = {raw[i].decode(): raw[i + 1] for i in range(0, len(raw), 2)}
                tenant = Tenant(self._tenant_cfgs[name], now)
                nums = {k: float(v) for k, v in fields.items() if k.startswith(("reqs_", "toks_"))}
                _restore(tenant.requests, nums, "reqs_", now)
                _restore(tenant.tokens, nums, "toks_", now)
                dead = [k for k in fields if k.startswith("if:") and k[3:] not in alive]
                tenant.num_in_flight = sum(
                    int(v) for k, v in fields.items() if k.startswith("if:") and k not in dead
                )
                tenants[name] = (tenant, int(fields.get(mine, b"0")), dead)
            deltas = dict.fromkeys(names, 0)
            verdicts: list[TenantVerdict] = []
            for item in items:
                entry = tenants.get(item.name)
                if entry is None:
                    verdicts.append((False, 1.0, "unknown tenant"))
                    continue
                tenant, num_mine, _ = entry
                if item.used is None:
                    verdict = tenant.admit(item.num_tokens, now)
                    if verdict[0]:
                        tenant.num_in_flight += 1
                        deltas[item.name] += 1
                    verdicts.append(verdict)
                else:
                    if num_mine + deltas[item.name] > 0:  # (none after Redis lost its data)
                        tenant.num_in_flight -= 1
                        deltas[item.name] -= 1
                    tenant.settle(item.num_tokens, item.used, now)
                    verdicts.append((True, 0.0, ""))
            cmds: list[tuple[Any, ...]] = [("MULTI",)]
            for name, key in zip(names, keys, strict=True):
                tenant, _, dead = tenants[name]
                values = _bucket_fields("reqs_", tenant.requests)
                values += _bucket_fields("toks_", tenant.tokens)
                if values:
                    cmds.append(("HSET", key, *values))
                if deltas[name]:
                    cmds.append(("HINCRBY", key, mine, deltas[name]))
                if dead:
                    cmds.append(("HDEL", key, *dead))
            cmds.append(("EXEC",))
            if (await tx.pipeline(*cmds))[-1] is not None:
                return verdicts
        raise RedisError("too much contention on the tenants' budgets")

    # ------------------------------------------------------------------ questions
    async def ask_peers(
        self, kind: str, body: dict[str, Any], timeout_s: float, first: bool = False
    ) -> list[Any]:
        if not self.up or self._cmd is None:
            return []
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                members = await self._cmd.execute("HGETALL", self.k_members)
                now = await self._redis_now(self._cmd)
        except (RedisError, OSError, TimeoutError):
            return []
        others = [
            members[i].decode()
            for i in range(0, len(members), 2)
            if float(members[i + 1]) > now and members[i].decode() != self._member
        ]
        if not others:
            return []
        rid = next(self._ask_ids)
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        answers: list[Any] = []
        self._asks[rid] = (fut, answers, len(others), first)
        msg = orjson.dumps({"m": self._member, "id": rid, "k": kind, "b": body})
        try:
            await self._cmd.execute("PUBLISH", self.c_ask, msg)
            async with asyncio.timeout(timeout_s):
                return await fut
        except (TimeoutError, RedisError, OSError):
            return list(answers)
        finally:
            self._asks.pop(rid, None)
