"""What gateway workers and replicas share, behind one small seam (docs/gateway.md, "Workers
and replicas").

A gateway alone (one worker, no replicas) shares nothing and has no `SharedState`: its hot
path pays no hop. Several workers on one host (`flexpipe gateway --workers N`) share through
the embedded backend (state_service.py: the supervisor's state service on a Unix socket);
replicas on several hosts through Redis (redis_state.py). Both give:

- the control log: every admin change of the pool, holds and refusals (`ControlOp`), applied
  by the member the controller called, published, applied by every other member, and
  replayed (compacted) to a member that starts later: a restarted worker resyncs from it;
- tenant budgets decided in one place (requests/min, tokens/min, concurrency: exact, whatever
  member a request lands on; a member that dies gives its concurrency back);
- the prefix index's inserts, published so that every member's index learns every routing
  decision (the same prompt prefix goes to the same instance from any member);
- questions to every other member (`ask_peers`): has an instance drained, which requests
  does it serve, move this request, the wait queue's demand, the metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

__all__ = [
    "CALL_ID_SALT_BITS",
    "ControlOp",
    "OnAsk",
    "OnOp",
    "OnPrefix",
    "SharedState",
    "SharedStateDown",
    "TenantVerdict",
    "admit_shared",
    "call_ids",
    "compact",
    "op_key",
    "reads_prefixes",
    "seconds_left",
]

ControlOp = dict[str, Any]  # {"op": add|state|remove|weight|hold|refuse, ...}: control_ops.py
TenantVerdict = tuple[bool, float, str]  # (admitted, retry_after_s, why-not): Tenant.admit
OnOp = Callable[[ControlOp], None]
OnPrefix = Callable[[str, tuple[int, ...]], None]
OnAsk = Callable[[str, dict[str, Any]], Awaitable[Any]]


class SharedState(Protocol):
    """The seam: one implementation per backend (embedded, Redis)."""

    @property
    def member(self) -> str:
        """This member's name (worker index or replica id): in logs and call ids."""
        ...

    @property
    def member_salted(self) -> bool:
        """Members cannot be numbered (replicas on several hosts): request ids are salted."""
        ...

    @property
    def up(self) -> bool:
        """The shared state can be reached now (`flexpipe_shared_state_up`)."""
        ...

    @property
    def num_outages(self) -> int:
        """Times it was lost since this member started (`..._outages_total`)."""
        ...

    async def start(self, on_op: OnOp, on_prefix: OnPrefix, on_ask: OnAsk) -> list[ControlOp]:
        """Join: returns the control log so far (compacted, in order); from now on every op
        another member publishes reaches `on_op`, every prefix insert `on_prefix`, every
        question `on_ask`."""
        ...

    def publish(self, op: ControlOp) -> None:
        """An admin change applied here: into the log, and to every other member."""
        ...

    def share_prefix(self, url: str, hashes: tuple[int, ...]) -> None:
        """This member routed a prompt with these blocks to `url` (fire and forget)."""
        ...

    async def tenant_admit(self, name: str, num_tokens: float) -> TenantVerdict:
        """Take a request slot and its estimated tokens from `name`'s budget, or say why not;
        raises `SharedStateDown` when the budget cannot be decided."""
        ...

    def tenant_end(self, name: str, charged_tokens: float, used_tokens: float) -> None:
        """A request admitted by `tenant_admit` ended: its slot back, its tokens settled."""
        ...

    async def ask_peers(
        self, kind: str, body: dict[str, Any], timeout_s: float, first: bool = False
    ) -> list[Any]:
        """Every other member's answer to a question (those that answered within
        `timeout_s`); `first`: as soon as one answers something truthy."""
        ...

    async def close(self) -> None: ...


class SharedStateDown(Exception):
    """The shared state cannot be reached (budgets fail closed unless configured open)."""


async def admit_shared(shared: SharedState, tenant_id: str, num_tokens: float) -> TenantVerdict:
    """`shared.tenant_admit`, and when the client leaves while the answer is on its way, a
    slot taken for it goes back (`tenant_end`, nothing used) as soon as the answer comes."""
    admitting = asyncio.ensure_future(shared.tenant_admit(tenant_id, num_tokens))
    try:
        return await asyncio.shield(admitting)
    except asyncio.CancelledError:

        def give_back(fut: asyncio.Future[TenantVerdict]) -> None:
            if not fut.cancelled() and fut.exception() is None and fut.result()[0]:
                shared.tenant_end(tenant_id, num_tokens, 0)

        admitting.add_done_callback(give_back)
        raise


CALL_ID_SALT_BITS = 20


def call_ids(shared: SharedState | None, worker: tuple[int, int]) -> Iterator[int]:
    """Request ids (the admin API's, which a move names): 1, 2, 3... alone; interleaved
    between the workers of one host (worker i of N: i + 1, i + 1 + N...); for a replica
    sharing through Redis, its own random residue modulo 2^20 (replicas cannot agree on
    an index: two collide with a chance of one in a million)."""
    if shared is not None and shared.member_salted:
        salt = random.SystemRandom().getrandbits(CALL_ID_SALT_BITS)
        return itertools.count((1 << CALL_ID_SALT_BITS) + salt, 1 << CALL_ID_SALT_BITS)
    return itertools.count(worker[0] + 1, worker[1])


def reads_prefixes(policy: object) -> bool:
    """Whether a routing policy reads the prefix index (prefix_affinity, or a composite
    with the `prefix` scorer): only then are routing decisions' blocks published (round
    robin and the load policies share nothing per request)."""
    from flexpipe.policies.routing.composite import Composite
    from flexpipe.policies.routing.prefix_affinity import PrefixAffinity, PrefixScorer

    if isinstance(policy, Composite):
        return any(isinstance(scorer, PrefixScorer) for scorer, _ in policy.scorers)
    return isinstance(policy, PrefixAffinity | PrefixScorer)


def seconds_left(op: ControlOp, now_wall_s: float | None = None) -> float:
    """A hold's or refusal's seconds, less the time since it was issued (`at_wall_s`, wall
    clock: members of one deployment on several hosts share no monotonic clock)."""
    now_wall_s = time.time() if now_wall_s is None else now_wall_s
    return max(0.0, float(op["seconds"]) - max(0.0, now_wall_s - float(op["at_wall_s"])))


def op_key(op: ControlOp) -> str:
    """What an op is about: an instance or a model."""
    return f"url:{op['url']}" if "url" in op else f"model:{op['model']}"


def compact(log: list[ControlOp], op: ControlOp) -> list[ControlOp]:
    """The log with `op` appended and what it makes moot dropped, so that a member replaying
    it ends in the same state with a log bounded by the pool and the models, not by time:
    an `add` or `remove` of an instance drops everything before it about that instance; a
    `weight` the weights before it; a `hold` the holds and a `refuse` the refusals of its
    model before it (each is renewed every tick). State changes since the instance's `add`
    stay, in order (the lifecycle is checked on every step)."""
    key, kind = op_key(op), op["op"]
    if kind in ("add", "remove"):
        out = [o for o in log if op_key(o) != key]
    elif kind in ("weight", "hold", "refuse"):
        out = [o for o in log if not (o["op"] == kind and op_key(o) == key)]
    else:
        out = list(log)
    out.append(op)
    return out
