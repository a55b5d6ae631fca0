"""A model's expected arrival rate over the next `horizon_s` (docs/shift-policy.md, "The expected
load": a shift is priced at the current *and the expected* load). Pure: rate samples and `now_s` in,
a `Forecast` out.

Two readings; the expected rate is the higher of those that exist:

- **trend**: the least-squares line through the rates of the last `trend_window_s`, read at
  `now_s` and at `now_s + horizon_s`, the higher of the two (at least 0) — the highest rate
  the line reaches within the horizon. Only once the window's samples span
  `min_trend_span_s`: a line through a minute of noisy readings, extrapolated ten minutes
  ahead, is noise.
- **yesterday**: the highest rate of the same stretch one `period_s` ago
  (`[now - period, now - period + horizon]`), where the history reaches back that far.

Neither (a young history, or `horizon_s` 0): None, and the policy prices at the rate measured
now, as without a forecast. The higher wins because what the forecast is for is keeping a
trough from shrinking a model right before its peak: a forecast too high costs GPU-time for
one horizon; one too low costs the requests of a cold start and five samples in the up zone.
A falling trend reads as the rate now (the line at `now_s`), never lower: the forecast only
holds capacity back, it never hurries a down-shift.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Forecast", "ForecastParams", "forecast"]

RateSample = tuple[float, float]  # (time s, arrival rate per s), oldest first


@dataclass(frozen=True, slots=True)
class ForecastParams:
    horizon_s: float = 600.0  # how far ahead; 0: no forecast (priced at the rate now)
    trend_window_s: float = 600.0  # the trend's line fits the rates of this window
    min_trend_span_s: float = 300.0  # ... once its samples span at least this long
    period_s: float = 86400.0  # "the same time yesterday"; 0: no seasonal reading

    def __post_init__(self) -> None:
        if min(self.horizon_s, self.trend_window_s, self.min_trend_span_s, self.period_s) < 0:
            raise ValueError("horizon_s, trend_window_s, min_trend_span_s, period_s must be >= 0")
        if self.min_trend_span_s > self.trend_window_s:
            raise ValueError("min_trend_span_s must be <= trend_window_s")

    @property
    def keep_s(self) -> float:
        """How much rate history the forecast reads (what a caller keeps)."""
        if self.horizon_s <= 0:
            return 0.0
        return max(self.trend_window_s, self.period_s + self.horizon_s if self.period_s else 0)


@dataclass(frozen=True, slots=True)
class Forecast:
    trend_per_s: float | None = None  # None: too little history for a line
    yesterday_per_s: float | None = None  # None: no sample one period ago

    @property
    def expected_per_s(self) -> float | None:
        """The higher of the readings there are; None: neither."""
        readings = [r for r in (self.trend_per_s, self.yesterday_per_s) if r is not None]
        return max(readings) if readings else None


def forecast(samples: Sequence[RateSample], now_s: float, params: ForecastParams) -> Forecast:
    """`samples`: (time s, rate per s), oldest first; those after `now_s` are ignored."""
    if params.horizon_s <= 0 or not samples:
        return Forecast()
    end = bisect.bisect_right(samples, now_s, key=_time)
    return Forecast(
        _trend(
            samples[bisect.bisect_left(samples, now_s - params.trend_window_s, key=_time) : end],
            now_s,
            params,
        ),
        _yesterday(samples[:end], now_s, params),
    )


def _time(sample: RateSample) -> float:
    return sample[0]


def _trend(window: Sequence[RateSample], now_s: float, params: ForecastParams) -> float | None:
    if len(window) < 2 or window[-1][0] - window[0][0] < max(params.min_trend_span_s, 1e-9):
        return None
    mean_t = sum(t for t, _ in window) / len(window)
    mean_r = sum(r for _, r in window) / len(window)
    var_t = sum((t - mean_t) ** 2 for t, _ in window)
    slope = sum((t - mean_t) * (r - mean_r) for t, r in window) / var_t

    def line(at_s: float) -> float:
        return mean_r + slope * (at_s - mean_t)

    return max(0.0, line(now_s), line(now_s + params.horizon_s))


def _yesterday(history: Sequence[RateSample], now_s: float, params: ForecastParams) -> float | None:
    if params.period_s <= 0 or history[0][0] > now_s - params.period_s:
        return None  # the history does not reach back one period
    start = now_s - params.period_s
    lo = bisect.bisect_left(history, start, key=_time)
    hi = bisect.bisect_right(history, start + params.horizon_s, key=_time)
    return max((r for _, r in history[lo:hi]), default=None)
