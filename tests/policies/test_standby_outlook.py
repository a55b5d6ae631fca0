"""The outlook drives the standby rate (policies/shift/standby_outlook.py): a model whose
history shows bursts is sized for their mean peak, one whose bursts stopped keeps less, one
with none keeps the operator's factor. Exact, on hand-made rate histories."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[0]))
from test_standby_sleepers import B

from flexpipe.policies.shift.forecast import ForecastParams
from flexpipe.policies.shift.standby_outlook import outlook_rates
from flexpipe.policies.shift.standby_sleepers import StandbyParams, standby_rate_per_s

ON = StandbyParams(enabled=True, rate_factor=3.0, outlook_horizon_s=300, burst_margin=1.2)
# a: idle but for bursts of 8 req/s at 100-120 s and 10 req/s at 400-410 s (10 s samples)
BURSTY = [
    (float(t), 8.0 if 100 <= t < 130 else (10.0 if 400 <= t < 420 else 0.0))
    for t in range(0, 600, 10)
]
STEADY = [(float(t), 1.0) for t in range(0, 600, 10)]  # never over twice its median
ONCE = [(float(t), 6.0 if t < 20 else 0.0) for t in range(0, 6000, 100)]  # one burst, long ago


def test_a_bursty_model_is_sized_for_its_mean_peak_times_the_margin() -> None:
    """Two bursts 300 s apart: likely within 300 s (1 - e^-1 = 0.63 >= 0.5), peak
    (8 + 10) / 2 = 9 req/s, times 1.2."""
    got = outlook_rates({"a": BURSTY, "b": STEADY}, 590.0, ForecastParams(), ON)
    assert got == {"a": pytest.approx(10.8, abs=1e-12)}  # b: no burst seen, left out


def test_a_model_whose_bursts_stopped_keeps_less() -> None:
    """One burst in 5900 s: 1 - e^(-300/5900) = 0.0496 likely, under 0.5: the outlook's
    demand (likelihood x peak), not the peak."""
    got = outlook_rates({"c": ONCE}, 5900.0, ForecastParams(), ON)
    assert got == {"c": pytest.approx((1 - math.exp(-300 / 5900)) * 6.0, abs=1e-12)}


def test_off_by_default_and_the_outlook_replaces_the_factor_once_bursts_are_seen() -> None:
    assert StandbyParams().outlook_horizon_s == 0.0
    off = StandbyParams(enabled=True)
    assert outlook_rates({"a": BURSTY}, 590.0, ForecastParams(), off) == {}
    # b declares 4 req/s: the factor's 12 until its history shows bursts, then theirs (3)
    assert standby_rate_per_s(B, {}, ON) == 12.0
    assert standby_rate_per_s(B, {"b": 3.0}, ON) == 3.0
    assert standby_rate_per_s(B, {"b": 3.0}, off) == 4.0  # off: the higher, 4 x factor 1
    with pytest.raises(ValueError, match=">= 0"):
        StandbyParams(burst_margin=-1.0)
