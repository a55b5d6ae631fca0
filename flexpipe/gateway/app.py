"""The gateway server: OpenAI-compatible proxy with routing, backpressure, retries and
mid-stream migration, plus /v1/models, /health, /metrics and the admin API.

Hot path, per request: one orjson parse of the body (model, prompt, stream), CRC-32 block
hashes of the prompt, one routing decision over plain snapshots, the original body bytes
forwarded unchanged on a pooled keep-alive connection, and the upstream's SSE bytes relayed
as they arrive, cut only at event boundaries (so a failure never leaves half an event at the
client). Streams are relayed by push (relay.py); events are parsed only when a stream has to
be continued elsewhere. Routing and load accounting are the synchronous `Router`'s
(router.py); the admin API is admin.py; moving a request between instances is moves.py. This
module is the I/O around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
from collections.abc import Callable, Collection
from typing import Any

from flexpipe.gateway import moves, peers
from flexpipe.gateway.admin import AdminApi
from flexpipe.gateway.body_parser import (
    PARSE_OFF_LOOP_BYTES,
    BodyParser,
    summarize,
    validate_body,
)
from flexpipe.gateway.call import Call, Move
from flexpipe.gateway.config import GatewayConfig
from flexpipe.gateway.control_ops import apply_op
from flexpipe.gateway.core.admission import (
    Decision,
    Fail,
    Queue,
    Route,
    admit,
    is_served,
)
from flexpipe.gateway.core.deadline import Deadlines
from flexpipe.gateway.core.holds import Holds
from flexpipe.gateway.core.pool import Instance, Pool, stream_tpot_s
from flexpipe.gateway.core.router import NoInstance, Router
from flexpipe.gateway.core.wait_queue import Rank, WaitQueue
from flexpipe.gateway.core.warm_up import WarmOutcome
from flexpipe.gateway.gateway_metrics import GatewayMetrics
from flexpipe.gateway.prober import Prober
from flexpipe.gateway.relay import PushRelay
from flexpipe.gateway.retry_later import RetryLater, retry_later
from flexpipe.gateway.shared_state import (
    ControlOp,
    SharedState,
    SharedStateDown,
    admit_shared,
    call_ids,
    reads_prefixes,
)
from flexpipe.gateway.signal import Signal
from flexpipe.gateway.tenants import Tenant, Tenants, completion_tokens
from flexpipe.gateway.ui_routes import UiRoutes
from flexpipe.http.client import ClientPool, Timeouts, UpstreamError, UpstreamResponse
from flexpipe.http.server import (
    App,
    HttpError,
    HttpServer,
    PushResponse,
    Request,
    Response,
    StreamResponse,
    error_response,
    json_response,
    serve,
)
from flexpipe.policies.routing import RoutingRequest
from flexpipe.protocol import (
    RequestError,
)

log = logging.getLogger("flexpipe.gateway")

_RETRY_STATUSES = (429, 503)
_ADMIN_BODY_BYTES = 1 << 20  # every route but the two that carry prompts
_DEAD = ("connect", "closed", "protocol")  # the instance failed before a response head
_JSON = "application/json"
_JSON_HEADERS = {"content-type": _JSON}  # upstream request headers (never mutated)


def _waits_for_a_slot(decision: Decision) -> bool:
    """The request found its model served (or held) and took no slot: it queues, or its
    queue's wait is over."""
    return isinstance(decision, Queue) or (isinstance(decision, Fail) and decision.busy)


class Gateway:
    def __init__(
        self,
        cfg: GatewayConfig,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedState | None = None,
        worker: tuple[int, int] = (0, 1),
    ) -> None:
        """`shared`: what this gateway shares with other workers or replicas (None: alone,
        no hop on any path); `worker`: (this worker's index, the number of workers on the
        host), which splits every instance's slots between them (pool.py `share_slots`)."""
        self.cfg = cfg
        self.clock = clock
        self.shared = shared
        self.pool = Pool(cfg.max_concurrency_per_instance, worker)
        self.router = Router(cfg, self.pool, random.Random(cfg.seed))
        # publish routing decisions' blocks only to a policy that reads the prefix index
        self._shares_prefixes = shared is not None and reads_prefixes(self.router.policy)
        self.client = ClientPool()
        self.metrics = GatewayMetrics()
        self.tenants = Tenants(cfg.tenants, clock())
        self.timeouts = Timeouts(cfg.connect_timeout_s, cfg.ttfb_timeout_s, cfg.idle_timeout_s)
        self._waiters = WaitQueue[asyncio.Future[None]]()  # requests waiting for a slot
        # deadline-aware order and shedding, when configured (gateway/core/deadline.py)
        self.deadlines = Deadlines(cfg.admission) if cfg.admission.enabled else None
        self.queued_signal = Signal(clock)  # a request queued (the demand trigger)
        self._tasks: set[asyncio.Task[None]] = set()  # failover relays in progress
        self._calls: dict[int, Call] = {}  # accepted, not yet ended, whatever their phase
        self._call_ids = call_ids(shared, worker)  # unique across workers and replicas
        self.engine_admin_tokens: dict[str, str] = {}  # instance url -> its admin token
        self._warm_ups_on: dict[str, int] = {}  # instance url -> moves' warm-ups sent there
        self.ended_signal = Signal(clock)  # a request ended (`drained`)
        # model -> clock time until which queued requests wait (a shift re-launching capacity)
        self.holds = Holds()
        self._relays: set[PushRelay] = set()  # streams being relayed by push
        self.shutting_down = False  # new requests are refused
        self._grace_over = False  # and, past the grace period, queued ones too
        self._idle: asyncio.Event | None = None  # set when the last call ends (shutdown)
        self.prober = Prober(self)
        self._parsers = BodyParser()  # validates large bodies off the event loop (`_parse`)
        self.server: HttpServer | None = None
        for b in cfg.backends:
            self.pool.add(b.url, b.model, b.weight, b.max_concurrency, b.api_key, b.max_num_seqs)
        self.pool.on_change(self._wake_all)
        self.ui = UiRoutes(self)  # the dashboard at /ui (docs/dashboard.md)
        self.app = self._build_app()

    # ---------------------------------------------------------------- lifecycle
    async def start(
        self, host: str | None = None, port: int | None = None, sock: socket.socket | None = None
    ) -> HttpServer:
        """Serve (on `sock` when given: a worker's SO_REUSEPORT socket), after joining the
        shared state, if any, and replaying its control log: a worker restarted later
        serves only once it sees the pool, holds and refusals the others see."""
        if self.shared is not None:
            log_ops = await self.shared.start(self._apply_op, self._learn_prefix, self._answer)
            for op in log_ops:
                apply_op(self, op)
        await self.prober.start()
        self.ui.start()
        self.server = await serve(
            self.app, host or self.cfg.host, self.cfg.port if port is None else port, sock
        )
        return self.server

    async def close(self) -> None:
        await self.prober.stop()
        await self.ui.stop()
        if self.server is not None:
            await self.server.close()
        await self.client.close()
        self._parsers.close()
        if self.shared is not None:
            await self.shared.close()

    # ---------------------------------------------------------------- shared state
    def publish(self, op: ControlOp) -> None:
        """An admin change made here reaches the other workers or replicas (control_ops.py)."""
        if self.shared is not None:
            self.shared.publish(op)

    def _apply_op(self, op: ControlOp) -> None:
        apply_op(self, op)

    def _learn_prefix(self, url: str, hashes: tuple[int, ...]) -> None:
        """Another member routed these blocks to `url`: this index learns it too."""
        if url in self.pool.instances:
            self.router.prefix_index.insert(url, hashes)

    async def _answer(self, kind: str, body: dict[str, Any]) -> Any:
        return await peers.answer(self, kind, body)

    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def forget_instance(self, url: str) -> None:
        """What routing and moves kept about an instance that left the pool."""
        self.router.remove_instance(url)
        self.engine_admin_tokens.pop(url, None)

    def _build_app(self) -> App:
        app = App(max_body_bytes=_ADMIN_BODY_BYTES, limits=self.cfg.http)
        body = self.cfg.max_body_bytes
        app.add_route("POST", "/v1/completions", self._completions, max_body_bytes=body)
        app.add_route("POST", "/v1/chat/completions", self._chat, max_body_bytes=body)
        app.add_route("GET", "/v1/models", self._models)
        app.add_route("GET", "/health", self._health)
        app.add_route("GET", "/metrics", self._metrics)
        AdminApi(self).add_routes(app)
        self.ui.add_routes(app)
        return app

    # ---------------------------------------------------------------- plain endpoints
    async def _models(self, req: Request) -> Response:
        del req
        held = self.holds.models(self.clock())  # scaled to zero: still served
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "flexpipe"}
            for m in sorted(set(self.pool.models()) | held)
        ]
        return json_response({"object": "list", "data": data})

    async def _health(self, req: Request) -> Response:
        del req
        up = any(i.routable for i in self.pool.instances.values())
        if up:
            return Response(b"")
        return error_response(503, "no healthy instance")

    async def _metrics(self, req: Request) -> Response:
        """This gateway's metrics; with workers or replicas, all of theirs summed (what the
        controller reads is the whole gateway's); `?scope=worker`: the answering one's own."""
        body = self.own_metrics()
        if self.shared is not None and req.query != "scope=worker":  # (one worker's own)
            others = await self.shared.ask_peers("metrics", {}, 2.0)
            body = peers.merge_expositions([body.decode(), *[t for t in others if t]])
        return Response(body, content_type="text/plain; version=0.0.4; charset=utf-8")

    def own_metrics(self) -> bytes:
        m = self.metrics
        if self.shared is not None:
            m.member.labels(self.shared.member, str(os.getpid())).set(1)
            m.shared_up.labels(self.shared.member).set(1 if self.shared.up else 0)
            m.shared_outages.labels(self.shared.member).set(self.shared.num_outages)
        m.queued.set(len(self._waiters))
        m.queued_by_model.clear()
        for model, num in self._waiters.counts().items():
            m.queued_by_model.labels(model).set(num)
        m.instance_up.clear()
        for inst in self.pool.instances.values():
            m.instance_up.labels(inst.url, inst.state.value).set(1 if inst.routable else 0)
            m.in_flight.labels(inst.url).set(inst.num_in_flight)
        return m.exposition()

    # ---------------------------------------------------------------- admin API
    # ---------------------------------------------------------------- the proxy
    async def _completions(self, req: Request) -> Response | StreamResponse | PushResponse:
        return await self._proxy(req, "/v1/completions", chat=False)

    async def _chat(self, req: Request) -> Response | StreamResponse | PushResponse:
        return await self._proxy(req, "/v1/chat/completions", chat=True)

    async def _parse(self, req: Request, path: str, chat: bool) -> Call:
        """Validate the body against the OpenAI schema (flexpipe.protocol: a 400 naming the
        offending field for any violation) and reduce it to what routing needs; a body over
        `PARSE_OFF_LOOP_BYTES` in a parser process (`body_parser`)."""
        content_type = req.headers.get("content-type")
        body: dict[str, Any] | None = None
        try:
            if len(req.body) > PARSE_OFF_LOOP_BYTES:
                summary = await self._parsers.summarize(
                    req.body, content_type, chat, self.cfg.block_chars
                )
            else:
                valid = validate_body(req.body, content_type, chat)
                summary, body = summarize(valid, self.cfg.block_chars), valid.body
        except RequestError as exc:
            raise HttpError(exc.status, exc.message, param=exc.param) from None
        model = summary.model
        if not is_served(model, self.pool.has_model(model), self.holds, self.clock()):
            raise HttpError(404, f"The model `{model}` does not exist.", param="model")
        num_prompt = summary.num_prompt_tokens
        num_out = summary.max_tokens or self.cfg.default_expected_output_tokens
        routing = RoutingRequest(num_prompt, num_out, summary.block_hashes, summary.user)
        return Call(
            path,
            chat,
            model,
            body,  # None: parsed from `raw` if a move needs it (`Call.body`)
            req.body,
            summary.stream,
            routing,
            float(num_prompt + num_out),
            self.clock(),
            None,
            num_prompt_tokens=num_prompt,
            include_usage=summary.include_usage,
        )

    async def _proxy(
        self, req: Request, path: str, chat: bool
    ) -> Response | StreamResponse | PushResponse:
        if self.shutting_down:
            self.metrics.rejected.labels("shutting_down").inc()
            raise HttpError(503, "the gateway is shutting down", type="ServiceUnavailableError")
        tenant = None
        if self.tenants.enabled:
            tenant = self.tenants.lookup(req.headers.get("authorization"))
            if tenant is None:
                self.metrics.rejected.labels("auth").inc()
                raise HttpError(401, "missing or unknown API key", type="AuthenticationError")
        call = await self._parse(req, path, chat)
        if tenant is not None:
            too_large = tenant.too_large(call.num_tokens)
            if too_large is not None:
                self.metrics.rejected.labels("tenant_quota").inc()
                raise HttpError(400, too_large, param="max_tokens")
            ok, wait_s, why = await self._admit_tenant(tenant, call.num_tokens)
            if not ok:
                self.metrics.rejected.labels("tenant_quota").inc()
                return retry_later(RetryLater(429, f"tenant {tenant.name}: {why}", wait_s))
            call.tenant = tenant
        call.id = next(self._call_ids)
        self._calls[call.id] = call
        handed_off = False
        try:
            result = await self._dispatch(call)
            handed_off = isinstance(result, StreamResponse | PushResponse)
            return result
        except RetryLater as exc:
            return retry_later(exc)
        finally:
            if not handed_off:  # a relay ends the call of a stream it was handed
                self.end_call(call, call.num_output_tokens)

    async def _admit_tenant(self, tenant: Tenant, num_tokens: float) -> tuple[bool, float, str]:
        """The tenant's budget, here or where the workers or replicas share it; a budget that
        cannot be decided is a 503, never a request let through (fail closed)."""
        if self.shared is None:
            ok, wait_s, why = tenant.admit(num_tokens, self.clock())
            if ok:
                tenant.num_in_flight += 1
            return ok, wait_s, why
        try:
            return await admit_shared(self.shared, tenant.id, num_tokens)
        except SharedStateDown:
            self.metrics.rejected.labels("shared_state_down").inc()
            raise HttpError(
                503, "tenant budgets are unavailable", type="ServiceUnavailableError"
            ) from None

    def end_call(self, call: Call, num_output_tokens: int | None = None) -> None:
        """Every accepted request ends here exactly once, whatever its exit: the tenant's
        slot and tokens are settled (`num_output_tokens` None: nothing was generated)."""
        if call.ended:
            return
        call.ended = True
        self._calls.pop(call.id, None)
        tenant = call.tenant
        if tenant is not None:
            used = 0 if num_output_tokens is None else call.num_prompt_tokens + num_output_tokens
            if self.shared is None:
                tenant.num_in_flight -= 1
                tenant.settle(call.num_tokens, used, self.clock())
            else:
                self.shared.tenant_end(tenant.id, call.num_tokens, used)
        if not self._calls and self._idle is not None:
            self._idle.set()

    @property
    def num_active_calls(self) -> int:
        """Requests accepted and not yet ended (queued, in flight or streaming)."""
        return len(self._calls)

    async def _send_movable(self, call: Call) -> tuple[Instance, UpstreamResponse]:
        """`send`, which the controller may interrupt to move the request while the engine
        has not answered yet (a non-streamed request, a stream still queued): it is then sent
        again, to the move's target. The move cancels this request's own task (`call.sending`,
        `moves.move_request`), not a task per send: a cancellation the move asked for is taken
        back here (`uncancel`), and one that remains (the client left, the gateway is
        stopping) goes on as before."""
        task = asyncio.current_task()
        assert task is not None
        while True:
            call.sending = task
            try:
                return await self.send(call, call.raw)
            except asyncio.CancelledError:
                if not call.move_cancels:
                    raise
                call.move_cancels = False
                if task.uncancel() > 0:
                    raise  # the client left too (or the gateway is stopping)
                call.moved_by.append("rerun")
                self.metrics.migrations.labels("moved").inc()
            finally:
                call.sending = None
                call.move_cancels = False

    async def _dispatch(self, call: Call) -> Response | StreamResponse | PushResponse:
        while True:
            inst, resp = await self._send_movable(call)
            call.move = None  # carried out: later breaks are failures again
            call.upstream_request_id = resp.headers.get("x-request-id")
            call.first_request_id = call.first_request_id or call.upstream_request_id
            if call.stream and resp.status == 200:
                return PushResponse(
                    PushRelay(self, call, inst, resp).start,
                    content_type=resp.headers.get("content-type", "text/event-stream"),
                    headers={"x-flexpipe-instance": inst.url},
                )
            call.upstream = resp
            try:
                body = await resp.read()
            except UpstreamError as exc:
                # Nothing has reached the client yet: run it again on another instance.
                self.finish(inst, call, exc.kind)
                call.failed.add(inst.url)
                if self.shutting_down:
                    raise HttpError(503, "the gateway is shutting down") from None
                if call.move is not None:  # the controller moved it: re-run on the target
                    call.moved_by.append("rerun")
                    self.metrics.migrations.labels("moved").inc()
                    continue
                self.failure(inst)
                if exc.kind == "idle" or call.num_migrations >= self.cfg.max_migrations:
                    self.metrics.migrations.labels("failed").inc()
                    raise HttpError(502, f"upstream failed mid-response: {exc.kind}") from None
                call.num_migrations += 1
                self.metrics.migrations.labels("ok").inc()
                log.info("re-running a request that failed on %s", inst.url)
                continue
            except BaseException:  # cancelled: the client left; abort the engine's work
                self.finish(inst, call, "cancelled")
                raise
            finally:
                call.upstream = None
                resp.release()
            break
        self.finish(inst, call, str(resp.status))
        if resp.status < 500:
            self.success(inst)
        if call.tenant is not None and resp.status == 200:
            call.num_output_tokens = completion_tokens(body)
        return Response(
            body,
            resp.status,
            resp.headers.get("content-type", _JSON),
            {"x-flexpipe-instance": inst.url},
        )

    async def send(
        self, call: Call, raw: bytes, path: str | None = None, admin: bool = False
    ) -> tuple[Instance, UpstreamResponse]:
        """Route and send. An instance that cannot be reached, or closes the connection
        before its response head, is never tried again for this call and the next live one
        is (nothing has reached the client yet), up to `max_failovers` instances; 429 and 503
        are retried once with jitter."""
        while True:
            inst = await self._pick(call)
            self._acquire(inst, call)
            headers = _JSON_HEADERS
            token = self.engine_admin_tokens.get(inst.url) if admin else inst.api_key
            if token:
                headers = {**_JSON_HEADERS, "authorization": f"Bearer {token}"}
            try:
                resp = await self.client.request(
                    inst.url, "POST", path or call.path, raw, headers, self.timeouts
                )
            except UpstreamError as exc:
                self.finish(inst, call, exc.kind)
                self.failure(inst)
                call.failed.add(inst.url)
                if exc.kind in _DEAD:
                    self.client.drop_backend(inst.url)  # its idle connections are stale too
                    if len(call.failed) <= self.cfg.max_failovers:
                        self.metrics.retries.labels(exc.kind).inc()
                        continue
                status = 504 if exc.kind == "ttfb" else 502
                raise HttpError(status, f"upstream {exc}") from None
            except BaseException:  # cancelled (the client left): release the slot
                self.finish(inst, call, "cancelled")
                raise
            if resp.status in _RETRY_STATUSES and call.num_retries < self.cfg.max_retries:
                resp.release()  # the error body is small: drop the connection rather than read
                self.finish(inst, call, str(resp.status))
                await self._before_retry(call, inst, str(resp.status))
                continue
            return inst, resp

    async def _before_retry(self, call: Call, inst: Instance, reason: str) -> None:
        call.num_retries += 1
        call.excluded.add(inst.url)
        self.metrics.retries.labels(reason).inc()
        await asyncio.sleep(self.router.rng.uniform(0, self.cfg.retry_jitter_s))

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

    # ---------------------------------------------------------------- streaming relay
    def stream_done(
        self,
        call: Call,
        inst: Instance,
        t_first: float,
        t_last: float,
        num_tokens: int,
        measured_speed: bool,
    ) -> None:
        """A stream ended well: TPOT and the instance's measured decode speed."""
        tpot = stream_tpot_s(num_tokens, t_first, t_last)
        if tpot is not None:
            self.metrics.observe("tpot", call.model, tpot)
            if measured_speed:
                inst.observe_tpot(tpot)
        self.success(inst)

    # ---------------------------------------------------------------- for relays and moves
    # (relay_host.py: the calls relay.py and moves.py make, and nothing else of the gateway)
    def relay_started(self, relay: PushRelay) -> None:
        self._relays.add(relay)

    def relay_ended(self, relay: PushRelay) -> None:
        self._relays.discard(relay)

    def keep_task(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def instance(self, url: str) -> Instance | None:
        return self.pool.instances.get(url.rstrip("/"))

    def fence(self, url: str, key: object, until_s: float, now: float) -> None:
        self.pool.fence(url, key, until_s, now)

    def unfence(self, url: str, key: object) -> None:
        self.pool.unfence(url, key)

    def observe_ttft(self, model: str, ttft_s: float) -> None:
        self.metrics.observe("ttft", model, ttft_s)

    def count_migration(self, outcome: str) -> None:
        self.metrics.migrations.labels(outcome).inc()

    def count_warm_up(self, outcome: str) -> None:
        self.metrics.warm_ups.labels(outcome).inc()

    def warm_up_began(self, url: str) -> None:
        self._warm_ups_on[url] = self._warm_ups_on.get(url, 0) + 1

    def warm_up_ended(self, url: str) -> None:
        self._warm_ups_on[url] -= 1
        if not self._warm_ups_on[url]:
            del self._warm_ups_on[url]

    def num_warm_ups_on(self, url: str) -> int:
        return self._warm_ups_on.get(url.rstrip("/"), 0)

    def engine_admin_token(self, url: str) -> str | None:
        return self.engine_admin_tokens.get(url)

    async def post(
        self,
        url: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamResponse:
        timeouts = self.timeouts if timeouts is None else timeouts
        return await self.client.request(url, "POST", path, body, headers, timeouts)

    # ---------------------------------------------------------------- moves (controller)
    def calls_on(self, url: str) -> list[Call]:
        """The requests an instance is serving now."""
        return [c for c in self._calls.values() if c.instance == url]

    def call(self, call_id: int) -> Call | None:
        """An accepted request not yet ended, by id."""
        return self._calls.get(call_id)

    async def move_request(self, call_id: int, move: Move) -> tuple[str, WarmOutcome | None]:
        """Move an in-flight request off its instance (a shift's drain deadline): moves.py."""
        return await moves.move_request(self, call_id, move)

    async def drained(self, url: str, timeout_s: float) -> bool:
        """Wait until `url` serves no request (True) or `timeout_s` passed (False): woken by
        every request that ends, not a poll."""
        return await self.ended_signal.wait_for(lambda: not self.calls_on(url), timeout_s)

    # ---------------------------------------------------------------- shutdown
    async def shutdown(self, grace_s: float) -> None:
        """Stop gracefully: refuse new requests (the listening socket closes; requests on
        open connections get 503), let the calls in flight finish for up to `grace_s`, then
        end every stream still open with an error event and [DONE], fail the non-streamed
        requests still waiting with a 503, and close."""
        self.shutting_down = True
        if self.server is not None:
            self.server.stop_accepting()
        idle = self._idle = asyncio.Event()
        if not self._calls:
            idle.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await idle.wait()
        self._grace_over = True
        if self._calls:
            log.warning("shutdown: ending %d request(s) still in flight", len(self._calls))
            for fut in self._waiters.waiters():  # still queued: refused by `_pick`
                if not fut.done():
                    fut.set_result(None)
            for relay in list(self._relays):
                relay.abort("the gateway is shutting down")
            for task in list(self._tasks):
                task.cancel()
            for call in list(self._calls.values()):
                if call.upstream is not None:
                    call.upstream.release()  # its reader gets an error and answers 503
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await idle.wait()
        await self.close()
