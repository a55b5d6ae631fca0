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

`outlook` adds the burst pattern (inter-burst intervals, burst sizes) to the same reading:
each model's expected demand and burst likelihood over a horizon, for a caller deciding
where standby (sleeping) engines are kept.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Burst", "Forecast", "ForecastParams", "Outlook", "bursts", "forecast", "outlook"]

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


@dataclass(frozen=True, slots=True)
class Burst:
    """A stretch of a model's rate history over the burst level: when it started, how long it
    lasted (the last sample over the level minus the first) and its highest rate."""

    start_s: float
    duration_s: float
    peak_per_s: float


@dataclass(frozen=True, slots=True)
class Outlook:
    """What a model's history says of the next `horizon_s` (`outlook`).

    `expected_per_s`: the forecast (trend, yesterday) or, with neither, the rate now.
    `burst_likelihood`: the chance that a burst starts (or goes on) within the horizon, 0..1.
    `burst_peak_per_s`: the mean peak rate of the bursts seen (None: none seen).
    `demand_per_s`: the rate to keep capacity for, awake or asleep: the higher of the
    expected rate and the burst's peak weighted by its likelihood.
    """

    horizon_s: float
    expected_per_s: float
    burst_likelihood: float
    burst_peak_per_s: float | None
    mean_interval_s: float | None  # between burst starts (None: fewer than two bursts)
    in_burst: bool
    bursts: tuple[Burst, ...]

    @property
    def demand_per_s(self) -> float:
        burst = self.burst_likelihood * (self.burst_peak_per_s or 0.0)
        return max(self.expected_per_s, burst)


def bursts(samples: Sequence[RateSample], level_per_s: float) -> list[Burst]:
    """The maximal runs of samples whose rate is over `level_per_s`, oldest first."""
    out: list[Burst] = []
    start: RateSample | None = None
    last: RateSample | None = None
    peak = 0.0
    for t, r in samples:
        if r > level_per_s:
            if start is None:
                start, peak = (t, r), r
            last, peak = (t, r), max(peak, r)
        elif start is not None and last is not None:
            out.append(Burst(start[0], last[0] - start[0], peak))
            start = last = None
    if start is not None and last is not None:
        out.append(Burst(start[0], last[0] - start[0], peak))
    return out


def outlook(
    samples: Sequence[RateSample],
    now_s: float,
    params: ForecastParams,
    horizon_s: float | None = None,
    burst_factor: float = 2.0,
    min_burst_per_s: float = 0.1,
) -> Outlook:
    """A model's expected demand and burst likelihood over the next `horizon_s` (default
    `params.horizon_s`), from its rate history (`samples`: (time s, rate per s), oldest
    first, as `RateWindow.series` keeps them; those after `now_s` are ignored). Pure.

    - the daily curve and the trend: `forecast` (read over `horizon_s`);
    - the burst pattern: a burst is a run of samples over `burst_factor` x the median rate
      (and over `min_burst_per_s`: an idle model's median is 0). With two or more burst
      starts, their mean interval `m` gives the chance that one starts within the horizon as
      a Poisson arrival would, `1 - exp(-horizon / m)`; with one, the span of the history
      stands in for `m`; in a burst now (the newest sample over the level) it is 1.

    For a standby keeper: keep standbys of the models with the highest `burst_likelihood` x
    `burst_peak_per_s` (`Outlook.demand_per_s`), sized for `burst_peak_per_s`.
    """
    horizon = params.horizon_s if horizon_s is None else horizon_s
    if horizon < 0 or burst_factor <= 0 or min_burst_per_s < 0:
        raise ValueError("horizon_s, min_burst_per_s must be >= 0 and burst_factor > 0")
    history = samples[: bisect.bisect_right(samples, now_s, key=_time)]
    if not history:
        return Outlook(horizon, 0.0, 0.0, None, None, False, ())
    read = dataclasses.replace(params, horizon_s=horizon)
    expected = forecast(history, now_s, read).expected_per_s
    rates = sorted(r for _, r in history)
    median = rates[len(rates) // 2]
    level = max(burst_factor * median, min_burst_per_s)
    seen = tuple(bursts(history, level))
    in_burst = history[-1][1] > level
    peak = sum(b.peak_per_s for b in seen) / len(seen) if seen else None
    interval: float | None = None
    if len(seen) >= 2:
        interval = (seen[-1].start_s - seen[0].start_s) / (len(seen) - 1)
    if in_burst:
        likelihood = 1.0
    elif not seen or horizon <= 0:
        likelihood = 0.0
    else:
        mean_s = interval if interval is not None else max(now_s - history[0][0], 1e-9)
        likelihood = 1.0 - math.exp(-horizon / max(mean_s, 1e-9))
    return Outlook(
        horizon,
        history[-1][1] if expected is None else expected,
        likelihood,
        peak,
        interval,
        in_burst,
        seen,
    )
