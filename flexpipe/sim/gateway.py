"""The gateway on the virtual clock: the live gateway's `Router` and `Pool`, its wait queue,
its metrics scrape and its measured decode speed, without HTTP.

A request is routed when it arrives (`Router.pick`), and what becomes of it is the live
gateway's admission decision (gateway/core/admission.py `admit`, which `Gateway._pick` asks
too): routed; queued in its model's FIFO line (at most `max_queue`, at most
`max_queue_wait_s`, a hold's wait), each freed slot waking the oldest waiter; or failed with
the live gateway's status and words (the 404 / 503 of a model with no instance). The engine's
400 for a context that does not fit fails it too. Network time is not modelled. With the
scenario's `gateway: {admission: ...}`, lines are ordered by slack and late requests shed as
live (gateway/core/deadline.py); a shed request ends as failed with `SHED_PREFIX`, which the
report counts apart.

The scrape writes what the engine's /metrics reports into the routing record with the
prober's own `apply_engine_metrics` (counts, queued tokens, and the capacity the engine
reports, which caps the requests in flight at max_num_seqs plus a small allowance, as live);
a finished stream updates the instance's measured speed with `Instance.observe_tpot`, as
`Gateway.stream_done` does. An instance joins the pool with its gear's max_num_seqs, as the
controller registers it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from flexpipe.engine.request import EngineRequest
from flexpipe.gateway.config import GatewayConfig
from flexpipe.gateway.core.admission import ROUTE, Fail, Queue, admit, is_served, num_prompt_tokens
from flexpipe.gateway.core.deadline import Deadlines
from flexpipe.gateway.core.engine_metrics import apply_engine_metrics
from flexpipe.gateway.core.holds import Holds
from flexpipe.gateway.core.pool import Instance, Pool, stream_tpot_s
from flexpipe.gateway.core.router import NoInstance, Router
from flexpipe.gateway.core.wait_queue import Rank, WaitQueue
from flexpipe.lifecycle import State
from flexpipe.policies.routing import RoutingRequest
from flexpipe.sim.instance import SimInstance
from flexpipe.sim.loop import ARRIVAL, SCRAPE, EventLoop
from flexpipe.sim.request import SimRequest

Ended = Callable[[SimRequest], None]

# Where a simulated outcome's words differ from the client's (`Fail.message`): the
# simulator's recorded outcomes (tests, fingerprints of past runs) keep their wording.
_SIM_WORDS = {"queue_full": "all instances are busy and the queue is full"}
SHED_PREFIX = "shed: "  # a shed request's `failed` starts so (report.py counts them apart)


@dataclass(slots=True)
class _Call:
    req: SimRequest
    routing: RoutingRequest
    num_tokens: float  # prompt + expected output, the router's load unit
    deadline_s: float = -1.0
    instance: Instance | None = None
    queued: bool = False
    ticket: int = -1  # its place in its model's wait line, from when it first queued
    timeout_s: float = -1.0  # when its queue timeout is scheduled (a hold may extend it)
    rank: Rank = ()  # its rank in its model's line (deadline-aware order; fcfs: none)


class SimGateway:
    def __init__(
        self, cfg: GatewayConfig, loop: EventLoop, rng: random.Random, on_end: Ended
    ) -> None:
        self.cfg = cfg
        self.loop = loop
        self.pool = Pool(cfg.max_concurrency_per_instance)
        self.router = Router(cfg, self.pool, rng)
        self.on_end = on_end
        self.instances: dict[str, SimInstance] = {}  # url -> engine
        self._calls: dict[int, _Call] = {}  # request id -> call in flight
        self._waiters = WaitQueue[_Call]()  # requests waiting for a slot (wait_queue.py)
        self.num_queued_total = 0
        self._scraping = False
        self.log: list[tuple[float, str, str]] | None = None  # (time, event, detail) if kept
        self.holds = Holds()  # the admin API's holds (flexpipe.gateway.core.holds, as live)
        # deadline-aware order and shedding, when configured (as `Gateway.deadlines`)
        self.deadlines = Deadlines(cfg.admission) if cfg.admission.enabled else None

    def _log(self, now: float, event: str, detail: str) -> None:
        if self.log is not None:
            self.log.append((now, event, detail))

    # --- instances -----------------------------------------------------------------------
    def add_instance(
        self, inst: SimInstance, now: float, max_num_seqs: int = 0, state: State = State.ACTIVE
    ) -> None:
        """The engine answers /health: into the pool (scraped first, as the prober does).
        `max_num_seqs`: what the controller registers it with (its slots derive from it);
        `state`: starting for one the controller is still bringing up (not routed)."""
        self.instances[inst.url] = inst
        self._log(now, "ready", inst.dep.name)
        record = self.pool.add(
            inst.url,
            model=inst.model,
            max_num_seqs=max_num_seqs or inst.max_num_seqs,
            state=state,
        )
        self._scrape_one(record, now)
        if not self._scraping:
            self._scraping = True
            self.loop.at(now + self.cfg.scrape_interval_s, SCRAPE, self._scrape)
        if state is State.ACTIVE:  # as live (`Gateway._wake_all`): every waiter looks again
            self._reroute(now)

    def drain_instance(self, url: str) -> None:
        self.pool.drain(url)

    def set_state(self, url: str, state: State, now: float) -> None:
        """The admin API's change of state (`Pool.set_state`); one that became active may
        take a waiting request."""
        self.pool.set_state(url, state)
        if state is State.ACTIVE:  # as live (`Gateway._wake_all`): every waiter looks again
            self._reroute(now)

    def hold(self, model: str, seconds: float, now: float) -> None:
        """`POST /admin/models/hold`: `model`'s requests wait for capacity, even with no
        instance; 0 ends the hold."""
        self.holds.hold(model, seconds, now)
        if seconds <= 0:  # as `Gateway.set_hold`: the queue looks again, in its order
            self._reroute(now)

    def refuse(self, model: str, reason: str, seconds: float, now: float) -> None:
        """`POST /admin/models/refuse`: no GPU free to us can place `model`; while it has no
        instance its requests (those queued too, at once) fail with a 503 and `reason`."""
        new = self.holds.refused(model, now) is None
        self.holds.refuse(model, reason, seconds, now)
        if new:  # (renewed every tick, its words may change: only a new one re-routes)
            self._reroute(now)

    def _reroute(self, now: float) -> None:
        priority = self.deadlines.priority if self.deadlines is not None else None
        for call in self._waiters.pop_all(priority):
            call.queued = False
            self._route(call, now)

    def remove_instance(self, url: str) -> None:
        """Out of the pool (the admin API's removal: the pool, then what routing kept)."""
        self.pool.remove(url)
        self.router.remove_instance(url)

    # --- requests ------------------------------------------------------------------------
    def submit(self, req: SimRequest, now: float) -> None:
        if self.log is not None:  # (the detail costs a format per request)
            self._log(now, "arrive", f"{req.request_id} {req.model}")
        if not is_served(req.model, self.pool.has_model(req.model), self.holds, now):
            self._fail(req, now, f"404: no instance serves model {req.model!r} (yet)")
            return
        num_prompt = num_prompt_tokens(req.num_prompt_bytes)
        num_out = req.num_output_tokens
        # (= prompt_block_hashes(req.prompt_bytes(), ...), the live gateway's, without the bytes)
        routing = RoutingRequest(num_prompt, num_out, req.prompt_block_hashes(self.cfg.block_chars))
        call = _Call(req, routing, float(num_prompt + num_out))
        self._route(call, now)

    def _route(self, call: _Call, now: float) -> None:
        """The router's pick, and what admission makes of it (gateway/core/admission.py, as
        `Gateway._pick`): route, queue until the deadline (a timeout event), or fail."""
        model = call.req.model
        no_instance: str | None = None
        try:
            pick = self.router.pick(model, call.routing, now)
        except NoInstance as exc:
            pick, no_instance = None, str(exc)
        waiters = self._waiters
        cfg = self.cfg
        deadlines = self.deadlines
        shed = None
        if deadlines is not None:
            arrival_s = call.req.arrival_s
            if call.ticket < 0:
                call.rank = deadlines.rank(model, arrival_s, None, now)
            ticket = call.ticket if call.ticket >= 0 else None
            shed = deadlines.shed_in(waiters, model, arrival_s, ticket, call.rank, now)
        decision = admit(
            model,
            pick is not None,
            no_instance,
            self.holds,
            now,
            call.req.arrival_s,
            call.deadline_s if call.deadline_s >= 0 else None,
            len(waiters),
            waiters.count(model),
            cfg.max_queue,
            cfg.max_queue_wait_s,
            shed=shed,
        )
        if decision is not ROUTE:
            if isinstance(decision, Fail) and decision.shed:
                self._fail(call.req, now, SHED_PREFIX + decision.message)
                return
            if isinstance(decision, Fail):
                message = _SIM_WORDS.get(decision.reason, decision.message)
                self._fail(call.req, now, f"{decision.status}: {message}")
                return
            assert isinstance(decision, Queue)
            if call.deadline_s < 0:
                call.deadline_s = decision.own_deadline_s
                self.num_queued_total += 1
            deadline = decision.deadline_s
            if call.timeout_s != deadline:
                call.timeout_s = deadline
                self.loop.at(deadline, ARRIVAL, lambda t: self._timeout(call, t))
            call.queued = True
            if call.ticket < 0:
                call.ticket = waiters.ticket()
            waiters.push(model, call, call.ticket, call.rank)
            self._log(now, "queue", str(call.req.request_id))
            return
        assert pick is not None
        inst = pick.instance
        engine = self.instances[inst.url]
        self.router.acquire(inst, call.num_tokens)
        call.instance = inst
        call.req.instance = engine.dep.name
        refusal = engine.refusal(call.req)
        if refusal:
            self.router.finish(inst, call.num_tokens, now)
            self.router.succeeded(inst)
            self._fail(call.req, now, refusal)
            self._finished(model, now)
            self._wake(model, now)
            return
        self._calls[call.req.request_id] = call
        if self.log is not None:  # (the detail costs a format per request)
            self._log(now, "route", f"{call.req.request_id} {engine.dep.name} {pick.reason}")
        engine.submit(call.req, now)

    def detach(self, req: SimRequest, now: float) -> None:
        """`req` leaves its instance (moved, or the engine died): slot and load released."""
        call = self._calls.pop(req.request_id)
        assert call.instance is not None
        self.router.finish(call.instance, call.num_tokens, now)
        self._finished(req.model, now)
        self._wake(req.model, now)

    def place(self, req: SimRequest, url: str, now: float) -> None:
        """A moved request goes to the engine at `url` (the move names its target)."""
        engine = self.instances[url]
        record = self.pool.instances[url]
        num_tokens = float(req.num_prompt_tokens + req.num_output_tokens)
        routing = RoutingRequest(req.num_prompt_tokens, req.num_output_tokens, ())
        call = _Call(req, routing, num_tokens, instance=record)
        self.router.acquire(record, call.num_tokens)
        req.instance = engine.dep.name
        self._calls[req.request_id] = call
        self._log(now, "place", f"{req.request_id} {engine.dep.name}")
        engine.submit(req, now)

    def _timeout(self, call: _Call, now: float) -> None:
        if not call.queued:
            return
        call.queued = False
        self._waiters.remove(call.req.model, call)
        self._route(call, now)

    def _wake(self, model: str, now: float) -> None:
        """A slot of `model` may have freed: its oldest waiter tries again
        (`Gateway._wake_one`)."""
        while (call := self._waiters.pop_first(model)) is not None:
            call.queued = False
            self._route(call, now)
            if not call.req.failed.startswith(SHED_PREFIX):
                return  # (shed instead: the slot goes to the next waiter, as live)

    def done(self, engine: SimInstance, req: SimRequest, ereq: EngineRequest, now: float) -> None:
        """The engine finished `req` at `now` (a full response, or the engine's error)."""
        call = self._calls.pop(req.request_id)
        inst = call.instance
        assert inst is not None
        self.router.finish(inst, call.num_tokens, now)
        req.num_generated_tokens = ereq.num_output_tokens
        req.num_cached_tokens = ereq.num_cached_tokens
        req.num_preemptions = ereq.num_preemptions
        if ereq.finish_reason == "error":
            self._fail(req, now, f"engine error: {ereq.error}")
        else:
            req.first_token_s = ereq.first_token_s
            req.last_token_s = ereq.last_token_s
            req.finish_s = now
            n = ereq.num_output_tokens
            tpot = stream_tpot_s(n, req.first_token_s, req.last_token_s)
            if tpot is not None:  # as Gateway.stream_done
                inst.observe_tpot(tpot)
            self.router.succeeded(inst)
            if self.log is not None:  # (the detail costs a format per request)
                self._log(now, "done", f"{req.request_id} {n} tokens")
            self.on_end(req)
        self._finished(req.model, now)
        self._wake(req.model, now)

    def _finished(self, model: str, now: float) -> None:
        """A request of `model` left its slot (the pace of its line, as `Gateway.finish`)."""
        if self.deadlines is not None:
            self.deadlines.finished(model, now)

    def _fail(self, req: SimRequest, now: float, why: str) -> None:
        req.failed = why
        req.finish_s = now
        self._log(now, "fail", f"{req.request_id} {why}")
        self.on_end(req)

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def queued_by_model(self) -> dict[str, int]:
        """The wait queue by model (the live gateway's `flexpipe_model_queued_requests`)."""
        return self._waiters.counts()

    # --- metrics scrape ------------------------------------------------------------------
    def _scrape(self, now: float) -> None:
        for record in self.pool.instances.values():
            self._scrape_one(record, now)
        if self.pool.instances:
            self.loop.at(now + self.cfg.scrape_interval_s, SCRAPE, self._scrape)
        else:
            self._scraping = False

    def _scrape_one(self, record: Instance, now: float) -> None:
        """`Prober.scrape`: the engine's counts into the routing record."""
        if not record.healthy:
            return
        values = self.instances[record.url].metrics(now)
        apply_engine_metrics(self.pool, record, values, self.router.mean_request_tokens, now)
