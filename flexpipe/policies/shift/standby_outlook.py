"""The rate each model's standby set is sized for, from its outlook (pure; `standby.
outlook_horizon_s`, off by default; docs/shift-policy.md, "The outlook").

Without it a standby set is sized for the declared mean rate times an operator's
`rate_factor`, or the highest rate measured: one factor for every model, though how far a
model bursts above its mean depends on how often and how long it bursts (a model busy 10 %
of the time at 8 req/s has a mean of 0.8: a factor of 12 sizes it for 9.6; one busy 3 % of
the time, a mean of 0.28, for 3.4 and its bursts miss). With it, once a model's rate history
shows bursts (`forecast.outlook`: runs of samples over twice the median), its set is sized
for the mean burst peak seen times `burst_margin` where a burst is likely within the horizon
(`burst_likelihood` at least `min_burst_likelihood`), else for the outlook's
`demand_per_s` (a model whose bursts stopped keeps less). A model with no burst seen keeps
the operator's factor: nothing better is known of it yet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flexpipe.policies.shift.forecast import ForecastParams, RateSample, outlook
from flexpipe.policies.shift.standby_sleepers import StandbyParams

__all__ = ["outlook_rates"]


def outlook_rates(
    history: Mapping[str, Sequence[RateSample]],
    now_s: float,
    forecast: ForecastParams,
    params: StandbyParams,
) -> dict[str, float]:
    """Model -> the rate its standby set is sized for (`standby_rate_per_s` takes it in
    place of the factor's), for the models whose history (`history`: model -> (time s,
    rate per s), oldest first) shows a burst; the others are left out. Off
    (`outlook_horizon_s` 0): empty."""
    if params.outlook_horizon_s <= 0:
        return {}
    out: dict[str, float] = {}
    for model, samples in sorted(history.items()):
        seen = outlook(samples, now_s, forecast, params.outlook_horizon_s)
        if seen.burst_peak_per_s is None:
            continue
        if seen.burst_likelihood >= params.min_burst_likelihood:
            out[model] = max(seen.expected_per_s, seen.burst_peak_per_s * params.burst_margin)
        else:
            out[model] = seen.demand_per_s
    return out
