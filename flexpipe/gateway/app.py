"""The gateway server: OpenAI-compatible proxy with routing, backpressure, retries and
mid-stream migration, plus /v1/models, /health, /metrics and the admin API.

Hot path, per request: one orjson parse of the body (model, prompt, stream), CRC-32 block
hashes of the prompt, one routing decision over plain snapshots, the original body bytes
forwarded unchanged on a pooled keep-alive connection, and the upstream's SSE bytes relayed
as they arrive, cut only at event boundaries (so a failure never leaves half an event at the
client). Streams are relayed by push (relay.py); events are parsed only when a stream has to
be continued elsewhere. Routing and load accounting are the synchronous `Router`'s
(router.py); the prompt routes' request path is proxy.py, the slots and the wait queue
slots.py; the admin API is admin.py; moving a request between instances is moves.py. This
module is the gateway's state and lifecycle around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
from collections.abc import Callable
from typing import Any

from flexpipe.gateway import moves, peers
from flexpipe.gateway.admin import AdminApi
from flexpipe.gateway.body_parser import (
    BodyParser,
)
from flexpipe.gateway.call import Call, Move
from flexpipe.gateway.config import GatewayConfig
from flexpipe.gateway.control_ops import apply_op
from flexpipe.gateway.core.deadline import Deadlines
from flexpipe.gateway.core.holds import Holds
from flexpipe.gateway.core.pool import Instance, Pool, stream_tpot_s
from flexpipe.gateway.core.router import Router
from flexpipe.gateway.core.wait_queue import WaitQueue
from flexpipe.gateway.core.warm_up import WarmOutcome
from flexpipe.gateway.gateway_metrics import GatewayMetrics
from flexpipe.gateway.prober import Prober
from flexpipe.gateway.proxy import Proxy
from flexpipe.gateway.relay import PushRelay
from flexpipe.gateway.shared_state import (
    ControlOp,
    SharedState,
    call_ids,
    reads_prefixes,
)
from flexpipe.gateway.signal import Signal
from flexpipe.gateway.tenants import Tenants
from flexpipe.gateway.ui_routes import UiRoutes
from flexpipe.http.client import ClientPool, Timeouts, UpstreamResponse
from flexpipe.http.server import (
    App,
    HttpServer,
    Request,
    Response,
    error_response,
    json_response,
    serve,
)

log = logging.getLogger("flexpipe.gateway")

_ADMIN_BODY_BYTES = 1 << 20  # every route but the two that carry prompts


class Gateway(Proxy):
    """The gateway: its state, lifecycle and plain endpoints here; the prompt routes' request
    path is `Proxy` (proxy.py), its slots and wait queue `Slots` (slots.py)."""

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
