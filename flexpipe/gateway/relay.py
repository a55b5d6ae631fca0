"""Streams through the gateway: the push relay (the hot path) and, when the instance serving a
stream fails, its continuation on another live instance.

The push relay: the upstream connection's callback hands each chunk straight to the client's
`ChunkWriter` (no task woken, no await per chunk), cut at event boundaries so a failure never
leaves half an event at the client. A mid-stream failure hands the stream to a task running
`relay_after_failure`, which parses what was sent, asks `migrate` for a continuation and
rewrites its events into the client's stream (sse.py). Both see the gateway through its call
table for relays (relay_host.py `RelayHost`), never its fields.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import orjson

from flexpipe.gateway import sse
from flexpipe.gateway.call import Call, Move
from flexpipe.gateway.core.cut_over import MAX_FENCE_S, fence_wait_s
from flexpipe.gateway.core.pool import Instance
from flexpipe.gateway.core.warm_up import (
    MOVE_PRIORITY,
    WARM_POLL_S,
    WarmOutcome,
    warms,
)
from flexpipe.http.client import UpstreamError, UpstreamResponse
from flexpipe.http.server import ChunkWriter, HttpError

if TYPE_CHECKING:
    from flexpipe.gateway.config import GatewayConfig
    from flexpipe.gateway.relay_host import RelayHost

log = logging.getLogger("flexpipe.gateway")

__all__ = [
    "PushRelay",
    "migrate",
    "move_relayed",
    "num_stream_tokens",
    "relay_after_failure",
    "stream_silence_s",
    "warm_up",
]

_NO_PRIORITY = "Priority scheduling is not enabled"
# a started stream's silence bound, in its instance's measured times per token, where that is
# longer than `GatewayConfig.stream_silence_s` (a slow instance is not taken for a hung one)
STREAM_SILENCE_TPOTS = 100


def stream_silence_s(cfg: GatewayConfig, inst: Instance) -> float:
    """How long a stream that has sent tokens may stay silent before it is continued
    elsewhere, as one whose engine died: a hung engine (stopped, deadlocked, its host
    unreachable) breaks no connection, and without this bound its streams would wait for the
    upstream idle timeout. Before the first token (queueing, prefill) that timeout stands;
    after it, this bound is never looser than it."""
    speed = inst.speed_tokens_per_s
    bound_s = cfg.stream_silence_s
    if speed > 0:
        bound_s = max(bound_s, STREAM_SILENCE_TPOTS / speed)
    return min(bound_s, cfg.idle_timeout_s)


class PushRelay:
    """The streaming hot path: the upstream connection's callback hands each chunk straight to
    the client's `ChunkWriter` (no task woken, no await per chunk), cut at event boundaries so
    a failure never leaves half an event at the client; the last events and the terminal chunk
    go out in one write. A mid-stream failure hands over to `relay_after_failure` (migration) in
    a task; a client that leaves aborts the upstream request at once."""

    __slots__ = (
        "call",
        "done",
        "gw",
        "inst",
        "loop",
        "num_events",
        "pending",
        "resp",
        "sent",
        "t_first",
        "t_last",
        "tail",
        "task",
        "writer",
    )

    def __init__(self, gw: RelayHost, call: Call, inst: Instance, resp: UpstreamResponse) -> None:
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
        self.gw.relay_started(self)
        self.call.relay = self
        self.resp.pipe(self._data, self._end)

    @property
    def num_tokens_sent(self) -> int:
        """Tokens relayed so far (one event each; chat's first event only names the role)."""
        return num_stream_tokens(self.num_events, self.call, ended=False)

    def move(self, move: Move) -> str:
        """Stop relaying from this instance now and continue the stream as `move` says (the
        controller's move at a drain deadline); returns the method, or "not_running"."""
        if self.done:
            return "not_running"
        self.call.move = move
        self._flush()
        self._hand_over(UpstreamError("moved", "moved by the controller"))
        self.resp.release()  # aborts the upstream request (its KV was exported before)
        return move.method

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
            cut = self.call.cut
            if cut is not None and self.call.relay is self:
                cut()  # a move waited for this token: it cuts over now

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
            self.gw.observe_ttft(self.call.model, t - self.call.t0)
        self.t_last = t
        num_before = self.num_events
        self.num_events += out.count(b"\n\n")
        if num_before <= self.call.chat < self.num_events:  # its first token: silence is bounded
            self.resp.set_idle_timeout(stream_silence_s(self.gw.cfg, self.inst))
        self.sent.append(out)
        return out

    def _end(self, error: UpstreamError | None) -> None:
        if self.done:
            return
        writer = self.writer
        assert writer is not None
        if error is not None:
            self._flush()
            if not self.done:  # (else a move waiting for the last token took the stream)
                self._hand_over(error)
            return
        out = self._complete_events()
        self.done = True
        writer.end(out + self.tail)  # the last events and the terminal chunk: one write
        gw, call, inst = self.gw, self.call, self.inst
        self.resp.release()
        num_tokens = num_stream_tokens(self.num_events, call, ended=True)
        gw.stream_done(call, inst, self.t_first, self.t_last, num_tokens, True)
        self._account("200", num_tokens)

    def _hand_over(self, error: UpstreamError) -> None:
        """The rest of the stream is the failover task's (accounting included)."""
        self.done = True
        self.gw.relay_ended(self)
        self.call.relay = None
        self.task = self.loop.create_task(self._failover(error))
        self.gw.keep_task(self.task)

    def _account(self, status: str, num_tokens: int | None = None) -> None:
        """`num_tokens`: what the stream carried (None: cut short, every token relayed)."""
        self.gw.relay_ended(self)
        self.call.relay = None
        self.gw.finish(self.inst, self.call, status)
        if num_tokens is None:
            num_tokens = self.num_tokens_sent
        self.gw.end_call(self.call, num_tokens)

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
        relay = relay_after_failure(
            self.gw,
            self.call,
            self.inst,
            self.resp,
            self.sent,
            error,
            self.t_first,
            self.num_events,
        )
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


async def relay_after_failure(
    gw: RelayHost,
    call: Call,
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
    ended = False  # the upstream ended its stream (its usage chunk and [DONE] came)
    # continued elsewhere, no token from there yet: `call.continuing` (and a move's fence
    # there, `Pool.unfence`, lifted at that token)
    call.continuing = False
    try:
        while True:
            try:
                if failed is not None:
                    exc, failed = failed, None
                    raise exc
                chunk = await resp.next_chunk()
            except UpstreamError as exc:
                if call.continuing:  # it leaves the instance before its first token there
                    call.continuing = False
                    gw.unfence(inst.url, call.id)
                if call.move is None:  # a move the controller asked for is no failure
                    gw.failure(inst)
                gw.finish(inst, call, exc.kind)
                live = False
                resp.release()
                call.failed.add(inst.url)
                if state is None:
                    state = call.stream_state = sse.summarize(b"".join(sent), call.chat)
                if state.finished:
                    yield sse.DONE
                    return
                call.relayed = None
                moved = await migrate(gw, call, inst, state)
                if isinstance(moved, bytes):
                    yield moved
                    status = "migration_failed"
                    return
                inst, resp = moved
                call.relayed = resp  # the controller may move it again (`move_relayed`)
                live = True
                tail = b""
                call.continuing = True
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
            t_last = gw.clock()
            if not t_first:
                t_first = t_last
                gw.observe_ttft(call.model, t_first - call.t0)
            if state is None:
                num_before = num_events
                num_events += out.count(b"\n\n")
                if num_before <= call.chat < num_events:  # its first token (as `PushRelay`)
                    resp.set_idle_timeout(stream_silence_s(gw.cfg, inst))
                sent.append(out)
                yield out
            else:
                parts = []
                num_new_tokens = 0
                for payload in sse.events(out):
                    ev, num = sse.rewrite_event(payload, state, call.chat)
                    num_new_tokens += num
                    if ev is not None:
                        parts.append(ev)
                if call.continuing and num_new_tokens:  # (not chat's role-only event)
                    call.continuing = False  # its first token there: the move's fence is through
                    gw.unfence(inst.url, call.id)
                    resp.set_idle_timeout(stream_silence_s(gw.cfg, inst))
                if parts:
                    yield b"".join(parts)
            if call.cut is not None and call.relayed is resp:
                call.cut()  # a move waited for this token: it cuts over now
        resp.release()
        ended = True
        num_tokens = (
            num_stream_tokens(num_events, call, ended) if state is None else state.num_tokens
        )
        gw.stream_done(call, inst, t_first, t_last, num_tokens, state is None)
    finally:
        call.relayed = None
        resp.release()  # aborts the upstream request if the client went away
        if call.continuing:  # ended (or the client left) before its first token there
            call.continuing = False
            gw.unfence(inst.url, call.id)
        if live:
            gw.finish(inst, call, status)
        num_out = num_stream_tokens(num_events, call, ended) if state is None else state.num_tokens
        gw.end_call(call, num_out)


def num_stream_tokens(num_events: int, call: Call, ended: bool) -> int:
    """The tokens of a stream relayed as is, from its count of events, unparsed: one event a
    token (the last one carries the finish_reason, as vLLM's and the sim engine's do), less
    chat's first event (the role only) and, when the stream `ended`, its [DONE] and the
    usage chunk `stream_options.include_usage` asked for. (Two events less for every
    stream undercounted a completion by one and overcounted a chat with usage by one: the
    tenant's settlement and the measured TPOT read this.)"""
    num = num_events - (1 if call.chat else 0)
    if ended:
        num -= 2 if call.include_usage else 1
    return max(0, num)


def move_relayed(call: Call, move: Move) -> str:
    """Move a stream the failover pump relays (one moved or continued before): its response
    is cut, and the pump, seeing `call.move`, carries the move out as `_moved` says."""
    resp = call.relayed
    if resp is None:
        return "not_running"
    call.move = move
    call.relayed = None
    resp.release()  # the pump's next read fails: a move, not a failure (call.move is set)
    return move.method


async def warm_up(gw: RelayHost, call: Call, target: str, timeout_s: float) -> WarmOutcome:
    """Pre-copy for a recompute move (as a live VM migration pre-copies memory): send the
    destination the continuation the move will send (the prompt and the text generated so
    far, through the same body builder, so the same tokens), for one token, not streamed,
    ahead of its queue, while the stream keeps generating on the source. When it returns,
    the destination's prefix cache holds the context's full blocks (a finished request's
    blocks stay cached, evictable), and the real continuation prefills only the few tokens
    generated meanwhile: the client's pause is about one engine step, not one prefill.
    "warmed" when the warm-up finished within `timeout_s`; else (or "skipped" when the
    destination has no free slot, where the warm-up would only queue) the move cuts over
    unwarmed. First it waits while a move cuts over to the destination (its prefill would
    share the moved stream's step; `cut_over.fence_wait_s`, at most `MAX_FENCE_S` in all, not
    counted in `timeout_s`, which bounds the prefill's wait and run). Each outcome
    is counted (`flexpipe_move_warm_ups_total`)."""
    outcome = await _warm_up(gw, call, target, timeout_s)
    gw.count_warm_up(outcome)
    return outcome


async def _warm_up(gw: RelayHost, call: Call, target: str, timeout_s: float) -> WarmOutcome:
    if timeout_s <= 0:
        return "skipped"
    # a move cuts over there: the warm-up's prefill waits for its fence to end or be lifted
    # (polled), MAX_FENCE_S at most in all, on top of its own bound (cut_over.py)
    t_fence = gw.clock()
    while (inst := gw.instance(target)) is not None and (
        wait_s := fence_wait_s(
            inst.fenced_until_s, now := gw.clock(), MAX_FENCE_S - (now - t_fence)
        )
    ) > 0:
        await asyncio.sleep(min(wait_s, WARM_POLL_S))
    relay = call.relay
    if relay is not None:
        state = sse.summarize(b"".join(relay.sent), call.chat)
    elif call.stream_state is not None:
        state = call.stream_state
    else:
        return "skipped"
    if state.finished or timeout_s <= 0:
        return "skipped"
    body = sse.continuation_body(call.body, state, call.chat, gw.cfg.default_expected_output_tokens)
    inst = gw.instance(target)
    if inst is None:
        return "skipped"
    if body is None or not warms(timeout_s, inst.num_slots, inst.num_in_flight):
        return "skipped"
    for key in ("max_completion_tokens", "max_tokens"):
        if key in body:
            body[key] = 1
    body.setdefault("max_tokens", 1)
    for key in ("stream_options", "min_tokens", "n", "logprobs", "top_logprobs"):
        body.pop(key, None)
    body["stream"] = False
    body["priority"] = MOVE_PRIORITY
    headers = {"content-type": "application/json"}
    if inst.api_key:
        headers["authorization"] = f"Bearer {inst.api_key}"
    t0 = gw.clock()
    outcome: WarmOutcome
    gw.warm_up_began(inst.url)  # a cut-over there waits for it (`moves.between_prefills`)
    try:
        async with asyncio.timeout(timeout_s):
            ok = await _send_warm_up(gw, inst.url, call.path, body, headers)
        outcome = "warmed" if ok else "failed"
    except TimeoutError:
        outcome = "timed_out"
    finally:
        gw.warm_up_ended(inst.url)
    took_s = gw.clock() - t0
    log.info("warm-up of a move to %s: %s in %.3f s", inst.url, outcome, took_s)
    return outcome


async def _send_warm_up(
    gw: RelayHost, url: str, path: str, body: dict[str, Any], headers: dict[str, str]
) -> bool:
    while True:
        try:
            resp = await gw.post(url, path, orjson.dumps(body), headers)
        except UpstreamError:
            return False
        try:
            detail = await _safe_read(resp)
        finally:
            resp.release()  # cancelled at the bound: aborts the warm-up on the engine
        if resp.status == 200:
            return True
        if resp.status == 400 and _NO_PRIORITY.encode() in detail and "priority" in body:
            del body["priority"]  # an engine not started with the priority policy
            continue
        return False


async def migrate(
    gw: RelayHost, call: Call, failed: Instance, state: sse.StreamState
) -> tuple[Instance, UpstreamResponse] | bytes:
    """Continue a broken stream on another live instance (each failed one is out for
    this call, and a target that cannot be reached is skipped for the next); on
    failure, the error event and [DONE] to end the client's stream with."""
    if gw.shutting_down:
        return sse.error_event("the gateway is shutting down", 503) + sse.DONE
    move, call.move = call.move, None
    if move is not None:
        return await _moved(gw, call, failed, state, move)
    if call.num_migrations >= gw.cfg.max_migrations:
        gw.count_migration("failed")
        return sse.error_event("the instance serving this stream failed") + sse.DONE
    body = sse.continuation_body(call.body, state, call.chat, gw.cfg.default_expected_output_tokens)
    if body is None:  # nothing left to generate, or a prompt that cannot be continued
        if state.num_tokens and state.id:
            gw.count_migration("ok")
            return _final_event(state, call.chat) + sse.DONE
        gw.count_migration("failed")
        return sse.error_event("the instance serving this stream failed") + sse.DONE
    call.num_migrations += 1
    call.num_retries = 0  # the continuation may retry a busy target once, as a request
    state.num_tokens_at_join = state.num_tokens
    try:
        inst, resp = await gw.send(call, orjson.dumps(body))
    except HttpError as exc:
        gw.count_migration("failed")
        return sse.error_event(f"could not continue the stream: {exc.message}") + sse.DONE
    if resp.status != 200:
        detail = (await _safe_read(resp))[:200].decode("utf-8", "replace")
        resp.release()
        gw.finish(inst, call, str(resp.status))
        gw.count_migration("failed")
        return sse.error_event(f"could not continue the stream: {detail}") + sse.DONE
    gw.count_migration("ok")
    call.upstream_request_id = resp.headers.get("x-request-id")
    log.info("continued a stream from %s on %s", failed.url, inst.url)
    return inst, resp


async def _moved(
    gw: RelayHost, call: Call, source: Instance, state: sse.StreamState, move: Move
) -> tuple[Instance, UpstreamResponse] | bytes:
    """Carry out a controller's move: with the KV cache when the engine exported it and it
    covers every token the client has (else by recompute), on `move.target` if it can."""
    export, call.export = call.export, None
    method = move.method
    body: dict[str, Any] | None
    num_here = state.num_tokens - state.num_tokens_at_join  # what this engine generated
    if method == "kv" and export is not None and _covers(export, num_here):
        body = sse.import_body(call.body, export, state, move.bandwidth_bytes_per_s, move.latency_s)
    else:
        method = "recompute"
        body = sse.continuation_body(
            call.body, state, call.chat, gw.cfg.default_expected_output_tokens
        )
    if body is None:  # nothing left to generate
        return _final_event(state, call.chat) + sse.DONE
    state.num_tokens_at_join = state.num_tokens
    state.completion_events = method == "kv" and call.chat  # import answers as completions
    call.num_retries = 0
    call.move = Move(method, move.target)  # the target is taken, even at its limit
    path = "/admin/import" if method == "kv" else None
    body["priority"] = MOVE_PRIORITY
    try:
        while True:
            inst, resp = await gw.send(call, orjson.dumps(body), path, admin=method == "kv")
            if resp.status == 200:
                break
            detail = (await _safe_read(resp))[:200].decode("utf-8", "replace")
            resp.release()
            gw.finish(inst, call, str(resp.status))
            if resp.status == 400 and _NO_PRIORITY in detail and "priority" in body:
                del body["priority"]  # an engine not started with the priority policy
                continue
            gw.count_migration("failed")
            return sse.error_event(f"could not move the stream: {detail}") + sse.DONE
    except HttpError as exc:
        gw.count_migration("failed")
        return sse.error_event(f"could not move the stream: {exc.message}") + sse.DONE
    finally:
        call.move = None
    call.upstream_request_id = resp.headers.get("x-request-id")
    call.moved_by.append(method)
    gw.count_migration("moved")
    log.info("moved a stream from %s to %s (%s)", source.url, inst.url, method)
    return inst, resp


def _covers(export: dict[str, Any], num_tokens: int) -> bool:
    out = export.get("output_token_ids")
    return isinstance(out, list) and len(out) >= num_tokens


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
