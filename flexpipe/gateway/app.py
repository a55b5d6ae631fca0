"""The gateway server: OpenAI-compatible proxy with routing, backpressure, retries and
mid-stream migration, plus /v1/models, /health, /metrics and the admin API.

Hot path, per request: one orjson parse of the body (model, prompt, stream), CRC-32 block
hashes of the prompt, one routing decision over plain snapshots, the original body bytes
forwarded unchanged on a pooled keep-alive connection, and the upstream's SSE bytes relayed
as they arrive, cut only at event boundaries (so a failure never leaves half an event at the
client). Streams are relayed by push (`_PushRelay`): the upstream connection's callback
collects what arrives in a loop pass and one callback writes it to the client, with no task
or future per chunk. Events are parsed only when a stream has to be migrated, which a task
running `Gateway._relay` takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import random
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from flexpipe.gateway import sse
from flexpipe.gateway.backpressure import DrainRate
from flexpipe.gateway.config import GatewayConfig
from flexpipe.gateway.metrics import GatewayMetrics
from flexpipe.gateway.pool import Instance, InstanceState, Pool, PoolError
from flexpipe.gateway.prober import Prober
from flexpipe.gateway.tenants import Tenant, Tenants
from flexpipe.http.client import ClientPool, Timeouts, UpstreamError, UpstreamResponse
from flexpipe.http.server import (
    App,
    ChunkWriter,
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
from flexpipe.policies.routing import (
    PrefixIndex,
    RoutingRequest,
    RoutingSnapshot,
    create_policy,
    prompt_block_hashes,
)

log = logging.getLogger("flexpipe.gateway")

_RETRY_STATUSES = (429, 503)
_JSON = "application/json"
_JSON_HEADERS = {"content-type": _JSON}  # upstream request headers (never mutated)


@dataclass(slots=True, eq=False)
class _Call:
    """One client request on its way through the gateway."""

    path: str
    chat: bool
    model: str
    body: dict[str, Any]
    raw: bytes
    stream: bool
    routing: RoutingRequest
    num_tokens: float
    t0: float
    tenant: Tenant | None
    excluded: set[str] = field(default_factory=set)  # busy for this call: avoid if possible
    failed: set[str] = field(default_factory=set)  # failed this call: never again
    num_retries: int = 0
    num_migrations: int = 0  # re-runs and continuations after an instance failed
    num_prompt_tokens: int = 0  # estimated, as routing counts them
    num_output_tokens: int | None = None  # what a finished non-streamed response reported
    upstream: UpstreamResponse | None = None  # the response being read (non-streamed)
    ended: bool = False  # `Gateway._end_call` done


class Gateway:
    def __init__(self, cfg: GatewayConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.pool = Pool(cfg.max_concurrency_per_instance)
        self.client = ClientPool()
        self.metrics = GatewayMetrics()
        self.policy = create_policy(cfg.policy, **cfg.policy_params)
        self.rng = random.Random(cfg.seed)
        self.prefix_index = PrefixIndex(cfg.max_prefix_blocks_per_instance)
        self.tenants = Tenants(cfg.tenants, clock())
        self.timeouts = Timeouts(cfg.connect_timeout_s, cfg.ttfb_timeout_s, cfg.idle_timeout_s)
        self.mean_request_tokens = 512.0  # EWMA of prompt + expected output per request
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tasks: set[asyncio.Task[None]] = set()  # failover relays in progress
        self._calls: set[_Call] = set()  # accepted and not yet ended, whatever their phase
        self._relays: set[_PushRelay] = set()  # streams being relayed by push
        self.drain_rate = DrainRate()  # requests finished per second (for Retry-After)
        self.shutting_down = False  # new requests are refused
        self._grace_over = False  # and, past the grace period, queued ones too
        self._idle: asyncio.Event | None = None  # set when the last call ends (shutdown)
        self.prober = Prober(self)
        self.server: HttpServer | None = None
        for b in cfg.backends:
            self.pool.add(b.url, b.model, b.weight, b.max_concurrency, b.api_key)
        self.pool.on_change(self._wake_one)
        self.app = self._build_app()

    # ---------------------------------------------------------------- lifecycle
    async def start(self, host: str | None = None, port: int | None = None) -> HttpServer:
        await self.prober.start()
        self.server = await serve(
            self.app, host or self.cfg.host, self.cfg.port if port is None else port
        )
        return self.server

    async def close(self) -> None:
        await self.prober.stop()
        if self.server is not None:
            await self.server.close()
        await self.client.close()

    def _build_app(self) -> App:
        app = App(max_body_bytes=self.cfg.max_body_bytes)
        app.add_route("POST", "/v1/completions", self._completions)
        app.add_route("POST", "/v1/chat/completions", self._chat)
        app.add_route("GET", "/v1/models", self._models)
        app.add_route("GET", "/health", self._health)
        app.add_route("GET", "/metrics", self._metrics)
        app.add_route("GET", "/admin/instances", self._admin_list)
        app.add_route("POST", "/admin/instances", self._admin_add)
        app.add_route("POST", "/admin/instances/remove", self._admin_remove)
        app.add_route("POST", "/admin/instances/drain", self._admin_drain)
        app.add_route("POST", "/admin/instances/activate", self._admin_activate)
        app.add_route("POST", "/admin/instances/weight", self._admin_weight)
        return app

    # ---------------------------------------------------------------- plain endpoints
    async def _models(self, req: Request) -> Response:
        del req
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "flexpipe"}
            for m in self.pool.models()
        ]
        return json_response({"object": "list", "data": data})

    async def _health(self, req: Request) -> Response:
        del req
        up = any(i.state is InstanceState.ACTIVE for i in self.pool.instances.values())
        if up:
            return Response(b"")
        return error_response(503, "no healthy instance")

    async def _metrics(self, req: Request) -> Response:
        del req
        m = self.metrics
        m.queued.set(len(self._waiters))
        m.instance_up.clear()
        for inst in self.pool.instances.values():
            m.instance_up.labels(inst.url, inst.state.value).set(
                1 if inst.state is InstanceState.ACTIVE else 0
            )
            m.in_flight.labels(inst.url).set(inst.num_in_flight)
        return Response(m.exposition(), content_type="text/plain; version=0.0.4; charset=utf-8")

    # ---------------------------------------------------------------- admin API
    def _check_admin(self, req: Request) -> None:
        token = self.cfg.admin_token
        if not token:
            raise HttpError(403, "the admin API is disabled: set admin_token in the config")
        given = req.headers.get("authorization", "")
        if not given.lower().startswith("bearer ") or not hmac.compare_digest(
            given[7:].strip().encode(), token.encode()
        ):
            raise HttpError(401, "admin API: missing or wrong bearer token")

    def _admin_body(self, req: Request) -> dict[str, Any]:
        self._check_admin(req)
        body = req.json()
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            raise HttpError(400, "expected a JSON object with a string `url`", param="url")
        return body

    async def _admin_list(self, req: Request) -> Response:
        self._check_admin(req)
        return json_response({"instances": [i.as_dict() for i in self.pool.instances.values()]})

    async def _admin_add(self, req: Request) -> Response:
        body = self._admin_body(req)
        try:
            inst = self.pool.add(
                body["url"],
                body.get("model"),
                float(body.get("weight", 1.0)),
                int(body.get("max_concurrency", 0)),
            )
        except (PoolError, TypeError, ValueError) as exc:
            raise HttpError(400, str(exc)) from None
        if inst.model is None:
            await self.prober.discover(inst)
        return json_response(inst.as_dict())

    async def _admin_remove(self, req: Request) -> Response:
        body = self._admin_body(req)
        try:
            inst = self.pool.remove(body["url"])
        except PoolError as exc:
            raise HttpError(404, str(exc)) from None
        self.prefix_index.remove_instance(inst.url)
        self.policy_hook_removed(inst.url)
        return json_response(inst.as_dict())

    def policy_hook_removed(self, url: str) -> None:
        hook = getattr(self.policy, "on_instance_removed", None)
        if hook is not None:
            hook(url)

    async def _admin_drain(self, req: Request) -> Response:
        body = self._admin_body(req)
        try:
            return json_response(self.pool.drain(body["url"]).as_dict())
        except PoolError as exc:
            raise HttpError(404, str(exc)) from None

    async def _admin_activate(self, req: Request) -> Response:
        body = self._admin_body(req)
        try:
            return json_response(self.pool.activate(body["url"]).as_dict())
        except PoolError as exc:
            raise HttpError(404, str(exc)) from None

    async def _admin_weight(self, req: Request) -> Response:
        body = self._admin_body(req)
        weight = body.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise HttpError(400, "`weight` must be a number", param="weight")
        try:
            return json_response(self.pool.set_weight(body["url"], float(weight)).as_dict())
        except PoolError as exc:
            raise HttpError(400 if "weight" in str(exc) else 404, str(exc)) from None

    # ---------------------------------------------------------------- the proxy
    async def _completions(self, req: Request) -> Response | StreamResponse | PushResponse:
        return await self._proxy(req, "/v1/completions", chat=False)

    async def _chat(self, req: Request) -> Response | StreamResponse | PushResponse:
        return await self._proxy(req, "/v1/chat/completions", chat=True)

    def _parse(self, req: Request, path: str, chat: bool) -> _Call:
        body = req.json()
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise HttpError(400, "`model` must be a non-empty string", param="model")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise HttpError(400, "`stream` must be a boolean", param="stream")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise HttpError(400, "`max_tokens` must be a positive integer", param="max_tokens")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise HttpError(400, "`messages` must be a non-empty list", param="messages")
            parts = []
            for m in messages:
                if not isinstance(m, dict):
                    raise HttpError(400, "each message must be an object", param="messages")
                content = m.get("content")
                parts.append(f"<{m.get('role')}>")
                if isinstance(content, str):
                    parts.append(content)
                elif isinstance(content, list):  # content parts: keep the text ones
                    parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
            prompt = "".join(parts).encode()
        else:
            raw_prompt = body.get("prompt")
            if isinstance(raw_prompt, str):
                prompt = raw_prompt.encode()
            elif isinstance(raw_prompt, list) and raw_prompt:
                first = raw_prompt[0]
                prompt = first.encode() if isinstance(first, str) else orjson.dumps(first)
            else:
                raise HttpError(400, "`prompt` must be a string or a list", param="prompt")
        if not self.pool.has_model(model):
            raise HttpError(404, f"The model `{model}` does not exist.", param="model")
        num_prompt = len(prompt) // 4 + 1
        num_out = max_tokens or self.cfg.default_expected_output_tokens
        hashes = prompt_block_hashes(prompt, self.cfg.block_chars)
        user = body.get("user")
        routing = RoutingRequest(num_prompt, num_out, hashes, user if isinstance(user, str) else "")
        return _Call(
            path, chat, model, body, req.body, stream, routing, float(num_prompt + num_out),
            self.clock(), None, num_prompt_tokens=num_prompt,
        )  # fmt: skip

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
        call = self._parse(req, path, chat)
        if tenant is not None:
            too_large = tenant.too_large(call.num_tokens)
            if too_large is not None:
                self.metrics.rejected.labels("tenant_quota").inc()
                raise HttpError(400, too_large, param="max_tokens")
            ok, wait_s, why = tenant.admit(call.num_tokens, self.clock())
            if not ok:
                self.metrics.rejected.labels("tenant_quota").inc()
                return _too_many(f"tenant {tenant.name}: {why}", wait_s)
            tenant.num_in_flight += 1
            call.tenant = tenant
        self._calls.add(call)
        handed_off = False
        try:
            result = await self._dispatch(call)
            handed_off = isinstance(result, StreamResponse | PushResponse)
            return result
        except _TooMany as exc:
            return _too_many(exc.message, exc.retry_after_s)
        finally:
            if not handed_off:  # a relay ends the call of a stream it was handed
                self._end_call(call, call.num_output_tokens)

    def _end_call(self, call: _Call, num_output_tokens: int | None = None) -> None:
        """Every accepted request ends here exactly once, whatever its exit: the tenant's
        slot and tokens are settled (`num_output_tokens` None: nothing was generated)."""
        if call.ended:
            return
        call.ended = True
        self._calls.discard(call)
        tenant = call.tenant
        if tenant is not None:
            tenant.num_in_flight -= 1
            used = 0 if num_output_tokens is None else call.num_prompt_tokens + num_output_tokens
            tenant.settle(call.num_tokens, used, self.clock())
        if not self._calls and self._idle is not None:
            self._idle.set()

    @property
    def num_active_calls(self) -> int:
        """Requests accepted and not yet ended (queued, in flight or streaming)."""
        return len(self._calls)

    async def _dispatch(self, call: _Call) -> Response | StreamResponse | PushResponse:
        while True:
            inst, resp = await self._send(call, call.raw)
            if call.stream and resp.status == 200:
                return PushResponse(
                    _PushRelay(self, call, inst, resp).start,
                    content_type=resp.headers.get("content-type", "text/event-stream"),
                    headers={"x-flexpipe-instance": inst.url},
                )
            call.upstream = resp
            try:
                body = await resp.read()
            except UpstreamError as exc:
                # Nothing has reached the client yet: run it again on another instance.
                self._finish(inst, call, exc.kind)
                self._failure(inst)
                call.failed.add(inst.url)
                if self.shutting_down:
                    raise HttpError(503, "the gateway is shutting down") from None
                if exc.kind == "idle" or call.num_migrations >= self.cfg.max_migrations:
                    self.metrics.migrations.labels("failed").inc()
                    raise HttpError(502, f"upstream failed mid-response: {exc.kind}") from None
                call.num_migrations += 1
                self.metrics.migrations.labels("ok").inc()
                log.info("re-running a request that failed on %s", inst.url)
                continue
            except BaseException:  # cancelled: the client left; abort the engine's work
                self._finish(inst, call, "cancelled")
                raise
            finally:
                call.upstream = None
                resp.release()
            break
        self._finish(inst, call, str(resp.status))
        if resp.status < 500:
            self._success(inst)
        if call.tenant is not None and resp.status == 200:
            call.num_output_tokens = _completion_tokens(body)
        return Response(
            body,
            resp.status,
            resp.headers.get("content-type", _JSON),
            {"x-flexpipe-instance": inst.url},
        )

    async def _send(self, call: _Call, raw: bytes) -> tuple[Instance, UpstreamResponse]:
        """Route and send. An instance that cannot be reached, or dies before its response
        head, is never tried again for this call and the next live one is (nothing has
        reached the client yet); 429 and 503 are retried once with jitter."""
        while True:
            inst = await self._pick(call)
            self._acquire(inst, call)
            headers = _JSON_HEADERS
            if inst.api_key:
                headers = {**_JSON_HEADERS, "authorization": f"Bearer {inst.api_key}"}
            try:
                resp = await self.client.request(
                    inst.url, "POST", call.path, raw, headers, self.timeouts
                )
            except UpstreamError as exc:
                self._finish(inst, call, exc.kind)
                self._failure(inst)
                call.failed.add(inst.url)
                if exc.kind == "connect" and len(call.failed) <= self.cfg.max_connect_failovers:
                    self.metrics.retries.labels("connect").inc()
                    continue
                if exc.kind in ("closed", "protocol") and (
                    call.num_migrations < self.cfg.max_migrations
                ):
                    call.num_migrations += 1
                    self.metrics.retries.labels(exc.kind).inc()
                    continue
                status = 504 if exc.kind == "ttfb" else 502
                raise HttpError(status, f"upstream {exc}") from None
            except BaseException:  # cancelled (the client left): release the slot
                self._finish(inst, call, "cancelled")
                raise
            if resp.status in _RETRY_STATUSES and call.num_retries < self.cfg.max_retries:
                resp.release()  # the error body is small: drop the connection rather than read
                self._finish(inst, call, str(resp.status))
                await self._before_retry(call, inst, str(resp.status))
                continue
            return inst, resp

    async def _before_retry(self, call: _Call, inst: Instance, reason: str) -> None:
        call.num_retries += 1
        call.excluded.add(inst.url)
        self.metrics.retries.labels(reason).inc()
        await asyncio.sleep(self.rng.uniform(0, self.cfg.retry_jitter_s))

    async def _pick(self, call: _Call) -> Instance:
        deadline: float | None = None
        while True:
            if self._grace_over:
                raise HttpError(503, "the gateway is shutting down")
            routable = self.pool.routable(call.model)
            if call.failed:
                routable = [i for i in routable if i.url not in call.failed]
            cands = routable
            if call.excluded:
                cands = [i for i in routable if i.url not in call.excluded] or routable
            if not cands:
                self.metrics.rejected.labels("no_instance").inc()
                raise HttpError(503, f"no healthy instance serves model `{call.model}` right now")
            now = self.clock()
            hashes = call.routing.block_hashes
            index = self.prefix_index
            if hashes:
                views = tuple(i.view(index.match(i.url, hashes)) for i in cands)
            else:
                views = tuple(i.view() for i in cands)
            snapshot = RoutingSnapshot(views, call.routing, self.cfg.max_metrics_age_s)
            decision = self.policy.choose(snapshot, now, self.rng)
            for pos, name in enumerate(decision.ranked):
                inst = next((i for i in cands if i.url == name), None)
                if inst is None or inst.num_in_flight >= inst.max_concurrency:
                    continue
                self.metrics.decision(
                    self.policy.name, decision.reason if pos == 0 else "next_ranked"
                )
                if hashes:
                    matched = next(v.num_prefix_blocks_matched for v in views if v.name == name)
                    self.metrics.prefix_all.inc(len(hashes))
                    self.metrics.prefix_matched.inc(matched)
                    index.insert(name, hashes)
                return inst
            # every instance is at its limit: wait in a bounded queue
            if len(self._waiters) >= self.cfg.max_queue:
                self.metrics.rejected.labels("queue_full").inc()
                wait_s = self.drain_rate.retry_after_s(len(self._waiters), now)
                raise _TooMany("all instances are busy and the wait queue is full", wait_s)
            if deadline is None:
                deadline = now + self.cfg.max_queue_wait_s
            left = deadline - now
            if left <= 0:
                self.metrics.rejected.labels("queue_timeout").inc()
                wait_s = self.drain_rate.retry_after_s(len(self._waiters), now)
                raise _TooMany("all instances stayed busy", wait_s)
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await asyncio.wait_for(fut, left)
            except TimeoutError:
                pass
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)

    def _wake_one(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _acquire(self, inst: Instance, call: _Call) -> None:
        inst.num_in_flight += 1
        inst.num_tokens_sent_since_scrape += call.num_tokens
        self.mean_request_tokens += 0.05 * (call.num_tokens - self.mean_request_tokens)

    def _finish(self, inst: Instance, call: _Call, status: str) -> None:
        """`inst` no longer counts `call` (each `_acquire` has exactly one `_finish`)."""
        inst.num_in_flight -= 1
        inst.num_tokens_sent_since_scrape -= call.num_tokens
        self.metrics.request_done(call.model, inst.url, status)
        now = self.clock()
        self.drain_rate.record(now)
        if status == "200":
            self.metrics.observe("e2e", call.model, now - call.t0)
        self._wake_one()

    def _success(self, inst: Instance) -> None:
        inst.num_consecutive_failures = 0
        if inst.backoff_s:
            inst.backoff_s = 0.0

    def _failure(self, inst: Instance) -> None:
        """A passive signal (connect error, timeout, broken stream)."""
        inst.num_consecutive_failures += 1
        if (
            inst.state is not InstanceState.EJECTED
            and inst.num_consecutive_failures >= self.cfg.eject_after_failures
        ):
            self.eject(inst)

    def eject(self, inst: Instance) -> None:
        self.pool.eject(
            inst, self.clock(), self.cfg.eject_base_backoff_s, self.cfg.eject_max_backoff_s
        )
        self.metrics.ejections.labels(inst.url).inc()
        log.warning("ejected %s for %.1f s", inst.url, inst.backoff_s)

    # ---------------------------------------------------------------- streaming relay
    def _stream_done(self, call: _Call, inst: Instance, t_first: float, t_last: float,
                     num_tokens: int, measured_speed: bool) -> None:  # fmt: skip
        """A stream ended well: TPOT and the instance's measured decode speed."""
        if num_tokens >= 2 and t_last > t_first:
            tpot = (t_last - t_first) / (num_tokens - 1)
            self.metrics.observe("tpot", call.model, tpot)
            if measured_speed:
                speed = 1.0 / tpot
                old = inst.speed_tokens_per_s
                inst.speed_tokens_per_s = speed if not old else old + 0.2 * (speed - old)
        self._success(inst)

    async def _relay(
        self,
        call: _Call,
        inst: Instance,
        resp: UpstreamResponse,
        sent: list[bytes] | None = None,
        failed: UpstreamError | None = None,
        t_first: float = 0.0,
        num_events: int = 0,
    ) -> AsyncGenerator[bytes, None]:
        """The stream as an async iterator: the path after a mid-stream failure of a pushed
        relay (`failed`, with what it had relayed so far), and the reference for it. Each
        failure continues the stream on another live instance, up to `max_migrations`."""
        sent = [] if sent is None else sent  # complete events relayed from the first upstream
        tail = b""
        t_last = 0.0
        state: sse.StreamState | None = None  # set once migrated: events are rewritten
        status = "200"
        live = True  # `inst` still counts this request
        try:
            while True:
                try:
                    if failed is not None:
                        exc, failed = failed, None
                        raise exc
                    chunk = await resp.next_chunk()
                except UpstreamError as exc:
                    self._failure(inst)
                    self._finish(inst, call, exc.kind)
                    live = False
                    resp.release()
                    call.failed.add(inst.url)
                    if state is None:
                        state = sse.summarize(b"".join(sent), call.chat)
                    if state.finished:
                        yield sse.DONE
                        return
                    moved = await self._migrate(call, inst, state)
                    if isinstance(moved, bytes):
                        yield moved
                        status = "migration_failed"
                        return
                    inst, resp = moved
                    live = True
                    tail = b""
                    continue
                if chunk is None:
                    if tail:
                        yield tail
                    break
                if not tail and chunk.endswith(b"\n\n"):
                    out = chunk
                else:
                    data = tail + chunk
                    cut = data.rfind(b"\n\n") + 2
                    if cut < 2:
                        tail = data
                        continue
                    out, tail = data[:cut], data[cut:]
                t_last = self.clock()
                if not t_first:
                    t_first = t_last
                    self.metrics.observe("ttft", call.model, t_first - call.t0)
                if state is None:
                    num_events += out.count(b"\n\n")
                    sent.append(out)
                    yield out
                else:
                    parts = []
                    for payload in sse.events(out):
                        ev, _ = sse.rewrite_event(payload, state, call.chat)
                        if ev is not None:
                            parts.append(ev)
                    if parts:
                        yield b"".join(parts)
            resp.release()
            num_tokens = max(0, num_events - 2) if state is None else state.num_tokens
            self._stream_done(call, inst, t_first, t_last, num_tokens, state is None)
        finally:
            resp.release()  # aborts the upstream request if the client went away
            if live:
                self._finish(inst, call, status)
            num_out = max(0, num_events - 2) if state is None else state.num_tokens
            self._end_call(call, num_out)

    async def _migrate(
        self, call: _Call, failed: Instance, state: sse.StreamState
    ) -> tuple[Instance, UpstreamResponse] | bytes:
        """Continue a broken stream on another live instance (each failed one is out for
        this call, and a target that cannot be reached is skipped for the next); on
        failure, the error event and [DONE] to end the client's stream with."""
        if self.shutting_down:
            return sse.error_event("the gateway is shutting down", 503) + sse.DONE
        if call.num_migrations >= self.cfg.max_migrations:
            self.metrics.migrations.labels("failed").inc()
            return sse.error_event("the instance serving this stream failed") + sse.DONE
        body = sse.continuation_body(
            call.body, state, call.chat, self.cfg.default_expected_output_tokens
        )
        if body is None:  # nothing left to generate, or a prompt that cannot be continued
            if state.num_tokens and state.id:
                self.metrics.migrations.labels("ok").inc()
                return _final_event(state, call.chat) + sse.DONE
            self.metrics.migrations.labels("failed").inc()
            return sse.error_event("the instance serving this stream failed") + sse.DONE
        call.num_migrations += 1
        call.num_retries = 0  # the continuation may retry a busy target once, as a request
        state.num_tokens_at_join = state.num_tokens
        try:
            inst, resp = await self._send(call, orjson.dumps(body))
        except HttpError as exc:
            self.metrics.migrations.labels("failed").inc()
            return sse.error_event(f"could not continue the stream: {exc.message}") + sse.DONE
        if resp.status != 200:
            detail = (await _safe_read(resp))[:200].decode("utf-8", "replace")
            resp.release()
            self._finish(inst, call, str(resp.status))
            self.metrics.migrations.labels("failed").inc()
            return sse.error_event(f"could not continue the stream: {detail}") + sse.DONE
        self.metrics.migrations.labels("ok").inc()
        log.info("continued a stream from %s on %s", failed.url, inst.url)
        return inst, resp

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
            await asyncio.wait_for(idle.wait(), grace_s)
        self._grace_over = True
        if self._calls:
            log.warning("shutdown: ending %d request(s) still in flight", len(self._calls))
            for fut in list(self._waiters):  # still queued: refused by `_pick`
                if not fut.done():
                    fut.set_result(None)
            for relay in list(self._relays):
                relay.abort("the gateway is shutting down")
            for task in list(self._tasks):
                task.cancel()
            for call in list(self._calls):
                if call.upstream is not None:
                    call.upstream.release()  # its reader gets an error and answers 503
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(idle.wait(), 2.0)
        await self.close()


class _PushRelay:
    """The streaming hot path: the upstream connection's callback hands each chunk straight to
    the client's `ChunkWriter` (no task woken, no await per chunk), cut at event boundaries so
    a failure never leaves half an event at the client; the last events and the terminal chunk
    go out in one write. A mid-stream failure hands over to `Gateway._relay` (migration) in
    a task; a client that leaves aborts the upstream request at once."""

    __slots__ = ("call", "done", "gw", "inst", "loop", "num_events", "pending", "resp", "sent",
                 "t_first", "t_last", "tail", "task", "writer")  # fmt: skip

    def __init__(self, gw: Gateway, call: _Call, inst: Instance, resp: UpstreamResponse) -> None:
        self.gw = gw
        self.call = call
        self.inst = inst
        self.resp = resp
        self.writer: ChunkWriter | None = None
        self.sent: list[bytes] = []  # complete events relayed (kept for a migration)
        self.tail = b""
        self.t_first = self.t_last = 0.0
        self.num_events = 0
        self.done = False  # accounting done (ended, failed over or client gone)
        self.task: asyncio.Task[None] | None = None  # the failover pump, if any
        self.pending: list[bytes] = []  # received in this loop pass, written by `_flush`
        self.loop = resp.loop

    def start(self, writer: ChunkWriter) -> None:
        self.writer = writer
        writer.on_close = self._client_gone
        writer.on_resume = self.resp.resume_reading
        if writer.closed:
            self._client_gone()
            return
        self.gw._relays.add(self)
        self.resp.pipe(self._data, self._end)

    def _data(self, chunk: bytes) -> None:
        """Collect what arrives in this loop pass; one write at the end of the pass (what a
        task woken by the first chunk would have sent, without the task)."""
        if not self.pending:
            self.loop.call_soon(self._flush)
        self.pending.append(chunk)

    def _flush(self) -> None:
        if self.done:
            return
        out = self._complete_events()
        if out:
            writer = self.writer
            assert writer is not None
            writer.write(out)
            if not writer.writable:
                self.resp.pause_reading()

    def _complete_events(self) -> bytes:
        """The complete events received so far and not yet written (the rest stays in
        `tail`), counted and kept for a migration."""
        pending = self.pending
        if not pending:
            return b""
        chunk = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        tail = self.tail
        if not tail and chunk[-2:] == b"\n\n":
            out = chunk
        else:
            data = tail + chunk
            cut = data.rfind(b"\n\n") + 2
            if cut < 2:
                self.tail = data
                return b""
            out, self.tail = data[:cut], data[cut:]
        t = self.gw.clock()
        if not self.t_first:
            self.t_first = t
            self.gw.metrics.observe("ttft", self.call.model, t - self.call.t0)
        self.t_last = t
        self.num_events += out.count(b"\n\n")
        self.sent.append(out)
        return out

    def _end(self, error: UpstreamError | None) -> None:
        if self.done:
            return
        writer = self.writer
        assert writer is not None
        if error is not None:
            self._flush()
            self.done = True  # accounting moves to the failover relay
            self.gw._relays.discard(self)
            self.task = self.loop.create_task(self._failover(error))
            self.gw._tasks.add(self.task)
            self.task.add_done_callback(self.gw._tasks.discard)
            return
        out = self._complete_events()
        self.done = True
        writer.end(out + self.tail)  # the last events and the terminal chunk: one write
        gw, call, inst = self.gw, self.call, self.inst
        self.resp.release()
        num_tokens = max(0, self.num_events - 2)
        gw._stream_done(call, inst, self.t_first, self.t_last, num_tokens, True)
        self._account("200")

    def _account(self, status: str) -> None:
        self.gw._relays.discard(self)
        self.gw._finish(self.inst, self.call, status)
        self.gw._end_call(self.call, max(0, self.num_events - 2))

    def _client_gone(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.done:
            return
        self.done = True
        self.resp.release()  # aborts the upstream request
        self._account("client_gone")

    def abort(self, message: str) -> None:
        """End the stream now (the gateway is stopping): what was received, an error event
        and [DONE], so the client is told rather than cut off."""
        if self.done:
            return
        out = self._complete_events()
        self.done = True
        writer = self.writer
        assert writer is not None
        writer.end(out + sse.error_event(message, 503, "ServiceUnavailableError") + sse.DONE)
        self.resp.release()
        self._account("shutdown")

    async def _failover(self, error: UpstreamError) -> None:
        writer = self.writer
        assert writer is not None
        relay = self.gw._relay(self.call, self.inst, self.resp, self.sent, error,
                               self.t_first, self.num_events)  # fmt: skip
        resumed: asyncio.Future[None] | None = None

        def on_resume() -> None:
            if resumed is not None and not resumed.done():
                resumed.set_result(None)

        writer.on_resume = on_resume
        try:
            async for out in relay:
                if writer.closed:
                    break
                writer.write(out)
                if not writer.writable:
                    resumed = asyncio.get_running_loop().create_future()
                    await resumed
            writer.end()
        except asyncio.CancelledError:  # the client left, or the gateway is stopping
            writer.end(sse.error_event("the gateway is shutting down", 503) + sse.DONE)
            raise
        except Exception:
            log.exception("stream failover failed")
            writer.fail(502, "the gateway failed to continue the stream")
        finally:
            await relay.aclose()


class _TooMany(HttpError):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(429, message)
        self.retry_after_s = retry_after_s


def _too_many(message: str, retry_after_s: float) -> Response:
    resp = error_response(429, message)
    resp.headers = {"retry-after": str(max(1, math.ceil(retry_after_s)))}
    return resp


def _completion_tokens(body: bytes) -> int | None:
    """`usage.completion_tokens` of a non-streamed response, if it says."""
    try:
        usage = orjson.loads(body).get("usage") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return None
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) else None


async def _safe_read(resp: UpstreamResponse) -> bytes:
    try:
        return await resp.read()
    except UpstreamError:
        return b""


def _final_event(state: sse.StreamState, chat: bool) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if chat:
        choice["delta"] = {}
    else:
        choice["text"] = ""
    obj = {
        "id": state.id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": state.created,
        "model": state.model,
        "choices": [choice],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"
