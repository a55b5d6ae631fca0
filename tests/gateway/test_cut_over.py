"""The cut-over's timing rule (flexpipe.gateway.core.cut_over), shared by the gateway and the
simulator: a recompute move waits, bounded, for its source's next token. Exact values."""

from __future__ import annotations

import pytest

from flexpipe.gateway.core.cut_over import (
    FENCE_STEPS,
    MAX_FENCE_S,
    MAX_TOKEN_WAIT_S,
    TOKEN_WAIT_GAPS,
    cut_over_s,
    fence_until_s,
    fence_wait_s,
    mean_gap_s,
    token_wait_s,
)


def test_the_mean_gap_needs_two_tokens() -> None:
    assert mean_gap_s(1.0, 1.0, 0) is None
    assert mean_gap_s(1.0, 1.0, 1) is None
    assert mean_gap_s(1.0, 1.5, 11) == pytest.approx(0.05)
    assert mean_gap_s(1.0, 0.9, 3) == 0.0  # clock skew never gives a negative gap


def test_the_wait_is_a_gap_and_a_half_at_most_the_cap() -> None:
    assert TOKEN_WAIT_GAPS == 1.5 and MAX_TOKEN_WAIT_S == 0.25
    assert token_wait_s(0.04) == pytest.approx(0.06)
    assert token_wait_s(0.5) == 0.25  # capped
    assert token_wait_s(None) == 0.25  # gap unknown: the cap
    assert token_wait_s(0.04, 0.05) == 0.05  # a move's own cap
    assert token_wait_s(0.04, 0.0) == 0.0  # 0: cut over at once


def test_a_move_cuts_over_at_the_next_token_if_it_comes_within_the_wait() -> None:
    # asked at 10.0, gap 40 ms: waits up to 60 ms
    assert cut_over_s(10.0, 10.03, 0.04) == 10.03
    assert cut_over_s(10.0, 10.06, 0.04) == 10.06  # at the bound exactly: still the token
    assert cut_over_s(10.0, 10.07, 0.04) == pytest.approx(10.06)  # too late: at the bound
    assert cut_over_s(10.0, None, 0.04) == pytest.approx(10.06)  # none coming: at the bound
    assert cut_over_s(10.0, 10.1, None) == 10.1  # gap unknown: up to the cap (250 ms)
    assert cut_over_s(10.0, 10.03, 0.04, 0.0) == 10.0  # cap 0: at once, as before


def test_the_fence_covers_the_wait_and_two_destination_steps_at_most_the_cap() -> None:
    assert FENCE_STEPS == 2.0 and MAX_FENCE_S == 0.5
    # 25 tokens/s: a 40 ms step; 60 ms of wait for the source's token, then two steps
    assert fence_until_s(10.0, 0.06, 25.0) == pytest.approx(10.0 + 0.06 + 0.08)
    assert fence_until_s(10.0, 0.0, 25.0) == pytest.approx(10.08)  # a KV move: no wait
    assert fence_until_s(10.0, 0.25, 4.0) == 10.5  # 250 ms steps: the cap
    assert fence_until_s(10.0, 0.0, 0.0) == 10.5  # its step unknown yet: the cap


def test_a_warm_up_waits_for_the_fence_only_within_its_bound() -> None:
    assert fence_wait_s(10.3, 10.0, 2.0) == pytest.approx(0.3)
    assert fence_wait_s(9.0, 10.0, 2.0) == 0.0  # not fenced (any more)
    assert fence_wait_s(10.3, 10.0, 0.2) == 0.0  # the fence outlasts its bound: at once
