"""A warmed recompute move cuts over between its destination's prefills: while a stream there
awaits its first token (a new request's prompt being prefilled), the cut-over would share
that step or wait for it, so the gateway waits (bounded) for it to end; the moved stream
keeps generating on its source meanwhile. The wait on its own, with a hand-driven set of
calls; the move itself runs end to end in tests/gateway/test_warm_moves.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from flexpipe.gateway.app import Gateway
from flexpipe.gateway.call import Call
from flexpipe.gateway.config import config_from_dict
from flexpipe.gateway.moves import between_prefills
from flexpipe.gateway.sse import StreamState
from flexpipe.policies.routing import RoutingRequest


def test_a_cut_over_waits_until_no_stream_on_its_destination_awaits_its_first_token() -> None:
    gw = Gateway(config_from_dict({"backends": []}))
    prefilling = SimpleNamespace(instance="http://b", awaits_first_token=True)
    elsewhere = SimpleNamespace(instance="http://a", awaits_first_token=True)
    gw._calls = {1: prefilling, 2: elsewhere}  # type: ignore[dict-item]

    async def first_token_after(delay_s: float) -> bool:
        task = asyncio.create_task(between_prefills(gw, "http://b", 5.0))
        await asyncio.sleep(delay_s)
        assert not task.done()  # still prefilling there: no cut-over yet
        prefilling.awaits_first_token = False  # its first token came
        return await asyncio.wait_for(task, 1.0)

    assert asyncio.run(first_token_after(0.05)) is True
    # another destination's prefills do not hold it
    assert asyncio.run(between_prefills(gw, "http://b", 0.0)) is True
    # one that never ends: cut over at the bound anyway
    prefilling.awaits_first_token = True
    assert asyncio.run(between_prefills(gw, "http://b", 0.05)) is False


def test_a_stream_continued_on_an_instance_awaits_its_first_token_there() -> None:
    """A moved (or failed-over) stream's continuation prefills its whole context on its new
    instance: a cut-over there waits for it as for a new request's prompt, as the simulator's
    `Moves.awaits_first_token` counts it (the relay sets `continuing` until its first token
    there)."""
    call = Call("/v1/completions", False, "m", {}, b"", True, RoutingRequest(), 1.0, 0.0, None)
    assert not call.awaits_first_token  # not on an instance yet
    call.instance = "http://b"
    assert call.awaits_first_token  # nothing sent yet
    call.stream_state = StreamState()  # continued once: the client has tokens
    assert not call.awaits_first_token
    call.continuing = True  # on its new instance, no token from there yet
    assert call.awaits_first_token
    call.stream = False  # a non-streamed request: the gateway cannot tell
    assert not call.awaits_first_token
