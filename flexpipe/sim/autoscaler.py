"""Knative's reactive autoscaler (KPA) for one model: how many replicas, from the observed
concurrency. Pure: samples and `now` in, a replica count out; no clock, no I/O.

The algorithm is Knative Serving's (`pkg/autoscaler/scaling/autoscaler.go`, `Scale`), with the
defaults of its `config-autoscaler` ConfigMap (docs "Configuring the autoscaler"):

- target concurrency per replica: `container-concurrency-target` x
  `target-utilization-percentage` (70 %); here the gear's max_num_seqs x 0.7;
- `stable-window` 60 s; panic window `panic-window-percentage` 10 % of it = 6 s;
- desired replicas from each window's average concurrency: ceil(average / target), kept in
  [floor(ready / `max-scale-down-rate` 2), ceil(ready x `max-scale-up-rate` 1000)] with
  ready = max(1, ready replicas);
- panic when the panic window's desired count / ready >= `panic-threshold-percentage` 200 %;
  while panicking the count only rises (the most either window asked for since the panic
  began), and the panic ends a stable window after the last time it was over the threshold;
- scale to zero once the stable window has seen no request in flight (Knative's
  `scale-to-zero-grace-period` 30 s is shorter than that window, so never binds here);
  `initial-scale` 1;
- evaluated every `tick-interval` 2 s.

Concurrency is sampled once a tick (Knative's queue-proxy averages per second): the windows
average the samples taken in them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class KpaParams:
    target_utilization: float = 0.7  # target-utilization-percentage 70
    stable_window_s: float = 60.0  # stable-window
    panic_window_s: float = 6.0  # panic-window-percentage 10 % of the stable window
    panic_threshold: float = 2.0  # panic-threshold-percentage 200
    max_scale_up_rate: float = 1000.0  # max-scale-up-rate
    max_scale_down_rate: float = 2.0  # max-scale-down-rate
    scale_to_zero_grace_s: float = 30.0  # scale-to-zero-grace-period
    tick_s: float = 2.0  # tick-interval
    initial_scale: int = 1  # initial-scale

    def __post_init__(self) -> None:
        if not 0 < self.target_utilization <= 1:
            raise ValueError("target_utilization must be in (0, 1]")
        if not 0 < self.panic_window_s <= self.stable_window_s:
            raise ValueError("panic_window_s must be in (0, stable_window_s]")
        if self.max_scale_up_rate <= 1 or self.max_scale_down_rate <= 1:
            raise ValueError("max_scale_up_rate and max_scale_down_rate must be > 1")
        if self.tick_s <= 0 or self.initial_scale < 0:
            raise ValueError("tick_s must be > 0 and initial_scale >= 0")


@dataclass(slots=True)
class KpaScaler:
    """One model's autoscaler: `observe` a concurrency sample each tick, then `scale`."""

    target_per_replica: float  # the concurrency one replica is meant to carry
    params: KpaParams = field(default_factory=KpaParams)
    samples: deque[tuple[float, float]] = field(default_factory=deque)  # (time_s, concurrency)
    first_sample_s: float | None = None
    panic_since_s: float | None = None  # Knative's panicTime: the last time over threshold
    max_panic_replicas: int = 0

    def observe(self, now: float, concurrency: float) -> None:
        if self.first_sample_s is None:
            self.first_sample_s = now
        self.samples.append((now, concurrency))
        while self.samples and self.samples[0][0] <= now - self.params.stable_window_s:
            self.samples.popleft()

    def _average(self, now: float, window_s: float) -> float:
        values = [c for t, c in self.samples if t > now - window_s]
        return sum(values) / len(values) if values else 0.0

    @property
    def panicking(self) -> bool:
        return self.panic_since_s is not None

    def scale(self, now: float, num_ready: int) -> int:
        """The replicas wanted now, `num_ready` of the current ones taking requests."""
        p = self.params
        ready = max(1, num_ready)
        max_up = math.ceil(p.max_scale_up_rate * ready)
        max_down = math.floor(ready / p.max_scale_down_rate)
        stable = self._average(now, p.stable_window_s)
        panic = self._average(now, p.panic_window_s)
        dspc = math.ceil(stable / self.target_per_replica)
        dppc = math.ceil(panic / self.target_per_replica)
        desired_stable = min(max(dspc, max_down), max_up)
        desired_panic = min(max(dppc, max_down), max_up)
        over = dppc / ready >= p.panic_threshold
        if over:
            self.panic_since_s = now  # begin panicking, or stay in panic
        elif self.panic_since_s is not None and self.panic_since_s + p.stable_window_s < now:
            self.panic_since_s = None
            self.max_panic_replicas = 0
        if self.panic_since_s is not None:
            # (the larger of the two windows' asks: the stable one may be the larger)
            wanted = max(desired_stable, desired_panic)
            self.max_panic_replicas = max(self.max_panic_replicas, wanted)
            return self.max_panic_replicas  # never down while panicking
        if desired_stable == 0 and not self._idle_long_enough(now):
            return max(p.initial_scale, num_ready)  # the window has not seen its length yet
        return desired_stable

    def _idle_long_enough(self, now: float) -> bool:
        """Zero only once the samples cover the stable window (and the grace period)."""
        p = self.params
        span = max(p.stable_window_s, p.scale_to_zero_grace_s)
        return self.first_sample_s is not None and self.first_sample_s <= now - span
