"""Streams pushed by the engine loop: SSE chunks written right after each step.

The engine loop calls `on_progress(req)` on a request's sink when the request has new tokens
or has finished. `SseStream` formats the new tokens as one OpenAI/vLLM SSE event and writes
it straight to the client's connection (`flexpipe.http.server.ChunkWriter`): no task is woken
per token, so 256 streams cost one loop pass and one socket write each per step.

- Back-pressure: while the client's socket buffer is full the tokens are held back (they stay
  in the request) and go out in one write when the buffer drains, still one SSE event per
  token (one event for the new text when stop strings are set).
- Disconnect: the writer's `on_close` aborts the request at once (its KV blocks are freed).
- An error before anything was sent (a request that can never fit) answers a 400 error body.
- `stream_options.include_usage`: a last chunk with the usage and no choices; with
  `continuous_usage_stats` as well, every chunk also carries the usage so far (vLLM's rule:
  continuous usage needs include_usage).

`FinishSink` is the non-streaming counterpart: it resolves a future once, at the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from flexpipe.engine.request import EngineRequest, Status
from flexpipe.http.server import ChunkWriter

if TYPE_CHECKING:
    from flexpipe.engine.runner import Engine

_DONE = b"data: [DONE]\n\n"
_TAIL_OPEN = b',"stop_reason":null}]}\n\n'


class FinishSink:
    """Wakes a non-streaming handler once, when its request finishes (not per token)."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future

    def on_progress(self, req: EngineRequest) -> None:
        if req.status is Status.FINISHED and not self.future.done():
            self.future.set_result(None)


class SseStream:
    """One streamed completion or chat completion (see the module docstring)."""

    __slots__ = (
        "_chat",
        "_continuous_usage",
        "_created",
        "_engine",
        "_first",
        "_frag_json",
        "_frags",
        "_head",
        "_include_usage",
        "_mid",
        "_model",
        "_rid",
        "_sent",
        "_sent_chars",
        "_text",
        "_usage",
        "ereq",
        "writer",
    )

    def __init__(
        self,
        engine: Engine,
        ereq: EngineRequest,
        chat: bool,
        strip_first: bool,
        include_usage: bool,
        continuous_usage: bool,
        created: int,
        model_json: bytes,
        frags: dict[int, str],
        frag_json: dict[int, bytes],
        text: Callable[[EngineRequest, int], str],
        usage: Callable[[EngineRequest], dict[str, Any]],
    ) -> None:
        """`frags`: token id -> its text; `frag_json`: the same as JSON strings; `text(ereq,
        upto)`: the output text of the first `upto` tokens with stop strings applied;
        `usage(ereq)`: the usage dict."""
        self._engine = engine
        self.ereq = ereq
        self._chat = chat
        self._include_usage = include_usage
        self._continuous_usage = include_usage and continuous_usage
        self._created = created
        self._model = model_json
        self._frags = frags
        self._frag_json = frag_json
        self._text = text
        self._usage = usage
        self._rid = (("chatcmpl-" if chat else "cmpl-") + ereq.request_id).encode()
        if chat:
            self._head = (
                b'data: {"id":"%s","object":"chat.completion.chunk","created":%d,"model":%s,'
                b'"choices":[{"index":0,"delta":{"content":' % (self._rid, created, model_json)
            )
            self._mid = b'},"logprobs":null,"finish_reason":'
        else:
            self._head = (
                b'data: {"id":"%s","object":"text_completion","created":%d,"model":%s,'
                b'"choices":[{"index":0,"text":' % (self._rid, created, model_json)
            )
            self._mid = b',"logprobs":null,"finish_reason":'
        self._sent = 0  # output tokens sent
        self._sent_chars = 0  # text characters sent (stop-string path)
        self._first = strip_first  # the first token's leading space is still to strip
        self.writer: ChunkWriter | None = None

    # --- the HTTP side -------------------------------------------------------------------
    def start(self, writer: ChunkWriter) -> None:
        """PushResponse's start: the connection is ready for this response."""
        self.writer = writer
        writer.on_close = self._on_close
        writer.on_resume = self._flush
        if self._chat:
            writer.write(
                b'data: {"id":"%s","object":"chat.completion.chunk","created":%d,"model":%s,'
                b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                b'"logprobs":null,"finish_reason":null}]%s}\n\n'
                % (self._rid, self._created, self._model, self._usage_so_far(0))
            )
        self._flush()  # tokens made before the connection got to this response

    def _usage_so_far(self, num_out: int) -> bytes:
        """The `,"usage":{...}` of a chunk after `num_out` tokens (continuous usage only)."""
        if not self._continuous_usage:
            return b""
        num_prompt = self.ereq.num_prompt_tokens
        return b',"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}' % (
            num_prompt,
            num_prompt + num_out,
            num_out,
        )

    def _on_close(self) -> None:
        ereq = self.ereq
        if ereq.status is not Status.FINISHED:
            self._engine.abort(ereq)
        else:
            self._engine.release(ereq)

    # --- the engine side -----------------------------------------------------------------
    def on_progress(self, req: EngineRequest) -> None:
        """Called by the engine loop after a step gave `req` a token or finished it."""
        writer = self.writer
        if writer is not None and writer.writable:
            self._flush()
        # else: not started yet, or the socket buffer is full: start/on_resume flushes

    def _flush(self) -> None:
        writer = self.writer
        if writer is None or writer.closed:
            return
        ereq = self.ereq
        start = ereq.num_prompt_tokens
        n_out = len(ereq.token_ids) - start
        finished = ereq.status is Status.FINISHED
        sent = self._sent
        if n_out == sent and not finished:
            return
        if ereq.finish_reason == "error":
            self._engine.release(ereq)
            writer.fail(400, ereq.error or "request failed")
            return
        strip = self._first  # a chat reply does not start with a space
        self._first = False
        self._sent = n_out
        if ereq.params.stop:
            # stop strings cut text, not tokens: one event with the new text
            full = self._text(ereq, n_out)
            piece = full[self._sent_chars :]
            self._sent_chars = len(full)
            pieces = [orjson.dumps(piece.lstrip(" ") if strip else piece)]
        else:
            # one event per token, as each step sends it (several when they queued up)
            frag_json = self._frag_json
            pieces = [frag_json.get(t, b'""') for t in ereq.token_ids[start + sent :]]
            if strip and pieces:
                first = self._frags.get(ereq.token_ids[start + sent], "").lstrip(" ")
                pieces[0] = orjson.dumps(first)
        head = self._head
        if self._continuous_usage:
            return self._flush_with_usage(writer, pieces, n_out, finished)
        open_tail = self._mid + b"null" + _TAIL_OPEN
        if not finished:
            if len(pieces) == 1:
                writer.write(head + pieces[0] + open_tail)
            else:
                writer.write(b"".join([head + p + open_tail for p in pieces]))
            return
        last = pieces.pop() if pieces else b'""'
        dumps = orjson.dumps
        out = b"".join([head + p + open_tail for p in pieces]) + (
            head
            + last
            + self._mid
            + dumps(ereq.finish_reason)
            + b',"stop_reason":%s}]}\n\n' % dumps(ereq.stop_reason)
        )
        self._end(writer, out)

    def _flush_with_usage(
        self, writer: ChunkWriter, pieces: list[bytes], n_out: int, finished: bool
    ) -> None:
        """`_flush` with continuous usage stats: each event carries the usage after it (one
        event per token: one more token each; one event of new text: all of them)."""
        ereq = self.ereq
        head = self._head
        open_tail = self._mid + b'null,"stop_reason":null}]'
        if ereq.params.stop:
            counts = [n_out] * len(pieces)
        else:
            counts = list(range(n_out - len(pieces) + 1, n_out + 1))
        usage = self._usage_so_far
        events = [
            head + p + open_tail + usage(n) + b"}\n\n" for p, n in zip(pieces, counts, strict=True)
        ]
        if not finished:
            writer.write(b"".join(events))
            return
        last = pieces[-1] if pieces else b'""'
        if events:
            events.pop()
        dumps = orjson.dumps
        events.append(
            head
            + last
            + self._mid
            + dumps(ereq.finish_reason)
            + b',"stop_reason":%s}]' % dumps(ereq.stop_reason)
            + usage(n_out)
            + b"}\n\n"
        )
        self._end(writer, b"".join(events))

    def _end(self, writer: ChunkWriter, out: bytes) -> None:
        """The request's last events, the usage chunk when asked for, [DONE]."""
        ereq = self.ereq
        dumps = orjson.dumps
        if self._include_usage:
            out += (
                b'data: {"id":"%s","object":"%s","created":%d,"model":%s,"choices":[],"usage":%s}\n\n'  # noqa: E501
                % (
                    self._rid,
                    b"chat.completion.chunk" if self._chat else b"text_completion",
                    self._created,
                    self._model,
                    dumps(self._usage(ereq)),
                )
            )
        self._engine.release(ereq)
        writer.end(out + _DONE)


__all__ = ["FinishSink", "SseStream"]
