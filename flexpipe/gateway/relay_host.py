"""What a stream's relay (relay.py) and a move (moves.py) may use of the gateway: the calls
they make, and nothing else of it.

Both used to take the whole `Gateway` and reach into its fields (its pool, metrics, client,
its sets of relays and tasks, its warm-up counts). Typed against these Protocols they see a
call table: the gateway's accounting (`finish`, `end_call`, `stream_done`, `failure`), its
routing and sending (`send`), the bookkeeping they report to (`relay_started`,
`keep_task`, `warm_up_began`), the instance records they read and fence, and an upstream
POST. `Gateway` implements both; a test passes any object with the calls it needs.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from flexpipe.gateway.call import Call
from flexpipe.gateway.config import GatewayConfig
from flexpipe.gateway.core.pool import Instance
from flexpipe.http.client import Timeouts, UpstreamResponse

if TYPE_CHECKING:
    from flexpipe.gateway.relay import PushRelay

__all__ = ["MoveHost", "RelayHost"]


class RelayHost(Protocol):
    """What relay.py uses of the gateway."""

    @property
    def cfg(self) -> GatewayConfig: ...

    @property
    def shutting_down(self) -> bool: ...

    def clock(self) -> float: ...

    async def send(
        self, call: Call, raw: bytes, path: str | None = None, admin: bool = False
    ) -> tuple[Instance, UpstreamResponse]:
        """Route and send (admission, failover and retries included)."""
        ...

    def finish(self, inst: Instance, call: Call, status: str) -> None:
        """`inst` no longer counts `call` (one `finish` per instance the call was sent to)."""

    def end_call(self, call: Call, num_output_tokens: int | None = None) -> None:
        """The call ended (exactly once)."""

    def failure(self, inst: Instance) -> None:
        """A passive failure of `inst` (a broken stream)."""

    def stream_done(
        self,
        call: Call,
        inst: Instance,
        t_first: float,
        t_last: float,
        num_tokens: int,
        measured_speed: bool,
    ) -> None:
        """A stream ended well on `inst`."""

    def relay_started(self, relay: PushRelay) -> None:
        """A push relay runs (the gateway aborts it when it stops)."""

    def relay_ended(self, relay: PushRelay) -> None: ...

    def keep_task(self, task: asyncio.Task[None]) -> None:
        """A failover pump runs in `task` (cancelled when the gateway stops); forgotten when
        it ends."""

    def instance(self, url: str) -> Instance | None:
        """The pool's record of `url`, None when it is not in the pool."""

    def unfence(self, url: str, key: object) -> None:
        """A move (`key`) is through on `url` (`Pool.unfence`)."""

    def observe_ttft(self, model: str, ttft_s: float) -> None: ...

    def count_migration(self, outcome: str) -> None:
        """`flexpipe_migrations_total{outcome}`: ok, failed or moved."""

    def count_warm_up(self, outcome: str) -> None:
        """`flexpipe_move_warm_ups_total{outcome}`."""

    def warm_up_began(self, url: str) -> None:
        """A move's warm-up runs on `url` (a cut-over there waits for it)."""

    def warm_up_ended(self, url: str) -> None: ...

    async def post(
        self,
        url: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        timeouts: Timeouts | None = None,
    ) -> UpstreamResponse:
        """POST to an instance on the gateway's pooled client (`timeouts` None: the
        gateway's own)."""
        ...


class MoveHost(RelayHost, Protocol):
    """What moves.py uses of the gateway (and, for warm-ups, what relay.py does)."""

    def call(self, call_id: int) -> Call | None:
        """An accepted request not yet ended, by id."""

    def calls_on(self, url: str) -> list[Call]:
        """The requests an instance serves now."""
        ...

    def num_warm_ups_on(self, url: str) -> int:
        """Moves' warm-ups running on `url` now."""
        ...

    def engine_admin_token(self, url: str) -> str | None:
        """The admin token of the engine at `url` (its KV export), if registered."""

    def fence(self, url: str, key: object, until_s: float, now: float) -> None:
        """New requests keep off `url` while a move cuts over there (`Pool.fence`)."""
