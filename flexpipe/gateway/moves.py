"""Moving an in-flight request off its instance (a shift's drain deadline, POST
/admin/requests/move): a stream continues on the target with its KV cache (the engines'
export/import hooks) or by recompute after warming the target's prefix cache; a request of
which nothing was sent yet is re-run there. Functions of the gateway's call table for moves
(relay_host.py `MoveHost`), as relay.py's `warm_up` is of `RelayHost`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson

from flexpipe.gateway.call import Call, Move
from flexpipe.gateway.core.cut_over import (
    MAX_FENCE_S,
    MAX_TOKEN_WAIT_S,
    fence_until_s,
    mean_gap_s,
    token_wait_s,
)
from flexpipe.gateway.core.warm_up import WARM_POLL_S, WARM_TIMEOUT_S, WarmOutcome
from flexpipe.gateway.failover import move_relayed
from flexpipe.gateway.relay import warm_up
from flexpipe.gateway.sse import kv_link_bytes_per_s
from flexpipe.http.client import Timeouts, UpstreamError

if TYPE_CHECKING:
    from flexpipe.gateway.relay_host import MoveHost


async def move_request(gw: MoveHost, call_id: int, move: Move) -> tuple[str, WarmOutcome | None]:
    """Move an in-flight request off its instance: a stream continues on `move.target` with
    its KV cache ("kv") or by recompute, after warming the target's prefix cache with its
    context (`warm_up`); a non-streamed request, of which nothing was sent yet, is re-run
    there. Returns what was done ("kv", "recompute", "rerun") or why not, and what became of
    the warm-up of a recompute (None: none was tried)."""
    call = gw.call(call_id)
    if call is None or call.instance is None:
        return "not_running", None
    if call.sending is not None:  # the engine has not answered: nothing was sent yet
        call.move = Move("recompute", move.target)
        if not call.move_cancels:  # (a second move before the task resumed: one cancel)
            call.move_cancels = True
            call.sending.cancel()  # aborts the upstream request; sent again to the target
        return "rerun", None
    if not call.stream:
        if call.upstream is None:
            return "not_running", None
        call.move = Move("recompute", move.target)
        call.upstream.release()  # its reader sees the break and re-runs it on the target
        return "rerun", None
    relay, relayed = call.relay, call.relayed  # relayed: continued after a move
    if relay is None and relayed is None:
        return "not_running", None  # being continued elsewhere right now
    if move.method == "kv":
        call.export = await export_state(gw, call.instance, call.upstream_request_id, move)
        if call.export is None:
            move = Move(
                "recompute",
                move.target,
                warm_timeout_s=move.warm_timeout_s,
                max_token_wait_s=move.max_token_wait_s,
            )
    warm: WarmOutcome | None = None
    if move.method == "recompute" and move.target is not None:
        timeout_s = WARM_TIMEOUT_S if move.warm_timeout_s is None else move.warm_timeout_s
        warm = await warm_up(gw, call, move.target, timeout_s)
        if warm == "warmed":
            await between_prefills(gw, move.target, timeout_s)
    if call.relay is not relay or call.relayed is not relayed:
        return "not_running", warm  # ended (or failed over) meanwhile
    # a recompute cuts over at its source's next token; a KV move where its export was taken
    if move.method == "recompute" and move.max_token_wait_s != 0:
        return await at_next_token(gw, call, move), warm
    fence_target(gw, call, move, transfer_s(call.export) if move.method == "kv" else 0.0)
    outcome = relay.move(move) if relay is not None else move_relayed(call, move)
    return outcome, warm


def fence_target(gw: MoveHost, call: Call, move: Move, wait_s: float) -> None:
    """New requests keep off the move's destination while it cuts over there: until the
    stream's first token there (the relay's `Pool.unfence`), at most `wait_s` from now (the
    wait for the source's token, or a KV move's transfer) and the destination's next two
    steps (`cut_over.fence_until_s`)."""
    if move.target is None:
        return
    inst = gw.instance(move.target)
    if inst is not None:
        now = gw.clock()
        until_s = fence_until_s(now, wait_s, inst.speed_tokens_per_s)
        gw.fence(inst.url, call.id, until_s, now)


async def at_next_token(gw: MoveHost, call: Call, move: Move) -> str:
    """Carry out `move` right after the stream's source delivers its next token: the relay
    hands the client that event, then calls `call.cut`, which cuts the stream over at once
    (the continuation includes the token; the source is aborted). The client's gap then
    starts at a fresh token, not somewhere inside the source's step (flexpipe.gateway
    .cut_over); the stream keeps flowing meanwhile. Bounded by `cut_over.token_wait_s` of
    the stream's gap: past it, the move cuts over anyway. New requests keep off the target
    meanwhile and for its next two steps (`fence_target`). Returns what `PushRelay.move` /
    `move_relayed` return ("not_running" when the stream ended or failed over meanwhile)."""
    relay, relayed = call.relay, call.relayed
    gap_s = None
    if relay is not None:
        gap_s = mean_gap_s(relay.t_first, relay.t_last, relay.num_tokens_sent)
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[str] = loop.create_future()

    def cut() -> None:
        if call.cut is cut:
            call.cut = None
        timer.cancel()
        if outcome.done():
            return
        if call.relay is not relay or call.relayed is not relayed:
            outcome.set_result("not_running")  # ended, failed over or moved meanwhile
        elif relay is not None:
            outcome.set_result(relay.move(move))
        else:
            outcome.set_result(move_relayed(call, move))

    max_wait_s = MAX_TOKEN_WAIT_S if move.max_token_wait_s is None else move.max_token_wait_s
    wait_s = token_wait_s(gap_s, max_wait_s)
    fence_target(gw, call, move, wait_s)
    timer = loop.call_later(wait_s, cut)
    call.cut = cut
    try:
        return await outcome
    finally:
        if call.cut is cut:  # cancelled (the gateway is stopping)
            call.cut = None
            timer.cancel()


async def between_prefills(gw: MoveHost, url: str, bound_s: float) -> bool:
    """Wait, at most `bound_s`, until no stream on `url` awaits its first token (a new
    request's, or a moved stream's continuation) and no other move's warm-up runs there: a
    warmed cut-over is one short step there, unless it shares that step with (or waits for)
    a prefill, up to a whole context's. The moved stream keeps generating on its source
    meanwhile, so the wait pauses nothing. True when `url` had none."""
    deadline_s = gw.clock() + bound_s
    while gw.num_warm_ups_on(url) or any(c.awaits_first_token for c in gw.calls_on(url)):
        if gw.clock() >= deadline_s:
            return False
        await asyncio.sleep(WARM_POLL_S)
    return True


def transfer_s(export: dict[str, Any] | None) -> float:
    """The KV transfer an export priced (its engine's performance model, over the move's
    link), at most `MAX_FENCE_S`; 0 when it did not say. In the engine's seconds: a sim
    engine at `--time-scale` waits that times the scale, and the fence then outlasts the
    transfer until the stream's first token there lifts it."""
    value = export.get("transfer_s") if export is not None else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        return 0.0
    return min(float(value), MAX_FENCE_S)


async def export_state(
    gw: MoveHost, url: str, request_id: str | None, move: Move | None = None
) -> dict[str, Any] | None:
    """The engine's state of a request (its KV export), or None when it cannot tell; for a
    `move`, also the engine's time to carry the KV over its link (`transfer_s`)."""
    token = gw.engine_admin_token(url)
    if request_id is None or token is None:
        return None
    headers = {"content-type": "application/json", "authorization": f"Bearer {token}"}
    ask: dict[str, Any] = {"request_id": request_id}
    if move is not None:  # the link the import is priced over (`sse.import_body`)
        ask.update(
            bandwidth_bytes_per_s=kv_link_bytes_per_s(move.bandwidth_bytes_per_s),
            latency_s=move.latency_s,
        )
    body = orjson.dumps(ask)
    try:
        resp = await gw.post(url, "/admin/export", body, headers, Timeouts())
        data = await resp.read()
        resp.release()
    except UpstreamError:
        return None
    if resp.status != 200:
        return None
    obj = orjson.loads(data)
    return obj if isinstance(obj, dict) else None
