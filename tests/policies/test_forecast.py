"""The rate forecast (policies/shift/forecast.py) on hand-made rate series and a fake clock:
exact values; and how the controller's `RateWindow` feeds it into the policy's `ModelState`."""

from __future__ import annotations

import pytest

from flexpipe.control.core.observe import RateWindow, model_states
from flexpipe.policies.planner import ModelDemand, Slo
from flexpipe.policies.shift import ShiftParams
from flexpipe.policies.shift.forecast import Forecast, ForecastParams, forecast

TEN_MIN = ForecastParams(horizon_s=600, trend_window_s=600, min_trend_span_s=300, period_s=0)


def line(
    rate_at_0: float, slope: float, until_s: int, step_s: int = 10
) -> list[tuple[float, float]]:
    return [(float(t), rate_at_0 + slope * t) for t in range(0, until_s + 1, step_s)]


def test_no_forecast_when_off_or_without_history() -> None:
    rising = line(2.0, 0.01, 600)
    off = ForecastParams(horizon_s=0)
    assert forecast(rising, 600, off) == Forecast(None, None)
    assert off.keep_s == 0
    assert forecast([], 600, TEN_MIN).expected_per_s is None
    # 290 s of samples: less than min_trend_span_s (300), no line
    assert forecast(line(2.0, 0.01, 290), 290, TEN_MIN) == Forecast(None, None)
    assert forecast(line(2.0, 0.01, 300), 300, TEN_MIN).trend_per_s is not None


def test_a_rising_trend_reads_the_line_at_the_horizon() -> None:
    # 2 + 0.01 t from 0 to 600 s: at now + 600 s = 1200 s the line reads 14 req/s
    f = forecast(line(2.0, 0.01, 600), 600, TEN_MIN)
    assert f.trend_per_s == pytest.approx(14.0, abs=1e-9)
    assert f.yesterday_per_s is None
    assert f.expected_per_s == f.trend_per_s


def test_a_falling_trend_reads_the_rate_now_never_lower() -> None:
    # 8 - 0.01 t: 2 req/s at now (600 s), -4 at the horizon: the forecast holds at 2
    assert forecast(line(8.0, -0.01, 600), 600, TEN_MIN).trend_per_s == pytest.approx(2.0)
    # a line already below 0 now: 0
    assert forecast(line(3.0, -0.01, 600), 600, TEN_MIN).trend_per_s == 0.0


def test_the_trend_fits_only_its_window_and_ignores_the_future() -> None:
    flat = [(float(t), 3.0) for t in range(1000, 1601, 10)]
    noise = [(0.0, 100.0), (500.0, 0.0)]  # older than the 600 s window
    later = [(1700.0, 50.0)]  # after now
    f = forecast([*noise, *flat, *later], 1600, TEN_MIN)
    assert f.trend_per_s == pytest.approx(3.0)


def test_yesterday_is_the_busiest_of_the_coming_horizon_one_period_ago() -> None:
    p = ForecastParams(horizon_s=100, trend_window_s=50, min_trend_span_s=50, period_s=1000)
    assert p.keep_s == 1100
    # 1 req/s all along, but 5 req/s between 120 s and 180 s one "day" ago
    history = [(float(t), 5.0 if 120 <= t <= 180 else 1.0) for t in range(0, 1201, 10)]
    at_1100 = [s for s in history if s[0] <= 1100]
    f = forecast(at_1100, 1100, p)  # yesterday's [100, 200] s holds the peak
    assert f == Forecast(trend_per_s=pytest.approx(1.0), yesterday_per_s=5.0)
    assert f.expected_per_s == 5.0
    assert forecast(history, 1200, p).yesterday_per_s == 1.0  # [200, 300]: past the peak
    # a history that does not reach back a whole period: no seasonal reading
    assert forecast(history[1:], 1005, p).yesterday_per_s is None


def test_params_are_checked_and_read_from_the_shift_section() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        ForecastParams(horizon_s=-1)
    with pytest.raises(ValueError, match="min_trend_span_s must be <= trend_window_s"):
        ForecastParams(trend_window_s=60, min_trend_span_s=120)
    params = ShiftParams.from_mapping({"forecast": {"horizon_s": 0, "period_s": 3600}})
    assert params.forecast == ForecastParams(horizon_s=0, period_s=3600)
    assert ForecastParams().keep_s == 86400 + 600
    with pytest.raises(ValueError, match=r"shift\.forecast: unknown key\(s\) horizon\b"):
        ShiftParams.from_mapping({"forecast": {"horizon": 60}})


def demand(name: str, rate: float) -> ModelDemand:
    return ModelDemand(name, "llama-2-7b", rate, 512, 128, Slo(2.0, 0.1))


def test_the_rate_window_keeps_rates_for_the_forecast_and_feeds_the_policy() -> None:
    w = RateWindow({"up": 1.0, "flat": 1.0}, window_s=60, keep_s=600)
    done = {"up": 0.0, "flat": 0.0}
    up_rate = 1.0
    for t in range(0, 901, 10):  # "up" gains 0.01 req/s every second; "flat" 2 req/s
        w.observe(float(t), dict(done), ["up", "flat"])
        done["up"] += up_rate * 10
        done["flat"] += 20
        up_rate += 0.1
    # kept: the rates of the last 600 s only (61 readings, 300 .. 900 s)
    assert [t for t, _ in w.series["up"]] == [float(t) for t in range(300, 901, 10)]
    expected = w.expected_rates_per_s(900.0, TEN_MIN)
    assert expected["flat"] == pytest.approx(2.0)
    # the window's rate lags the arrivals by 30 s; its line still rises 0.01 req/s per s:
    # at 900 s it reads 9.65, at the horizon (1500 s) 6 req/s more
    assert expected["up"] == pytest.approx(w.rates_per_s["up"] + 0.01 * 600, rel=1e-6)
    states = model_states([demand("up", 1.0), demand("flat", 1.0)], w.rates_per_s, {}, 1,
                          expected)  # fmt: skip
    assert [s.expected_request_rate_per_s for s in states] == [expected["up"], expected["flat"]]
    without = model_states([demand("flat", 1.0)], w.rates_per_s, {}, 1)
    assert without[0].expected_rate_per_s == w.rates_per_s["flat"]  # priced at the rate now
    # no forecast kept: none given
    assert RateWindow({"up": 1.0}).expected_rates_per_s(900.0, TEN_MIN) == {}
