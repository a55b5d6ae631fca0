"""The request path of the gateway's two prompt routes: parse and validate the body once,
admit the tenant, route (slots.py), send the original bytes on a pooled connection, retry or
fail over before the response head, and hand a stream to its push relay (relay.py) or answer
the non-streamed body. `Proxy` is a part of `Gateway` (app.py), which sets the fields
declared here; moving a request is moves.py's, which interrupts `send` through
`Call.sending`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from flexpipe.gateway.body_parser import (
    PARSE_OFF_LOOP_BYTES,
    BodyParser,
    summarize,
    validate_body,
)
from flexpipe.gateway.call import Call
from flexpipe.gateway.core.admission import is_served
from flexpipe.gateway.core.pool import Instance, Pool
from flexpipe.gateway.relay import PushRelay
from flexpipe.gateway.retry_later import RetryLater, retry_later
from flexpipe.gateway.shared_state import SharedStateDown, admit_shared
from flexpipe.gateway.slots import Slots
from flexpipe.gateway.tenants import Tenant, Tenants, completion_tokens
from flexpipe.http.client import ClientPool, Timeouts, UpstreamError, UpstreamResponse
from flexpipe.http.server import (
    HttpError,
    PushResponse,
    Request,
    Response,
    StreamResponse,
)
from flexpipe.policies.routing import RoutingRequest
from flexpipe.protocol import RequestError

if TYPE_CHECKING:
    from flexpipe.gateway.relay_host import RelayHost

log = logging.getLogger("flexpipe.gateway")

__all__ = ["Proxy"]

_RETRY_STATUSES = (429, 503)
_DEAD = ("connect", "closed", "protocol")  # the instance failed before a response head
_JSON = "application/json"
_JSON_HEADERS = {"content-type": _JSON}  # upstream request headers (never mutated)


class Proxy(Slots):
    """The proxy's request path (`Gateway`'s fields; its slots are `Slots`')."""

    pool: Pool
    client: ClientPool
    tenants: Tenants
    timeouts: Timeouts
    engine_admin_tokens: dict[str, str]  # instance url -> its admin token
    shutting_down: bool
    _calls: dict[int, Call]
    _call_ids: Iterator[int]
    _idle: asyncio.Event | None
    _parsers: BodyParser

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
                    PushRelay(cast("RelayHost", self), call, inst, resp).start,  # (a Gateway)
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
