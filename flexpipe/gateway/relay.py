"""Streams through the gateway: the push relay (the hot path) and the warm-up of a recompute
move's destination.

The push relay: the upstream connection's callback hands each chunk straight to the client's
`ChunkWriter` (no task woken, no await per chunk), cut at event boundaries so a failure never
leaves half an event at the client. A mid-stream failure hands the stream to a task running
`relay_after_failure` (failover.py), which continues it on another live instance. Both see
the gateway through its call table for relays (relay_host.py `RelayHost`), never its fields.
"""

from __future__ import annotations

import asyncio
import logging
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
from flexpipe.gateway.failover import (
    _NO_PRIORITY,
    _safe_read,
    num_stream_tokens,
    relay_after_failure,
    stream_silence_s,
)
from flexpipe.http.client import UpstreamError, UpstreamResponse
from flexpipe.http.server import ChunkWriter

if TYPE_CHECKING:
    from flexpipe.gateway.relay_host import RelayHost

log = logging.getLogger("flexpipe.gateway")

__all__ = ["PushRelay", "warm_up"]


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
