"""What the controller tells the shift policy about a model, from its readings (pure).

- `RateWindow`: the arrival rate as the controller measures it: finished requests per model
  (the gateway's `flexpipe_requests_total`) over the last minute of readings, per modelled
  second (`time_scale`: wall seconds per modelled second of sim engines); it keeps each
  model's rates for `keep_s` (a day and a horizon by default) and forecasts the rate
  expected over the next horizon from them (`expected_rates_per_s`: policies/shift/forecast.py;
  `restore` takes back what an earlier run kept in the store, control/state/rate_memory.py);
- `model_state`: the `ModelState` of one model from its demand, the rate measured now, the
  rate expected, its recent samples and the floor under its minimum (a model whose minimum
  is 0 may be idle at rate 0, and so scale to zero).

The live controller and the simulator both call these, so the policy sees the same signals.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping, Sequence

from flexpipe.policies.planner import ModelDemand
from flexpipe.policies.shift.forecast import ForecastParams, forecast
from flexpipe.policies.shift.signals import Sample
from flexpipe.policies.shift.snapshot import ModelState

__all__ = ["MAX_SAMPLES_GIVEN", "RATE_WINDOW_S", "RateWindow", "model_state", "model_states"]

RATE_WINDOW_S = 60.0
MAX_SAMPLES_GIVEN = 20  # the newest samples handed to the policy (its window is 60 s)


class RateWindow:
    """Finished-request counters in, arrival rates out (see the module docstring)."""

    def __init__(
        self,
        rates_per_s: Mapping[str, float],
        window_s: float = RATE_WINDOW_S,
        keep_s: float = 0.0,
    ) -> None:
        """`keep_s`: how long each model's measured rates are kept for the forecast
        (`ForecastParams.keep_s`; 0: not kept)."""
        self.window_s = window_s
        self.keep_s = keep_s
        self.rates_per_s: dict[str, float] = dict(rates_per_s)  # model -> rate measured now
        self._history: deque[tuple[float, dict[str, float]]] = deque()
        # model -> (time s, rate measured then), oldest first: the forecast's input
        self.series: dict[str, deque[tuple[float, float]]] = {}

    def observe(
        self, now_s: float, done: Mapping[str, float], models: Sequence[str], time_scale: float = 1
    ) -> dict[str, float]:
        """`done`: cumulative finished requests per model at `now_s`. Returns the rates."""
        scale = time_scale if time_scale > 0 else 1.0
        self._history.append((now_s, dict(done)))
        while len(self._history) > 2 and now_s - self._history[0][0] > self.window_s:
            self._history.popleft()
        t0, first = self._history[0]
        if now_s > t0:
            for name in models:
                finished = max(0.0, done.get(name, 0.0) - first.get(name, 0.0))
                self.rates_per_s[name] = finished / (now_s - t0) * scale
                if self.keep_s > 0:
                    series = self.series.setdefault(name, deque())
                    series.append((now_s, self.rates_per_s[name]))
                    while now_s - series[0][0] > self.keep_s:
                        series.popleft()
        return dict(self.rates_per_s)

    def restore(self, name: str, samples: Sequence[tuple[float, float]]) -> int:
        """Put an earlier run's rates of `name` (time s in this window's clock, oldest first)
        before those measured since; returns how many were taken."""
        if self.keep_s <= 0:
            return 0
        series = self.series.setdefault(name, deque())
        first_s = series[0][0] if series else math.inf
        older = [(t, r) for t, r in samples if t < first_s]
        series.extendleft(reversed(older))
        return len(older)

    def expected_rates_per_s(self, now_s: float, params: ForecastParams) -> dict[str, float]:
        """Each model's forecast rate over the next horizon, for those that have one."""
        out: dict[str, float] = {}
        for name, series in self.series.items():
            expected = forecast(list(series), now_s, params).expected_per_s
            if expected is not None:
                out[name] = expected
        return out


def model_state(
    demand: ModelDemand,
    rate_per_s: float | None,
    samples: Sequence[Sample],
    min_instances_floor: int,
    expected_rate_per_s: float | None = None,
) -> ModelState:
    """The policy's view of one model: the rate measured now (the configured demand until
    there is a reading), the rate forecast (None: priced at the rate now), the newest
    samples, the minimum at least `min_instances_floor`."""
    rate = demand.request_rate_per_s if rate_per_s is None else rate_per_s
    min_instances = max(min_instances_floor, demand.min_instances)
    if min_instances > 0:  # planned for some load, however idle
        rate = max(rate, 1e-3)
    return ModelState(
        dataclasses.replace(demand, request_rate_per_s=rate),
        tuple(samples[-MAX_SAMPLES_GIVEN:]),
        priority=demand.priority,
        min_instances=min_instances,
        expected_request_rate_per_s=expected_rate_per_s,
        declared_request_rate_per_s=demand.request_rate_per_s,
    )


def model_states(
    demands: Sequence[ModelDemand],
    rates_per_s: Mapping[str, float],
    samples: Mapping[str, Sequence[Sample]],
    min_instances_floor: int,
    expected_rates_per_s: Mapping[str, float] | None = None,
) -> list[ModelState]:
    """`model_state` of each demand, from the rates measured (`RateWindow.rates_per_s`), the
    rates forecast (`RateWindow.expected_rates_per_s`) and each model's samples."""
    expected = expected_rates_per_s or {}
    return [
        model_state(
            d,
            rates_per_s.get(d.name),
            samples.get(d.name, ()),
            min_instances_floor,
            expected.get(d.name),
        )
        for d in demands
    ]
