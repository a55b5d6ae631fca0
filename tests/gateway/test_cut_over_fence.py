"""A move's destination takes no other prefill while the move cuts over there: new requests
are routed elsewhere (`Router.pick`, `fenced_last`), the next move's warm-up waits for the
fence's end, and a cut-over waits for no client's or warm-up's prefill there
(flexpipe.gateway.core.cut_over). The simulator runs the same rules; its run is deterministic,
so the figures are exact."""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

import pytest

from bench.sim_move_pauses import _seed_short, one_prefill_s
from flexpipe.gateway import moves
from flexpipe.gateway.core.cut_over import MAX_FENCE_S
from flexpipe.gateway.core.pool import Instance, Pool
from flexpipe.sim import simulate


def test_warmed_cut_overs_pause_less_than_one_prefill_in_the_simulator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fences: list[tuple[str, float]] = []
    fence, unfence = Pool.fence, Pool.unfence
    lifted: list[tuple[str, object]] = []

    def spy(self: Pool, url: str, key: object, until_s: float, now: float) -> Any:
        fences.append((url, until_s))
        return fence(self, url, key, until_s, now)

    def spy_lift(self: Pool, url: str, key: object) -> None:
        lifted.append((url, key))
        unfence(self, url, key)

    monkeypatch.setattr(Pool, "fence", spy)
    monkeypatch.setattr(Pool, "unfence", spy_lift)
    sc = _seed_short()  # the seed's cluster at 8 req/s, gpu1 released, a 0.5 s deadline
    r = simulate(sc, "flexpipe")
    warmed = [m for m in r.moves if m.method == "recomputed" and m.warm == "warmed"]
    assert len(warmed) == 24
    ratios = [m.pause_s / one_prefill_s(sc, r, m) for m in warmed]
    # before the fence: p50 2.50 (a cut-over shared its step with the next move's warm-up,
    # a whole context's prefill, below); now about one of its destination's decode steps
    assert statistics.median(ratios) == pytest.approx(0.7544, abs=1e-4)
    assert sum(x < 1 for x in ratios) == 15
    # every move fenced its destination from its cut-over, for at most MAX_FENCE_S
    moved = [m for m in r.moves if m.method in ("recomputed", "kv_moved")]
    assert len(fences) == len(moved)
    for m in moved:
        url = f"sim://{m.continuation.instance}"
        assert any(u == url and m.at_s <= t <= m.at_s + MAX_FENCE_S for u, t in fences)
        # and lifted at its continuation's first token there
        assert (url, m.request_id) in lifted


class _Gw:
    """What `moves.between_prefills` reads of the gateway: its clock, the calls on an
    instance and the moves' warm-ups in flight there."""

    def __init__(self) -> None:
        self.warm_ups_on: dict[str, int] = {"http://b": 1}
        self.t0 = asyncio.get_running_loop().time()

    def clock(self) -> float:
        return asyncio.get_running_loop().time()

    def calls_on(self, url: str) -> list[Any]:
        return []

    def num_warm_ups_on(self, url: str) -> int:
        return self.warm_ups_on.get(url, 0)


def test_a_cut_over_waits_for_another_moves_warm_up_on_its_destination() -> None:
    async def scenario() -> tuple[bool, float, bool]:
        gw: Any = _Gw()

        async def warm_up_ends() -> None:
            await asyncio.sleep(0.15)
            del gw.warm_ups_on["http://b"]

        task = asyncio.create_task(warm_up_ends())
        ok = await moves.between_prefills(gw, "http://b", 2.0)
        waited_s = gw.clock() - gw.t0
        await task
        gw.warm_ups_on["http://b"] = 1  # one that outlasts the bound: cut over anyway
        bounded = await moves.between_prefills(gw, "http://b", 0.1)
        return ok, waited_s, bounded

    ok, waited_s, bounded = asyncio.run(scenario())
    assert ok and 0.15 <= waited_s < 1.0
    assert not bounded


def test_without_the_fence_cut_overs_share_their_step_with_warm_ups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same run with no fence (a cut-over still waits for warm-ups before it): the
    pause the fence removes."""
    monkeypatch.setattr(Pool, "fence", lambda self, url, key, until_s, now: None)
    sc = _seed_short()
    r = simulate(sc, "flexpipe")
    warmed = [m for m in r.moves if m.method == "recomputed" and m.warm == "warmed"]
    ratios = [m.pause_s / one_prefill_s(sc, r, m) for m in warmed]
    assert statistics.median(ratios) > 2.0


class _Pooled:
    """What `relay._warm_up` reads of the gateway before it sends anything: its clock and
    the target's record (fenced far ahead)."""

    def __init__(self, fenced_for_s: float) -> None:
        self.pool = Pool()
        inst = self.pool.add("http://b", "m")
        now = self.clock()
        self.pool.fence(inst.url, "move-1", now + fenced_for_s, now)

    def clock(self) -> float:
        return asyncio.get_running_loop().time()

    def instance(self, url: str) -> Instance | None:
        return self.pool.instances.get(url)


class _NothingToWarm:
    """A call with nothing relayed yet: the warm-up has nothing to send ("skipped")."""

    relay = None
    stream_state = None


def test_a_warm_up_waits_for_a_fence_within_its_cap_and_not_at_all_when_off() -> None:
    from flexpipe.gateway.relay import _warm_up

    nothing: Any = _NothingToWarm()

    async def timed(gw: Any, timeout_s: float) -> tuple[str, float]:
        t0 = gw.clock()
        outcome = await _warm_up(gw, nothing, "http://b", timeout_s)
        return outcome, gw.clock() - t0

    async def scenario() -> list[tuple[str, float]]:
        out = [await timed(_Pooled(0.2), 2.0)]  # waits out a short fence
        out.append(await timed(_Pooled(10.0), 2.0))  # one past the cap: goes at once
        out.append(await timed(_Pooled(0.2), 0.0))  # no warm-up asked for: at once
        gw: Any = _Pooled(0.2)

        async def renew() -> None:  # moves keep cutting over there: the fence moves on
            for _ in range(20):
                await asyncio.sleep(0.1)
                now = gw.clock()
                gw.pool.fence("http://b", "move-2", now + 0.2, now)

        task = asyncio.create_task(renew())
        out.append(await timed(gw, 2.0))  # bounded by the cap in elapsed time
        task.cancel()
        return out

    (short, long_, off, renewed) = asyncio.run(scenario())
    assert short[0] == "skipped" and 0.2 <= short[1] < 0.45
    assert long_[0] == "skipped" and long_[1] < 0.05
    assert off[0] == "skipped" and off[1] < 0.05
    assert renewed[0] == "skipped" and 0.3 <= renewed[1] <= MAX_FENCE_S + 0.25
