"""Several gateway replicas driven as one gateway (docs/controller.md, "Several gateways").

`GatewayFleet` says what `GatewayClient` says (`GatewayAdmin`), so the controller, the
executor, the standby models and the takeover call it as they call one gateway:

- every command (register, lifecycle state, weight, drain, remove, hold, refuse) goes to every
  replica at once, and is recorded first in the controller's intent
  (`control/core/gateway_sync.Intent`); it succeeds when one replica took it. A replica that
  failed it, or was skipped because it was down, has missed it;
- the tick's reads (`instances`, `metrics`) ask every replica, the down ones too (that is how
  one is found back), and give one view (`merge_pools`, `merge_metrics`). A replica that
  answers and missed a command or whose pool differs from the intent is caught up
  (`catch_up`) by a task of its own: the tick, and the other replicas, never wait for it;
- a drain waits on every replica that is up; the requests on an instance are every
  replica's, each tagged with its replica (`fleet_request_id`), and each move goes to the
  replica that holds its stream; the demand trigger answers as soon as one replica has a
  request waiting.

A replica down is skipped by commands until a read finds it again, so one that hangs costs
each tick one connect timeout, not each command. A partitioned replica that still serves
keeps its own streams on an engine that is stopped: it continues them elsewhere, as on any
engine's death (docs/gateway.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from flexpipe.control.api.gateway_client import GatewayClient, GatewayError
from flexpipe.control.core.gateway_sync import (
    MAX_REPLICAS,
    AddInstance,
    Intent,
    Registration,
    RemoveInstance,
    SendHold,
    SendRefusal,
    SetState,
    SetWeight,
    Step,
    catch_up,
    choose_deployment,
    differences,
    fleet_request_id,
    local_request_id,
    merge_metrics,
    merge_pools,
    replica_load,
)
from flexpipe.store import Store
from flexpipe.store.gateway_replicas import GatewayReplicas

__all__ = ["GatewayFleet", "Replica", "deployment_of", "fleet_view", "keep_replicas"]

log = logging.getLogger("flexpipe.control")

T = TypeVar("T")
_ALREADY = "already in the pool"  # the gateway's 400 for a registration it holds
# how long a replica may answer after the first one did before it is counted down (wall s)
STRAGGLER_S = 2.0


@dataclass
class Replica:
    """One gateway replica as the fleet last saw it."""

    index: int  # its place in the fleet (tags its request ids)
    client: GatewayClient
    up: bool = True  # answered its last call (a refusal is an answer)
    error: str | None = None  # why its last call failed, in one line
    missed: bool = False  # a command it did not take: its holds are sent again
    seen_at_s: float | None = None  # unix s of its last answer
    pool: list[dict[str, Any]] = field(default_factory=list)  # its last GET /admin/instances
    num_in_flight: int | None = None
    requests_per_s: float | None = None  # finished, over the last two reads of its /metrics
    _finished: tuple[float, float] | None = None  # (unix s, finished so far) of the last read
    catching_up: asyncio.Task[None] | None = None
    num_catch_ups: int = 0

    @property
    def url(self) -> str:
        return self.client.url


class GatewayFleet:
    """The replicas of one gateway service as one `GatewayAdmin`."""

    def __init__(
        self,
        urls: Sequence[str],
        token: str | None,
        *,
        timeout_s: float = 10.0,
        connect_s: float = 3.0,
        straggler_s: float = STRAGGLER_S,
        wall: Callable[[], float] = time.time,
        say: Callable[[str], None] | None = None,
    ) -> None:
        unique = list(dict.fromkeys(u.rstrip("/") for u in urls))
        if not unique:
            raise ValueError("no gateway URL")
        if len(unique) > MAX_REPLICAS:
            raise ValueError(f"{len(unique)} gateways: at most {MAX_REPLICAS}")
        self.replicas = [
            Replica(i, GatewayClient(u, token, timeout_s, connect_s)) for i, u in enumerate(unique)
        ]
        self.intent = Intent()
        self.straggler_s = straggler_s
        self.wall = wall
        self.say = say or (lambda line: log.warning("%s", line))

    @property
    def url(self) -> str:
        """The first replica that answered its last call (the first one when none did)."""
        return next((r.url for r in self.replicas if r.up), self.replicas[0].url)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    async def close(self) -> None:
        await self.settle()
        await asyncio.gather(*(r.client.close() for r in self.replicas))

    async def settle(self) -> None:
        """Wait for the catch-ups under way (tests; closing)."""
        tasks = [r.catching_up for r in self.replicas if r.catching_up is not None]
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ the replicas' state
    def _answered(self, r: Replica) -> None:
        if not r.up:
            self.say(f"controller: gateway {r.url} answers again")
            r.missed = True  # it may have restarted: its holds are sent again
        r.up, r.error, r.seen_at_s = True, None, self.wall()

    def _failed(self, r: Replica, exc: GatewayError) -> None:
        """A refusal (an HTTP status) leaves it up; no answer marks it down."""
        r.error = str(exc)
        r.missed = True
        if exc.status is None:
            if r.up:
                self.say(f"controller: gateway {r.url} does not answer: {exc}")
            r.up = False
        else:
            r.seen_at_s = self.wall()

    async def _each(
        self,
        call: Callable[[GatewayClient], Awaitable[T]],
        every: bool = False,
        wait_all: bool = False,
    ) -> list[tuple[Replica, T]]:
        """`call` on every replica that is up (`every`, or none is up: on all), at once; the
        answers of those that took it. None took it: the first failure is raised. One that
        has not answered `straggler_s` after another did is cut off and counted down (unless
        `wait_all`: a drain, where each replica waits for its own requests): a replica that
        hangs (stopped, swapping) holds neither the tick nor a shift for longer."""
        straggler_s = None if wait_all else self.straggler_s
        # none up: every one is tried (a gateway that starts after the controller)
        targets = [r for r in self.replicas if every or r.up] or list(self.replicas)
        for r in self.replicas:
            if r not in targets:
                r.missed = True
        tasks = {asyncio.ensure_future(call(r.client)): r for r in targets}
        late = await _stragglers(tasks, straggler_s)
        done: list[tuple[Replica, T]] = []
        failures: list[GatewayError] = []
        for task, r in tasks.items():
            if task in late:
                result: T | BaseException = GatewayError(
                    f"gateway {r.url}: no answer {straggler_s:g} s after another replica's"
                )
            else:
                result = task.exception() or task.result()
            if isinstance(result, GatewayError):
                self._failed(r, result)
                failures.append(result)
            elif isinstance(result, BaseException):
                raise result
            else:
                self._answered(r)
                done.append((r, result))
        if not done:
            if failures:
                raise failures[0]
            raise GatewayError(f"no gateway replica answers ({', '.join(self.urls)})")
        return done

    # ------------------------------------------------------------------ reads
    async def instances(self) -> list[dict[str, Any]]:
        """The instances every replica that answered holds (`merge_pools`); each replica
        that lags behind the intent is caught up meanwhile."""
        answered = await self._each(lambda c: c.instances(), every=True)
        for r, pool in answered:
            r.pool = pool
            self._maybe_catch_up(r)
        return merge_pools([pool for _, pool in answered], self.intent)

    async def metrics(self) -> str:
        """The replicas' Prometheus texts added up (`merge_metrics`); each one's in-flight
        requests and request rate kept for the fleet's view."""
        answered = await self._each(lambda c: c.metrics(), every=True)
        now_s = self.wall()
        for r, text in answered:
            try:
                r.num_in_flight, finished = replica_load(text)
            except ValueError:
                continue
            if r._finished is not None and now_s > r._finished[0]:
                then_s, before = r._finished
                r.requests_per_s = max(0.0, finished - before) / (now_s - then_s)
            r._finished = (now_s, finished)
        return merge_metrics([text for _, text in answered])

    async def requests_on(self, url: str) -> list[dict[str, Any]]:
        """Every replica's requests on `url`, their ids tagged with their replica."""
        out: list[dict[str, Any]] = []
        for r, reqs in await self._each(lambda c: c.requests_on(url)):
            for req in reqs:
                out.append({**req, "id": fleet_request_id(int(req["id"]), r.index)})
        return out

    async def demand(self, models: Sequence[str], wait_s: float) -> dict[str, int]:
        """Requests queued for `models` over the replicas, as soon as one has any (or after
        `wait_s` with none anywhere)."""
        targets = [r for r in self.replicas if r.up] or self.replicas
        tasks = {asyncio.ensure_future(r.client.demand(models, wait_s)): r for r in targets}
        queued: dict[str, int] = {}
        failures: list[GatewayError] = []
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    exc = task.exception()
                    if isinstance(exc, GatewayError):
                        self._failed(tasks[task], exc)
                        failures.append(exc)
                        continue
                    if exc is not None:
                        raise exc
                    self._answered(tasks[task])
                    for model, n in task.result().items():
                        queued[model] = queued.get(model, 0) + n
                if any(n > 0 for n in queued.values()):
                    break
        finally:
            for task in pending:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*pending, return_exceptions=True)
        if failures and len(failures) == len(tasks):
            raise failures[0]
        return queued

    # ------------------------------------------------------------------ commands
    async def add(
        self,
        url: str,
        model: str,
        max_num_seqs: int = 0,
        admin_token: str | None = None,
        api_key: str | None = None,
        state: str = "active",
    ) -> dict[str, Any]:
        url = url.rstrip("/")
        self.intent.registered(Registration(url, model, max_num_seqs, state, admin_token, api_key))

        async def add(c: GatewayClient) -> dict[str, Any]:
            try:
                return await c.add(url, model, max_num_seqs, admin_token, api_key, state)
            except GatewayError as exc:
                if exc.status == 400 and _ALREADY in str(exc):  # its state: the catch-up's
                    return {"url": url, "model": model, "state": state}
                raise

        return (await self._each(add))[0][1]

    async def set_state(self, url: str, state: str) -> None:
        self.intent.set_state(url, state)
        await self._each(lambda c: c.set_state(url, state))

    async def set_weight(self, url: str, weight: float) -> None:
        self.intent.set_weight(url, weight)
        await self._each(lambda c: c.set_weight(url, weight))

    async def remove(self, url: str) -> None:
        self.intent.remove(url)
        await self._each(lambda c: c.remove(url))

    async def drain(self, url: str, wait_s: float = 0.0) -> bool:
        """Every replica up stops routing to `url` and waits for its own requests there;
        drained when every one that answered is empty."""
        self.intent.set_state(url, "draining")
        answered = await self._each(lambda c: c.drain(url, wait_s), wait_all=True)
        return all(ok for _, ok in answered)

    async def move(self, moves: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each move to the replica that holds its stream (its id says which), together."""
        by_replica: dict[int, list[dict[str, Any]]] = {}
        for m in moves:
            local, index = local_request_id(int(m["id"]))
            by_replica.setdefault(index, []).append({**m, "id": local})
        groups = [(self.replicas[i], ms) for i, ms in by_replica.items() if i < len(self.replicas)]
        results = await asyncio.gather(
            *(r.client.move(ms) for r, ms in groups), return_exceptions=True
        )
        out: list[dict[str, Any]] = []
        failures: list[GatewayError] = []
        for (r, ms), result in zip(groups, results, strict=True):
            if isinstance(result, GatewayError):
                self._failed(r, result)
                failures.append(result)
                log.warning("moves on gateway %s: %s", r.url, result)
                # its streams are its own: continued there when their engine stops
                out += [
                    {"id": fleet_request_id(m["id"], r.index), "outcome": "not_running"} for m in ms
                ]
                continue
            if isinstance(result, BaseException):
                raise result
            self._answered(r)
            out += [{**x, "id": fleet_request_id(int(x["id"]), r.index)} for x in result]
        if groups and len(failures) == len(groups):
            raise failures[0]
        return out

    async def hold(self, model: str, seconds: float) -> None:
        self.intent.hold(model, seconds, self.wall())
        await self._each(lambda c: c.hold(model, seconds))

    async def refuse(self, model: str, reason: str, seconds: float) -> None:
        self.intent.refuse(model, reason, seconds, self.wall())
        await self._each(lambda c: c.refuse(model, reason, seconds))

    # ------------------------------------------------------------------ catch-up
    def _maybe_catch_up(self, r: Replica) -> None:
        if r.catching_up is not None and not r.catching_up.done():
            return
        self.intent.expire(self.wall())
        if not r.missed and not differences(self.intent, r.pool):
            return
        r.catching_up = asyncio.ensure_future(self._catch_up(r))

    async def _catch_up(self, r: Replica) -> None:
        """Bring `r` to the intent, step by step, from a read of its pool. A command sent
        meanwhile (the intent's version moved) stops the steps: they start again from a
        fresh read (three times at most; then the next tick's read). A failure leaves it
        for the next read."""
        try:
            for _ in range(3):
                version = self.intent.version
                pool = await r.client.instances()
                steps = catch_up(self.intent, pool, self.wall(), standby=r.missed)
                for step in steps:
                    if self.intent.version != version:
                        break
                    await self._send(r.client, step)
                if self.intent.version != version:
                    continue
                r.pool = await r.client.instances() if steps else pool
                r.missed = False
                if steps:
                    r.num_catch_ups += 1
                    self.say(f"controller: gateway {r.url} caught up ({len(steps)} command(s))")
                return
        except GatewayError as exc:
            self._failed(r, exc)

    async def _send(self, client: GatewayClient, step: Step) -> None:
        match step:
            case AddInstance(reg, state):
                try:
                    await client.add(
                        reg.url, reg.model, reg.max_num_seqs, reg.admin_token, reg.api_key, state
                    )
                except GatewayError as exc:
                    if not (exc.status == 400 and _ALREADY in str(exc)):
                        raise
            case SetState(url, state):
                await client.set_state(url, state)
            case SetWeight(url, weight):
                await client.set_weight(url, weight)
            case RemoveInstance(url):
                with contextlib.suppress(GatewayError):  # gone there already
                    await client.remove(url)
            case SendHold(model, seconds):
                await client.hold(model, seconds)
            case SendRefusal(model, reason, seconds):
                await client.refuse(model, reason, seconds)

    # ------------------------------------------------------------------ the fleet's view
    def view(self) -> list[dict[str, Any]]:
        """Each replica as `GET /admin/status` shows it: URL, up, in flight, requests/s, and
        whether its pool is the controller's (`pool`: "in sync", "catching up" or "stale: ...")."""
        now_s = self.wall()
        out = []
        for r in self.replicas:
            diff = differences(self.intent, r.pool) if r.seen_at_s is not None else []
            if not r.up or r.seen_at_s is None:
                pool = "unknown"
            elif r.catching_up is not None and not r.catching_up.done():
                pool = "catching up"
            elif diff or r.missed:
                more = f"; and {len(diff) - 3} more" if len(diff) > 3 else ""
                pool = "stale: " + "; ".join(diff[:3] or ["missed a command"]) + more
            else:
                pool = "in sync"
            out.append(
                {
                    "url": r.url,
                    "up": r.up,
                    "error": r.error,
                    "seen_s_ago": None if r.seen_at_s is None else max(0.0, now_s - r.seen_at_s),
                    "num_in_flight": r.num_in_flight if r.up else None,
                    "requests_per_s": r.requests_per_s if r.up else None,
                    "num_instances": len(r.pool) if r.up else None,
                    "pool": pool,
                    "num_catch_ups": r.num_catch_ups,
                }
            )
        return out


async def _stragglers(tasks: Collection[asyncio.Future[Any]], after_s: float | None) -> set[Any]:
    """Wait for `tasks`; those still running `after_s` after the first one that succeeded are
    cancelled and returned (None: wait for all)."""
    loop = asyncio.get_running_loop()
    pending = set(tasks)
    first_ok_at: float | None = None
    try:
        while pending:
            timeout = None
            if after_s is not None and first_ok_at is not None:
                timeout = max(0.0, first_ok_at + after_s - loop.time())
            done, pending = await asyncio.wait(
                pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                break
            if first_ok_at is None and any(t.exception() is None for t in done):
                first_ok_at = loop.time()
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return pending


def fleet_view(gateway: object) -> list[dict[str, Any]] | None:
    """`GatewayFleet.view()` of a fleet; None for a lone gateway client."""
    return gateway.view() if isinstance(gateway, GatewayFleet) else None


def deployment_of(store: Store | None, configured: str | None, urls: Sequence[str]) -> str:
    """The deployment id of a controller serving `urls` (`choose_deployment`, with what the
    store recorded); `keep_replicas` records the replicas once the lease is ours."""
    if store is None:
        return choose_deployment(configured, urls, {}, ())
    replicas = GatewayReplicas(store)
    return choose_deployment(configured, urls, replicas.fleets(), replicas.known(urls))


def keep_replicas(store: Store | None, deployment: str, urls: Sequence[str]) -> None:
    """Record `urls` as the replicas of `deployment` (a later start with one more or fewer
    finds its deployment by them)."""
    if store is not None:
        GatewayReplicas(store).save(deployment, [u.rstrip("/") for u in urls])
