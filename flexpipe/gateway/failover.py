"""A stream's continuation on another live instance when the one serving it fails, or when
the controller moves it: `relay_after_failure` parses what was relayed, asks `migrate` (or,
for a move, `_moved`) for a continuation and rewrites its events into the client's stream
(sse.py). The push relay (relay.py) hands a stream here in a task at its first failure; both
see the gateway through its call table for relays (relay_host.py `RelayHost`). Also the
stream facts both read: its silence bound and its tokens counted from its events.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import orjson

from flexpipe.gateway import sse
from flexpipe.gateway.call import Call, Move
from flexpipe.gateway.core.pool import Instance
from flexpipe.gateway.core.warm_up import MOVE_PRIORITY
from flexpipe.http.client import UpstreamError, UpstreamResponse
from flexpipe.http.server import HttpError

if TYPE_CHECKING:
    from flexpipe.gateway.config import GatewayConfig
    from flexpipe.gateway.relay_host import RelayHost

log = logging.getLogger("flexpipe.gateway")

__all__ = [
    "STREAM_SILENCE_TPOTS",
    "migrate",
    "move_relayed",
    "num_stream_tokens",
    "relay_after_failure",
    "stream_silence_s",
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
