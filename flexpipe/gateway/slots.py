"""The gateway's instance slots: the router's pick and what admission makes of it (a place in
the wait queue while every instance is at its limit, woken as slots free; holds and refusals
of a model), and each slot's accounting (`_acquire` and its one `finish`, the passive health
signals). `Slots` is a part of `Gateway` (app.py), which sets the fields declared here; the
pure decisions are gateway/core's (admission, wait_queue, holds, deadline, router).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

from flexpipe.gateway.call import Call
from flexpipe.gateway.config import GatewayConfig
from flexpipe.gateway.core.admission import Decision, Fail, Queue, Route, admit
from flexpipe.gateway.core.deadline import Deadlines
from flexpipe.gateway.core.holds import Holds
from flexpipe.gateway.core.pool import Instance
from flexpipe.gateway.core.router import NoInstance, Router
from flexpipe.gateway.core.wait_queue import Rank, WaitQueue
from flexpipe.gateway.gateway_metrics import GatewayMetrics
from flexpipe.gateway.retry_later import RetryLater
from flexpipe.gateway.shared_state import SharedState
from flexpipe.gateway.signal import Signal
from flexpipe.http.server import HttpError

log = logging.getLogger("flexpipe.gateway")

__all__ = ["Slots"]


def _waits_for_a_slot(decision: Decision) -> bool:
    """The request found its model served (or held) and took no slot: it queues, or its
    queue's wait is over."""
    return isinstance(decision, Queue) or (isinstance(decision, Fail) and decision.busy)


class Slots:
    """Picking an instance, waiting for a slot, and giving slots back (`Gateway`'s fields)."""

    cfg: GatewayConfig
    clock: Callable[[], float]
    shared: SharedState | None
    router: Router
    metrics: GatewayMetrics
    holds: Holds
    deadlines: Deadlines | None
    queued_signal: Signal
    ended_signal: Signal
    _waiters: WaitQueue[asyncio.Future[None]]
    _shares_prefixes: bool
    _grace_over: bool

    async def _pick(self, call: Call) -> Instance:
        """The router's pick, and what admission makes of it (gateway/core/admission.py):
        while every instance is at its limit, a place in a bounded FIFO queue until a slot
        frees (or 429 when the queue is full or the wait too long); with `admission`
        configured, a place by slack and a 429 when it cannot meet its TTFT SLO."""
        own_deadline: float | None = None  # the queue's own wait, from the first refusal
        ticket: int | None = None  # its place in its model's line, from when it first queued
        rank: Rank = ()  # and its rank there (deadline-aware order; fcfs: none)
        woken = False  # by a freed slot (not its wait's end)
        cfg = self.cfg
        deadlines = self.deadlines
        tenant: str | None = None  # (its name: the fair share's key)
        if deadlines is not None and call.tenant is not None:
            tenant = call.tenant.name
        while True:
            if self._grace_over:
                raise HttpError(503, "the gateway is shutting down")
            now = self.clock()
            prefer = call.move.target if call.move is not None else None
            no_instance: str | None = None
            try:
                pick = self.router.pick(
                    call.model, call.routing, now, call.excluded, call.failed, prefer
                )
            except NoInstance as exc:
                pick, no_instance = None, str(exc)
            shed = None
            if deadlines is not None:
                if ticket is None:
                    rank = deadlines.rank(call.model, call.t0, tenant, now)
                shed = deadlines.shed_in(self._waiters, call.model, call.t0, ticket, rank, now)
            decision = admit(
                call.model,
                pick is not None,
                no_instance,
                self.holds,
                now,
                call.t0,
                own_deadline,
                len(self._waiters),
                self._waiters.count(call.model),
                cfg.max_queue,
                cfg.max_queue_wait_s,
                jumps_line=prefer is not None,
                shed=shed,
            )
            shed_now = isinstance(decision, Fail) and decision.shed
            if woken and (call.excluded or call.failed or shed_now) and _waits_for_a_slot(decision):
                # woken for a slot on an instance it may not use (one it left or failed on),
                # or shed: the slot goes to the next waiter of its model
                self._wake_one(call.model, after=ticket or 0, rank=rank)
            woken = False
            if isinstance(decision, Fail):
                raise self._refusal(decision, now)
            if isinstance(decision, Route):
                assert pick is not None
                if deadlines is not None:
                    deadlines.served(tenant, now)
                self.metrics.decision(self.router.policy.name, pick.reason)
                if pick.num_blocks:
                    self.metrics.prefix_all.inc(pick.num_blocks)
                    self.metrics.prefix_matched.inc(pick.num_blocks_matched)
                    if self._shares_prefixes and self.shared is not None:
                        self.shared.share_prefix(pick.instance.url, call.routing.block_hashes)
                return pick.instance
            own_deadline = decision.own_deadline_s
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if ticket is None:
                ticket = self._waiters.ticket()
            self._waiters.push(call.model, fut, ticket, rank)
            self.queued_signal.notify()
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation
                # that comes as the future completes, and the client's leaving is lost
                async with asyncio.timeout(decision.deadline_s - now):
                    await fut
                woken = True
            except TimeoutError:
                # woken in the pass its wait ended (the timeout won): still woken, so a
                # slot it may not use goes on to the next waiter, not lost with it
                woken = fut.done() and not fut.cancelled()
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    # woken as it left: the freed slot goes to the next one
                    self._wake_one(call.model)
                raise
            finally:
                self._waiters.remove(call.model, fut)

    def _refusal(self, fail: Fail, now: float) -> HttpError:
        """The client's answer to an admission's `Fail`, counted by its reason."""
        self.metrics.rejected.labels(fail.reason).inc()
        if fail.busy:  # Retry-After: the queue ahead at the measured drain rate
            wait_s = self.router.retry_after_s(len(self._waiters), now)
            return RetryLater(fail.status, fail.message, wait_s, fail.param)
        if fail.retry_after_s is not None:
            return RetryLater(fail.status, fail.message, fail.retry_after_s, fail.param)
        return HttpError(fail.status, fail.message, param=fail.param)

    def held(self, model: str) -> bool:
        """A hold is on for `model` (POST /admin/models/hold): its requests wait in the queue
        for capacity, even while it has no instance at all (scaled to zero)."""
        return self.holds.held(model, self.clock())

    def refused(self, model: str) -> str | None:
        """Why `model` is refused (POST /admin/models/refuse): no GPU free to us can place
        it, so while it has no instance its requests get a 503 with this reason."""
        return self.holds.refused(model, self.clock())

    async def demand(self, models: Collection[str], timeout_s: float) -> dict[str, int]:
        """Requests queued for `models`, as soon as one queues (the demand trigger)."""
        return await self.queued_signal.wait_for(
            lambda: {m: n for m in models if (n := self._waiters.count(m))}, timeout_s
        )

    def set_hold(self, model: str, seconds: float) -> None:
        """`POST /admin/models/hold`; one that ends wakes the queue (`Holds.wait_deadline`)."""
        self.holds.hold(model, seconds, self.clock())
        if seconds <= 0:
            self._wake_all()

    def set_refuse(self, model: str, reason: str, seconds: float) -> None:
        """`POST /admin/models/refuse`; the queue looks again, so what waited for `model`
        gets the 503 at once (renewed every tick, its words may change: only a model not
        refused before wakes it)."""
        new = self.refused(model) is None
        self.holds.refuse(model, reason, seconds, self.clock())
        if new:
            self._wake_all()

    def _wake_one(self, model: str, after: int = 0, rank: Rank = ()) -> None:
        """A slot of `model` freed: its first waiter not woken yet (placed after ticket
        `after` at `rank`) looks again; it leaves the line itself, as it resumes."""
        for fut in self._waiters.line(model, after, rank):
            if not fut.done():
                fut.set_result(None)
                return

    def _wake_all(self) -> None:
        """The pool changed (an instance joined, came back, got more weight): every waiter
        looks again, as many may fit now (a higher-priority model's line first, when the
        order is by slack)."""
        priority = self.deadlines.priority if self.deadlines is not None else None
        for fut in self._waiters.waiters(priority):
            if not fut.done():
                fut.set_result(None)

    def queued_by_model(self) -> dict[str, int]:
        """The wait queue by model (`flexpipe_model_queued_requests`; the demand trigger)."""
        return self._waiters.counts()

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the queue for a free instance."""
        return len(self._waiters)

    @property
    def mean_request_tokens(self) -> float:
        return self.router.mean_request_tokens

    def _acquire(self, inst: Instance, call: Call) -> None:
        self.router.acquire(inst, call.num_tokens)
        call.instance = inst.url

    def finish(self, inst: Instance, call: Call, status: str) -> None:
        """`inst` no longer counts `call` (each `_acquire` has exactly one `finish`)."""
        now = self.clock()
        self.router.finish(inst, call.num_tokens, now)
        if call.instance == inst.url:
            call.instance = None
        self.metrics.request_done(call.model, inst.url, status)
        if self.deadlines is not None:
            self.deadlines.finished(call.model, now)
        if status == "200":
            self.metrics.observe("e2e", call.model, now - call.t0)
        self._wake_one(call.model)
        self.ended_signal.notify()  # someone may wait for an instance to drain

    def success(self, inst: Instance) -> None:
        self.router.succeeded(inst)

    def failure(self, inst: Instance) -> None:
        """A passive signal (connect error, timeout, broken stream)."""
        if self.router.failed(inst, self.clock()):
            self._ejected(inst)

    def eject(self, inst: Instance) -> None:
        self.router.eject(inst, self.clock())
        self._ejected(inst)

    def _ejected(self, inst: Instance) -> None:
        self.metrics.ejections.labels(inst.url).inc()
        log.warning("ejected %s for %.1f s", inst.url, inst.backoff_s)
