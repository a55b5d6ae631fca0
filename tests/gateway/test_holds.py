"""The gateway's holds (pure): what the live gateway and the simulator's gateway ask."""

from __future__ import annotations

from flexpipe.gateway.core.holds import MAX_HELD_WAIT_S, MAX_HOLD_S, Holds


def test_a_hold_lasts_its_seconds_and_zero_ends_it() -> None:
    holds = Holds()
    holds.hold("m", 30.0, now=100.0)
    assert holds.held("m", 129.9) and not holds.held("m", 130.0)
    assert holds.models(110.0) == {"m"} and holds.models(131.0) == set()
    holds.hold("m", 0.0, now=110.0)
    assert not holds.held("m", 110.0)
    holds.hold("m", 10 * MAX_HOLD_S, now=0.0)  # capped
    assert holds.held("m", MAX_HOLD_S - 1) and not holds.held("m", MAX_HOLD_S)


def test_a_queued_request_waits_while_held_but_never_past_the_longest_wait() -> None:
    holds = Holds()
    assert holds.wait_deadline("m", 15.0, arrival_s=0.0) == 15.0  # not held: the queue's own
    holds.hold("m", 60.0, now=0.0)
    assert holds.wait_deadline("m", 15.0, arrival_s=0.0) == 60.0
    holds.hold("m", 3000.0, now=0.0)  # renewed far ahead: bounded from the arrival
    assert holds.wait_deadline("m", 15.0, arrival_s=10.0) == 10.0 + MAX_HELD_WAIT_S
    assert holds.wait_deadline("other", 15.0, arrival_s=0.0) == 15.0


def test_once_a_hold_ends_a_request_queued_through_it_waits_the_queue_time_from_then() -> None:
    """A request queued at 5 s through a cold start held to 600 s: the hold ends at 40 s (the
    first instances serve): from then it waits the queue's 15 s like any request (to 55 s),
    not to 600 s; one that arrives after the hold is not touched by it."""
    holds = Holds()
    holds.hold("m", 600.0, now=0.0)
    assert holds.wait_deadline("m", 20.0, arrival_s=5.0, queue_wait_s=15.0) == 615.0
    holds.hold("m", 0.0, now=40.0)
    assert not holds.held("m", 40.0)
    assert holds.wait_deadline("m", 20.0, arrival_s=5.0, queue_wait_s=15.0) == 55.0
    assert holds.wait_deadline("m", 70.0, arrival_s=55.0, queue_wait_s=15.0) == 70.0
