"""One client request on its way through the gateway: what it asked, what it holds, which
instances failed it. Plain data shared by the proxy (`app`) and the stream relay (`relay`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from flexpipe.gateway.sse import StreamState
from flexpipe.gateway.tenants import Tenant
from flexpipe.http.client import UpstreamResponse
from flexpipe.policies.routing import RoutingRequest

if TYPE_CHECKING:
    from flexpipe.gateway.relay import PushRelay


@dataclass(frozen=True, slots=True)
class Move:
    """A move of an in-flight request the controller asked for (drain deadline of a shift):
    "kv" carries the request's KV cache to `target` (the engine's export/import hooks),
    "recompute" continues it there from its text; `target` None lets routing choose."""

    method: str  # "kv" | "recompute"
    target: str | None = None
    bandwidth_bytes_per_s: float | None = None  # the link between the two instances (kv)
    latency_s: float = 0.0
    # recompute: how long the destination may take to pre-fill its prefix cache with the
    # context before the stream is cut over (`relay.warm_up`); None: the gateway's default,
    # 0: no warm-up (cut over at once)
    warm_timeout_s: float | None = None
    # recompute: the longest it waits for its source's next token before cutting over
    # (`cut_over.token_wait_s`); None: the gateway's default, 0: cut over at once
    max_token_wait_s: float | None = None


@dataclass(slots=True, eq=False)
class Call:
    """One client request on its way through the gateway."""

    path: str
    chat: bool
    model: str
    json_body: dict[str, Any] | None  # the body as parsed (None: not yet, see `body`)
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
    ended: bool = False  # `Gateway.end_call` done
    id: int = 0  # the gateway's own, for the admin API
    instance: str | None = None  # the instance serving it now (None while queued)
    upstream_request_id: str | None = None  # the engine's id of it (x-request-id)
    first_request_id: str | None = None  # the first engine's: the stream id the client sees
    relay: PushRelay | None = None  # its push relay while one streams it
    relayed: UpstreamResponse | None = None  # what the failover pump relays (after a move)
    stream_state: StreamState | None = None  # the failover pump's view of what was sent
    move: Move | None = None  # asked for and not yet carried out
    # the request's own task while it waits for the engine's response head (a move cancels it)
    sending: asyncio.Task[Any] | None = None
    move_cancels: bool = False  # a move cancelled `sending`: its task takes it back
    export: dict[str, Any] | None = None  # the engine's exported state for a "kv" move
    moved_by: list[str] = field(default_factory=list)  # methods of the moves done
    # a move waiting for its source's next token (`gateway.moves.at_next_token`): called
    # right after the relay hands the client an event from the source
    cut: Callable[[], None] | None = None
    # continued on `instance` (moved, or failed over) and no token from there yet: its context
    # is being prefilled there (the failover pump's; `relay_after_failure`)
    continuing: bool = False
    include_usage: bool = False  # stream_options.include_usage: the stream ends with usage

    @property
    def body(self) -> dict[str, Any]:
        """The request body as a dict. A large body was validated in a parser process
        (`Gateway._parse`), and is parsed here again only when a move or a continuation
        needs it."""
        if self.json_body is None:
            self.json_body = orjson.loads(self.raw)
        return self.json_body

    @property
    def awaits_first_token(self) -> bool:
        """A stream on an instance that has sent it nothing yet: its prompt (or, continued
        there after a move or a failure, its whole context) is being prefilled there, or waits
        to be."""
        if not self.stream or self.instance is None:
            return False
        if self.continuing:  # a continuation's prefill of its whole context, as the simulator
            return True  # counts it (`sim.moves.Moves.awaits_first_token`)
        if self.relay is not None:
            return self.relay.num_tokens_sent == 0
        return self.stream_state is None

    def describe(self) -> dict[str, Any]:
        """What the controller needs to price a move of this request."""
        sent = self.relay.num_tokens_sent if self.relay is not None else 0
        if self.relay is None and self.stream_state is not None:
            sent = self.stream_state.num_tokens
        return {
            "id": self.id,
            "model": self.model,
            "instance": self.instance,
            "stream": self.stream,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": sent,
            "max_tokens": self.routing.num_expected_output_tokens,
            "moved_by": list(self.moved_by),
            "request_id": self.first_request_id,
        }
