"""How long a refused client should wait: `Retry-After` from the rate at which the gateway
actually finishes requests, instead of a constant.

A pure estimator with the clock injected (`now`): the gateway records each finished request,
and asks for the wait of a client that would stand behind `num_ahead` others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class DrainRate:
    """Requests finished per second, smoothed over about `window_s` (an exponentially
    weighted rate, updated on each completion; it decays when nothing finishes)."""

    window_s: float = 10.0
    rate_per_s: float = 0.0
    updated_s: float | None = None

    def record(self, now: float, num_finished: int = 1) -> None:
        if self.updated_s is None:
            self.updated_s = now
            self.rate_per_s = num_finished / self.window_s
            return
        self._decay(now)
        self.rate_per_s += num_finished / self.window_s

    def _decay(self, now: float) -> None:
        assert self.updated_s is not None
        dt = now - self.updated_s
        if dt > 0:
            self.rate_per_s *= math.exp(-dt / self.window_s)
            self.updated_s = now

    def rate(self, now: float) -> float:
        if self.updated_s is None:
            return 0.0
        self._decay(now)
        return self.rate_per_s

    def retry_after_s(
        self, num_ahead: int, now: float, min_s: float = 1.0, max_s: float = 60.0
    ) -> float:
        """Seconds until `num_ahead` requests would have drained at the current rate, clamped
        to [min_s, max_s] (max_s when nothing is finishing at all)."""
        rate = self.rate(now)
        if rate <= 0:
            return max_s
        return min(max_s, max(min_s, (num_ahead + 1) / rate))
