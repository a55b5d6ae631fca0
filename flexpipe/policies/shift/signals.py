"""What the shift policy sees of a model's health: samples, their pressures, the zone.

A `Sample` is one reading of a model's serving signals, taken by the controller (gateway stats
plus the engines' /metrics) or by the simulator. Pressures are unitless: queue depth over the
queue's capacity, and the worse of TTFT p99 / TTFT SLO and TPOT p99 / TPOT SLO. The zone of a
sample follows seed 000 §3.2: *up* when both the queue and the latency are near their limits,
*down* when the model is idle on all three signals, *hold* otherwise.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Pressure",
    "Sample",
    "Thresholds",
    "Zone",
    "pressure_of",
    "recent",
    "trailing_run",
    "zone_of",
]


class Zone(enum.Enum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of a model's signals at `at_s` (p99s over the producer's own window)."""

    at_s: float
    queue_depth: int  # requests waiting (gateway queue + engines' waiting queues)
    queue_capacity: int  # the most that may wait before the gateway sheds load
    ttft_p99_s: float | None  # None: no first token in the window (an idle model)
    tpot_p99_s: float | None
    utilization: float  # busy share of the model's engines, 0..1 (running seqs / max_num_seqs)

    def __post_init__(self) -> None:
        if self.queue_depth < 0 or self.queue_capacity < 1:
            raise ValueError("queue_depth must be >= 0 and queue_capacity >= 1")
        if not 0.0 <= self.utilization <= 1.0:
            raise ValueError(f"utilization must be in [0, 1] (got {self.utilization})")


@dataclass(frozen=True, slots=True)
class Pressure:
    queue: float  # queue_depth / queue_capacity
    latency: float  # max(TTFT p99 / SLO, TPOT p99 / SLO); 0 when nothing was served
    utilization: float


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Seed 000 §3.2's zone boundaries (strict inequalities, as in the seed's pseudo-code)."""

    up_queue: float = 0.7
    up_latency: float = 0.8
    down_utilization: float = 0.35
    down_queue: float = 0.3
    down_latency: float = 0.5


def pressure_of(sample: Sample, ttft_slo_s: float, tpot_slo_s: float) -> Pressure:
    ratios = [0.0]
    if sample.ttft_p99_s is not None:
        ratios.append(sample.ttft_p99_s / ttft_slo_s)
    if sample.tpot_p99_s is not None:
        ratios.append(sample.tpot_p99_s / tpot_slo_s)
    return Pressure(sample.queue_depth / sample.queue_capacity, max(ratios), sample.utilization)


def zone_of(pressure: Pressure, thresholds: Thresholds) -> Zone:
    t = thresholds
    if pressure.queue > t.up_queue and pressure.latency > t.up_latency:
        return Zone.UP
    if (
        pressure.utilization < t.down_utilization
        and pressure.queue < t.down_queue
        and pressure.latency < t.down_latency
    ):
        return Zone.DOWN
    return Zone.HOLD


def recent(samples: Sequence[Sample], now_s: float, window_s: float) -> list[Sample]:
    """The samples taken in `[now_s - window_s, now_s]`, oldest first (stale ones never count,
    nor ones stamped in the future)."""
    return sorted((s for s in samples if now_s - window_s <= s.at_s <= now_s), key=lambda s: s.at_s)


def trailing_run(zones: Sequence[Zone]) -> tuple[Zone, int]:
    """The zone of the newest sample and how many consecutive samples end in it."""
    if not zones:
        return Zone.HOLD, 0
    last = zones[-1]
    n = 0
    for z in reversed(zones):
        if z is not last:
            break
        n += 1
    return last, n
