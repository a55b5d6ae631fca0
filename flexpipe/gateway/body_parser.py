"""A request body reduced to what routing and accounting need, validated on the event loop
when small and in a parser process when large: a 4 MiB body of many small message parts takes
~300 ms to validate, and on the event loop (or a thread: pydantic and orjson hold the GIL for
long stretches) it froze every stream the gateway relays (docs/gateway.md)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor
from typing import Any, NamedTuple

from flexpipe.gateway.core.admission import num_prompt_tokens
from flexpipe.policies.routing import prompt_block_hashes
from flexpipe.protocol import ValidRequest, parse_chat_request, parse_completion_request

__all__ = [
    "PARSE_OFF_LOOP_BYTES",
    "BodyParser",
    "BodySummary",
    "summarize",
    "summarize_body",
    "validate_body",
]

log = logging.getLogger("flexpipe.gateway")

# request bodies larger than this are validated in a parser process, not on the event loop:
# a 256 KiB body validates in ~13 ms at worst (thousands of small message parts); below it,
# sending a body to a process and back would cost more than the stall it saves (a common 1 KiB
# body validates in 0.016 ms)
PARSE_OFF_LOOP_BYTES = 256 * 1024
_NUM_PARSER_PROCESSES = 2  # large bodies validated at once; the rest wait their turn
_PARENT_CHECK_S = 1.0  # how often a parser process looks for its gateway


def _exit_with_parent(parent_pid: int) -> None:
    """A parser process's initializer: it exits once its gateway is gone. A gateway killed
    (kill -9, or ended before it shut its pool down) would otherwise leave it waiting for work
    forever: it holds both ends of its call queue's pipe, so it never reads an end of file."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-gateway", daemon=True).start()


class BodySummary(NamedTuple):
    """What routing and accounting need of a request body: small, so it crosses from a
    parser process cheaply (the body itself is parsed again only if a move needs it)."""

    model: str
    stream: bool
    max_tokens: int | None
    user: str
    include_usage: bool
    num_prompt_tokens: int
    block_hashes: tuple[int, ...]


def validate_body(raw: bytes, content_type: str | None, chat: bool) -> ValidRequest[Any]:
    """The body validated against the OpenAI schema (RequestError: a 400 naming the field)."""
    parse = parse_chat_request if chat else parse_completion_request
    return parse(raw, content_type)


def summarize(valid: ValidRequest[Any], block_chars: int) -> BodySummary:
    prompt = valid.prompt_bytes
    return BodySummary(
        valid.model,
        valid.stream,
        valid.max_tokens,
        valid.user,
        valid.include_usage,
        num_prompt_tokens(len(prompt)),
        prompt_block_hashes(prompt, block_chars),
    )


def summarize_body(
    raw: bytes, content_type: str | None, chat: bool, block_chars: int
) -> BodySummary:
    """`validate_body` then `summarize`, in one call a parser process runs (pure: no state)."""
    return summarize(validate_body(raw, content_type, chat), block_chars)


class BodyParser:
    """The parser processes, started at the first large body and stopped with the gateway."""

    def __init__(self) -> None:
        self._parsers: ProcessPoolExecutor | None = None

    async def summarize(
        self, raw: bytes, content_type: str | None, chat: bool, block_chars: int
    ) -> BodySummary:
        """`summarize_body` in a parser process (started at the first large body); a pool
        whose process died is replaced once."""
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            if self._parsers is None:
                context = multiprocessing.get_context("spawn")  # no fork of a threaded loop
                self._parsers = ProcessPoolExecutor(
                    _NUM_PARSER_PROCESSES,
                    mp_context=context,
                    initializer=_exit_with_parent,
                    initargs=(os.getpid(),),
                )
            parsers = self._parsers
            try:
                return await loop.run_in_executor(
                    parsers, summarize_body, raw, content_type, chat, block_chars
                )
            except BrokenExecutor:
                log.warning("a request parser process died: starting another")
                if self._parsers is parsers:
                    self._parsers = None
                parsers.shutdown(wait=False, cancel_futures=True)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._parsers is not None:
            self._parsers.shutdown(wait=False, cancel_futures=True)
            self._parsers = None
