"""The gateway's admission decision (flexpipe/gateway/core/admission.py), stepped by hand:
each rule with exact values, and the live gateway and the simulator's gateway answering
the same situations the same way through it."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any

from flexpipe.gateway.app import Gateway
from flexpipe.gateway.config import config_from_dict
from flexpipe.gateway.core.admission import (
    ROUTE,
    Fail,
    Queue,
    admit,
    is_served,
    num_prompt_tokens,
)
from flexpipe.gateway.core.holds import MAX_HELD_WAIT_S, REFUSED_RETRY_AFTER_S, Holds
from flexpipe.gateway.retry_later import RetryLater
from flexpipe.http.server import HttpError
from flexpipe.policies.routing import RoutingRequest
from flexpipe.sim.gateway import SimGateway
from flexpipe.sim.loop import EventLoop
from flexpipe.sim.request import SimRequest

NO_INSTANCE = "no healthy instance serves model `m` right now"


def ask(**kw: Any) -> Any:
    """`admit` with a request of model "m" at 100 s that never queued, an empty queue of 4
    and a wait of 10 s, unless `kw` says otherwise."""
    args: dict[str, Any] = dict(
        model="m", has_slot=True, no_instance=None, holds=Holds(), now=100.0,
        arrival_s=100.0, own_deadline_s=None, num_waiting=0, num_waiting_for_model=0,
        max_queue=4, max_queue_wait_s=10.0,
    )  # fmt: skip
    args.update(kw)
    return admit(**args)


def test_a_slot_routes_and_none_queues_for_the_queues_wait() -> None:
    assert ask() is ROUTE
    assert ask(has_slot=False) == Queue(deadline_s=110.0, own_deadline_s=110.0)
    # asked again later (woken, no slot): the deadline it had, not a new one
    assert ask(has_slot=False, now=104.0, own_deadline_s=110.0) == Queue(110.0, 110.0)
    assert ask(has_slot=False, now=110.0, own_deadline_s=110.0) == Fail(
        429, "all instances stayed busy", "queue_timeout"
    )
    # woken with a slot, even past its deadline: it takes it
    assert ask(now=111.0, own_deadline_s=110.0) is ROUTE


def test_a_full_queue_refuses_only_a_request_not_yet_in_it() -> None:
    full = Fail(429, "all instances are busy and the wait queue is full", "queue_full")
    assert ask(has_slot=False, num_waiting=4) == full
    assert full.busy and full.retry_after_s is None
    assert ask(has_slot=False, num_waiting=3) == Queue(110.0, 110.0)
    # one already queued keeps its place however long the queue grew
    assert ask(has_slot=False, num_waiting=9, own_deadline_s=110.0) == Queue(110.0, 110.0)
    assert ask(has_slot=False, max_queue=0) == full


def test_first_come_first_served_unless_a_move_names_its_target() -> None:
    assert ask(num_waiting=1, num_waiting_for_model=1) == Queue(110.0, 110.0)
    assert ask(num_waiting=1, num_waiting_for_model=1, jumps_line=True) is ROUTE
    # a waiter (it queued before) takes the slot it was woken for
    assert ask(num_waiting=2, num_waiting_for_model=2, own_deadline_s=110.0) is ROUTE
    # other models' waiters do not hold it back
    assert ask(num_waiting=3, num_waiting_for_model=0) is ROUTE


def test_no_instance_fails_unless_held_and_a_refusal_says_why() -> None:
    holds = Holds()
    assert ask(has_slot=False, no_instance=NO_INSTANCE, holds=holds) == Fail(
        503, NO_INSTANCE, "no_instance"
    )
    holds.refuse("m", "no GPU free to us can place m", 60.0, 90.0)
    refused = ask(has_slot=False, no_instance=NO_INSTANCE, holds=holds)
    assert refused == Fail(
        503, "The model `m` cannot be served now: no GPU free to us can place m",
        "unplaceable", "model", REFUSED_RETRY_AFTER_S,
    )  # fmt: skip
    assert not refused.busy
    # a refusal only speaks while no instance serves the model
    assert ask(holds=holds) is ROUTE
    holds.hold("m", 30.0, 95.0)  # held until 125 s: waits for an instance, past the queue's
    assert ask(has_slot=False, no_instance=NO_INSTANCE, holds=holds, arrival_s=96.0) == Queue(
        135.0, 110.0
    )


def test_a_hold_waits_for_its_end_then_the_queues_wait_and_never_past_the_cap() -> None:
    holds = Holds()
    holds.hold("m", 3600.0, 0.0)
    q = ask(has_slot=False, holds=holds, now=10.0, arrival_s=10.0)
    assert q == Queue(10.0 + MAX_HELD_WAIT_S, 20.0)
    holds.hold("m", 0.0, 50.0)  # the hold ends at 50 s: the queue's wait from then
    assert ask(has_slot=False, holds=holds, now=55.0, arrival_s=10.0, own_deadline_s=20.0) == (
        Queue(60.0, 20.0)
    )
    # a hold before the request arrived does not extend its wait
    assert ask(has_slot=False, holds=holds, now=70.0, arrival_s=70.0) == Queue(80.0, 80.0)


def test_served_and_prompt_tokens() -> None:
    holds = Holds()
    assert is_served("m", True, holds, 0.0) and not is_served("m", False, holds, 0.0)
    holds.hold("m", 10.0, 0.0)
    assert is_served("m", False, holds, 5.0) and not is_served("m", False, holds, 10.0)
    holds.refuse("m", "", 10.0, 20.0)
    assert is_served("m", False, holds, 25.0)
    assert [num_prompt_tokens(n) for n in (0, 3, 4, 400)] == [1, 1, 2, 101]


# --- the two shells: the same situations, the same answers -------------------------------------
def _live_answer(cfg: dict[str, Any], setup: Any) -> str:
    """What the live gateway's `_pick` answers a request of "m" (status: message)."""

    async def scenario() -> str:
        gw = Gateway(config_from_dict(cfg))
        setup(gw, gw.clock())
        call: Any = SimpleNamespace(model="m", routing=RoutingRequest(1, 1, ()), move=None,
                                    excluded=set(), failed=set(), t0=gw.clock())  # fmt: skip
        try:
            inst = await gw._pick(call)
            return f"routed {inst.url}"
        except RetryLater as exc:
            return f"{exc.status}: {exc.message} (retry after {exc.retry_after_s:g})"
        except HttpError as exc:
            return f"{exc.status}: {exc.message}"
        finally:
            await gw.close()

    return asyncio.run(scenario())


def _sim_answer(cfg: dict[str, Any], setup: Any) -> str:
    """What the simulator's gateway records for a request of "m" (its `failed`)."""
    ended: list[SimRequest] = []
    gw = SimGateway(config_from_dict(cfg), EventLoop(), random.Random(0), ended.append)
    setup(gw, 0.0)
    gw.submit(SimRequest(0, 0.0, "m", 1, 1), 0.0)
    return ended[0].failed if ended else "queued"


def _refused(gw: Any, now: float) -> None:
    gw.holds.refuse("m", "no GPU free to us can place m", 60.0, now)


def _held(gw: Any, now: float) -> None:
    gw.holds.hold("m", 60.0, now)


def _lost(gw: Any, now: float) -> None:
    _held(gw, now)
    gw.holds.hold("m", 0.0, now)  # the hold ended (known, listed) and no instance came


def test_live_and_simulated_gateways_answer_alike() -> None:
    """The same decision, carried out on two clocks: the client's words live, "status:
    words" in the simulator's record."""
    cfg = {"backends": [], "max_queue_wait_s": 5}
    why = "The model `m` cannot be served now: no GPU free to us can place m"
    assert _live_answer(cfg, _refused) == f"503: {why} (retry after 60)"
    assert _sim_answer(cfg, _refused) == f"503: {why}"
    assert _sim_answer(cfg, _held) == "queued"
    # (the simulator answers this one before admission: a 404, `is_served`)
    assert _live_answer(cfg, _lost) == f"503: {NO_INSTANCE}"
