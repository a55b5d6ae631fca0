"""Where and how a request moves when its instance is drained (policies/shift/migration.py):
the wait for a free slot on the destination is part of the price, every move takes a slot,
what outlives the drain deadline moves at once, and a recompute the gateway pre-copies is
priced at its cut-over (a step and the tokens generated meanwhile), not the whole prefill.
Pure; exact expectations."""

from __future__ import annotations

import math
from typing import Any

import pytest

from flexpipe.hardware import link_spec
from flexpipe.perf import perf_model_for
from flexpipe.policies.shift.migration import (
    Destination,
    MigrationChoice,
    MoveRequest,
    choose_migration,
    outlives,
    plan_moves,
    slot_wait_s,
    warmed_recompute_s,
)

PM = perf_model_for("llama-2-7b", "tp=1")
FAST = link_spec("nvlink3")


def test_slot_wait_is_zero_while_a_slot_is_free_then_the_kth_running_request_to_end() -> None:
    running = (3.0, 0.5, 2.0)
    assert slot_wait_s(4, running, 0) == 0.0  # one of 4 slots free
    assert slot_wait_s(4, running, 1) == 0.5  # the free slot went to the move before it
    assert slot_wait_s(4, running, 2) == 2.0
    assert slot_wait_s(3, running, 0) == 0.5  # full: the first request to end frees it
    assert slot_wait_s(3, running, 5) == 3.0  # beyond every running one: the last of them
    # in flight beyond the slots: the ones queued in the engine (latest to end) do not run,
    # and a moved request goes ahead of them (priority)
    assert slot_wait_s(2, (9.0, 1.0, 4.0, 8.0), 0) == 1.0
    assert slot_wait_s(2, (9.0, 1.0, 4.0, 8.0), 1) == 4.0
    assert slot_wait_s(0, (1.0,), 3) == 0.0  # slots unknown: no wait priced
    assert slot_wait_s(2, (), 7) == 0.0  # only moved requests in its slots: unknown


def test_the_wait_adds_to_either_method_and_does_not_change_which_is_cheaper() -> None:
    for context in (64, 2048):
        free = choose_migration(PM, context, FAST)
        busy = choose_migration(PM, context, FAST, queue_wait_s=0.25)
        assert busy.method == free.method
        assert busy.pause_s == pytest.approx(free.pause_s + 0.25)
    kv = PM.kv_transfer_s(2048, FAST.bandwidth_bytes_per_s, FAST.latency_s)
    assert choose_migration(PM, 2048, FAST, 0.1) == MigrationChoice(
        "kv" if kv < PM.prefill_s(2048) else "recompute", kv, PM.prefill_s(2048), 0.1
    )
    assert choose_migration(PM, 2048, None, 0.1).pause_s == PM.prefill_s(2048) + 0.1


def dest(name: str, slots: int, remaining: tuple[float, ...]) -> Destination:
    return Destination(name, PM, {"": FAST}, slots, remaining)  # from the source "" over FAST


def test_moves_go_where_a_slot_is_free_and_each_takes_one() -> None:
    full = dest("full", 2, (0.4, 0.9))  # both slots busy
    roomy = dest("roomy", 3, (5.0,))  # two free slots
    reqs = [MoveRequest(7, 3000), MoveRequest(5, 1000), MoveRequest(6, 2000)]
    moves = plan_moves(reqs, [full, roomy])
    base = {c: choose_migration(PM, c, FAST).pause_s for c in (1000, 2000, 3000)}
    # shortest context first: 5 and 6 take roomy's two free slots; 7 then waits 0.4 s on
    # `full` (its first request to end) rather than 5.0 s on roomy
    assert [(m.id, m.destination) for m in moves] == [(5, "roomy"), (6, "roomy"), (7, "full")]
    assert [m.choice.queue_wait_s for m in moves] == [0.0, 0.0, 0.4]
    assert moves[2].choice.pause_s == pytest.approx(base[3000] + 0.4)
    # 6 shares roomy's link with 5: it moves once 5's KV is across, pausing only for its own
    kv_1000 = PM.kv_transfer_s(1000, FAST.bandwidth_bytes_per_s, FAST.latency_s)
    assert [m.choice.method for m in moves] == ["kv", "kv", "kv"]
    assert [m.at_s for m in moves] == [0.0, kv_1000, 0.0]
    assert moves[1].choice.pause_s == base[2000]


def test_a_move_prefers_a_busy_fast_link_only_when_the_wait_is_shorter_than_the_gain() -> None:
    slow = Destination("slow", PM, {}, 4, ())  # free, but recompute only
    fast_busy = dest("fast", 1, (0.001,))
    moves = plan_moves([MoveRequest(1, 4000)], [slow, fast_busy])
    kv = PM.kv_transfer_s(4000, FAST.bandwidth_bytes_per_s, FAST.latency_s)
    assert kv + 0.001 < PM.prefill_s(4000)  # the premise: a KV move saves more than it waits
    assert moves[0].destination == "fast" and moves[0].choice.method == "kv"
    fast_busier = dest("fast", 1, (10.0,))
    assert plan_moves([MoveRequest(1, 4000)], [slow, fast_busier])[0].destination == "slow"


def test_no_destination_no_moves_and_ties_go_to_the_first() -> None:
    assert plan_moves([MoveRequest(1, 100)], []) == []
    a, b = dest("a", 4, ()), dest("b", 4, ())
    assert [m.destination for m in plan_moves([MoveRequest(1, 100)], [a, b])] == ["a"]


def test_recomputes_on_one_destination_go_one_after_another_within_the_horizon() -> None:
    only = Destination("only", PM, {}, 8, ())  # recompute only, slots free
    reqs = [MoveRequest(1, 1000), MoveRequest(2, 1000), MoveRequest(3, 1000)]
    p = PM.prefill_s(1000)
    moves = plan_moves(reqs, [only])
    assert [m.at_s for m in moves] == [0.0, p, 2 * p]  # not all at once, each paused behind
    assert all(m.choice.pause_s == p for m in moves)
    # a second destination takes the next one at once rather than later
    moves = plan_moves(reqs, [only, Destination("other", PM, {}, 8, ())])
    assert [(m.destination, m.at_s) for m in moves] == [("only", 0.0), ("other", 0.0),
                                                       ("only", p)]  # fmt: skip
    # one slot, free in p/2: the first waits for it (paused p/2 + p), the next ones start
    # when the lane is free; beyond the horizon they are ranked by when they resume
    late = plan_moves(reqs, [Destination("only", PM, {}, 1, (p / 2,))], horizon_s=p / 4)
    assert [m.choice.queue_wait_s for m in late] == [p / 2, 0.0, 0.0]
    assert [m.at_s for m in late] == [0.0, pytest.approx(1.5 * p), pytest.approx(2.5 * p)]


def test_what_outlives_the_drain_deadline_moves_at_once() -> None:
    assert outlives(2000, 0.05, 4.0)  # 100 s left
    assert not outlives(60, 0.05, 4.0)  # 3 s left: finishes in place
    assert not outlives(80, 0.05, 4.0)  # exactly at the deadline: it may still finish


def test_a_move_waits_unpaused_until_the_destination_has_prefilled_what_it_admitted() -> None:
    flooded = Destination("flooded", PM, {}, 8, (), num_prefill_tokens=8192)
    (move,) = plan_moves([MoveRequest(1, 1000)], [flooded])
    assert move.at_s == PM.prefill_s(8192) and move.choice.pause_s == PM.prefill_s(1000)
    # a quiet destination with a slower move wins while its pause is the smaller one
    quiet = Destination("quiet", PM, {"": link_spec("eth25")}, 8, ())
    (move,) = plan_moves([MoveRequest(1, 1000)], [flooded, quiet], horizon_s=0.1)
    assert move.destination == "quiet"  # the flooded one could only start past the horizon


STEP_S = PM.decode_interval_s(16, 1500)  # the destination's step at a batch of 16
SOURCE_S = 0.02  # the moved request's token interval on its source
PCIE = link_spec("pcie4")


def busy(
    name: str, slots: int, remaining: tuple[float, ...] = (), num: int = 16, **kw: Any
) -> Destination:
    """A destination decoding `num` requests of 1,500 tokens each."""
    return Destination(name, PM, kw.pop("links", {}), slots, remaining, num_decoding=num,
                       decode_context_tokens=num * 1500, **kw)  # fmt: skip


def test_a_warmed_recompute_pauses_for_a_step_and_the_tokens_generated_during_the_warm_up() -> None:
    warm_up_s, pause_s = warmed_recompute_s(PM, 2050, STEP_S, SOURCE_S)
    assert warm_up_s == STEP_S + PM.prefill_s(2050)  # the whole context, not paused
    num_new = math.ceil(warm_up_s / SOURCE_S)  # generated on the source meanwhile
    assert num_new == 8
    # 2,048 tokens were cached (128 full blocks); the 2 of the last block and the 8 new ones
    # are prefilled, after the step in progress
    assert pause_s == STEP_S + PM.prefill_s(2050 + 8, 2048)
    assert pause_s < 0.25 * PM.prefill_s(2050)
    # the source's interval unknown: no token counted
    assert warmed_recompute_s(PM, 2050, STEP_S, 0.0)[1] == STEP_S + PM.prefill_s(2050, 2048)
    warm = choose_migration(PM, 2050, None, warm=True, step_s=STEP_S, source_interval_s=SOURCE_S)
    assert warm == MigrationChoice("recompute", None, pause_s, 0.0, warm_up_s)
    assert warm.warmed and warm.pause_s == pause_s and warm.done_s == warm_up_s + pause_s
    # onto a full destination the gateway does not warm: the whole prefill, after the wait
    full = choose_migration(PM, 2050, None, 0.1, warm=True, step_s=STEP_S)
    assert full == MigrationChoice("recompute", None, PM.prefill_s(2050), 0.1)
    assert not full.warmed and full.done_s == full.pause_s


def test_the_pre_copy_turns_a_kv_move_over_a_middling_link_into_a_recompute() -> None:
    kv_s = PM.kv_transfer_s(2050, PCIE.bandwidth_bytes_per_s, PCIE.latency_s)
    warm_up_s, pause_s = warmed_recompute_s(PM, 2050, STEP_S, SOURCE_S)
    assert pause_s < kv_s < PM.prefill_s(2050)  # the premise: KV beats only a cold recompute
    assert choose_migration(PM, 2050, PCIE).method == "kv"
    warm = choose_migration(PM, 2050, PCIE, warm=True, step_s=STEP_S, source_interval_s=SOURCE_S)
    assert warm == MigrationChoice("recompute", kv_s, pause_s, 0.0, warm_up_s)
    # over NVLink the KV move is still the shorter pause
    nv = choose_migration(PM, 2050, FAST, warm=True, step_s=STEP_S, source_interval_s=SOURCE_S)
    assert nv.method == "kv" and nv.pause_s == nv.kv_move_s


def test_a_destination_s_step_grows_with_each_request_moved_in() -> None:
    d = busy("d", 32)
    assert d.step_s() == STEP_S
    assert d.step_s(2, 2 * 3000) == PM.decode_interval_s(18, (16 * 1500 + 6000) // 18)
    assert busy("idle", 32, num=0).step_s() == PM.decode_interval_s(1, 1)


def test_warmed_recomputes_on_one_destination_go_one_after_another_warm_up_included() -> None:
    only = busy("only", 32, links={"src": PCIE})
    reqs = [MoveRequest(n, 2050, "src", SOURCE_S) for n in (1, 2, 3)]
    cold = plan_moves(reqs, [only])  # no pre-copy: KV over the link, one after another
    assert [m.choice.method for m in cold] == ["kv"] * 3
    moves = plan_moves(reqs, [only], warm=True)
    kv_s = PM.kv_transfer_s(2050, PCIE.bandwidth_bytes_per_s, PCIE.latency_s)
    at_s = 0.0
    for k, m in enumerate(moves):  # each at the step with the ones before it moved in
        warm_up_s, pause_s = warmed_recompute_s(PM, 2050, only.step_s(k, k * 2050), SOURCE_S)
        assert m.choice == MigrationChoice("recompute", kv_s, pause_s, 0.0, warm_up_s)
        # each cut-over stays out of the next warm-up's prefill step: the lane is held for both
        assert m.at_s == pytest.approx(at_s)
        at_s += warm_up_s + pause_s
    # within a horizon shorter than one, the rest take the link (their pause is bigger, but
    # they start before the source is gone)
    near = plan_moves(reqs, [only], horizon_s=moves[1].at_s / 2, warm=True)
    assert [m.choice.method for m in near] == ["recompute", "kv", "kv"]


def test_a_full_destination_prices_its_moves_unwarmed() -> None:
    full = busy("full", 1, (0.5,))  # its one slot frees in 0.5 s
    (move,) = plan_moves([MoveRequest(1, 2050, "src", SOURCE_S)], [full], warm=True)
    assert move.choice == MigrationChoice("recompute", None, PM.prefill_s(2050), 0.5)
    # a free one next to it takes the move, warmed, at a fraction of the pause
    (move,) = plan_moves([MoveRequest(1, 2050, "src", SOURCE_S)], [full, busy("free", 32)],
                         warm=True)  # fmt: skip
    assert move.destination == "free" and move.choice.warmed
    assert move.choice.pause_s == warmed_recompute_s(PM, 2050, STEP_S, SOURCE_S)[1]


def test_moves_spread_over_equal_destinations_as_each_one_placed_grows_the_step() -> None:
    # "a" decodes one request fewer: its step is a hair shorter, until a move lands there
    a, b = busy("a", 32, num=15), busy("b", 32)
    assert a.step_s() < b.step_s() < a.step_s(1, 2050)
    reqs = [MoveRequest(n, 2050, "src", SOURCE_S) for n in range(4)]
    moves = plan_moves(reqs, [a, b], warm=True)
    assert [m.destination for m in moves] == ["a", "b", "a", "b"]
    assert [m.at_s for m in moves[:2]] == [0.0, 0.0]  # in parallel, not one lane
    steps = (a.step_s(), b.step_s(), a.step_s(1, 2050), b.step_s(1, 2050))
    assert [m.choice.pause_s for m in moves] == [
        warmed_recompute_s(PM, 2050, s, SOURCE_S)[1] for s in steps
    ]
