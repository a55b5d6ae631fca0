import math

import pytest

from flexpipe.gateway.core.backpressure import DrainRate


def test_rate_converges_to_the_completion_rate() -> None:
    d = DrainRate(window_s=5.0)
    for i in range(1, 801):  # 20 completions per second for 40 s (8 windows)
        d.record(i * 0.05)
    assert d.rate(40.0) == pytest.approx(20.0, rel=0.01)


def test_rate_decays_when_nothing_finishes() -> None:
    d = DrainRate(window_s=5.0)
    for i in range(1, 400):
        d.record(i * 0.05)
    before = d.rate(20.0)
    assert d.rate(25.0) == pytest.approx(before * math.exp(-1.0), rel=1e-9)


def test_retry_after_follows_the_queue_and_the_rate() -> None:
    d = DrainRate(window_s=5.0)
    assert d.retry_after_s(10, now=0.0) == 60.0  # nothing measured: the cap
    for i in range(1, 400):
        d.record(i * 0.05)  # ~20/s
    assert d.retry_after_s(99, now=20.0) == pytest.approx(5.0, rel=0.03)
    assert d.retry_after_s(0, now=20.0) == 1.0  # clamped below
    assert d.retry_after_s(100_000, now=20.0) == 60.0  # clamped above
