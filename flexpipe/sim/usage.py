"""GPU time by interval: reserved (an instance holds its GPUs, loading or serving) and busy
(its engine is computing a step), in GPU-seconds per report interval."""

from __future__ import annotations

import math


class Usage:
    def __init__(self, duration_s: float, interval_s: float) -> None:
        self.duration_s = duration_s
        self.interval_s = interval_s
        n = max(1, math.ceil(duration_s / interval_s))
        self.reserved_gpu_s = [0.0] * n
        self.busy_gpu_s = [0.0] * n

    def _add(self, buckets: list[float], num_gpus: int, start_s: float, end_s: float) -> None:
        end_s = min(end_s, self.duration_s)
        if end_s <= start_s:
            return
        step = self.interval_s
        i = int(start_s // step)
        if end_s <= (i + 1) * step and i < len(buckets):  # within one interval (most steps)
            buckets[i] += num_gpus * (end_s - start_s)
            return
        while start_s < end_s and i < len(buckets):
            edge = min(end_s, (i + 1) * step)
            buckets[i] += num_gpus * (edge - start_s)
            start_s = edge
            i += 1

    def reserve(self, num_gpus: int, start_s: float, end_s: float) -> None:
        self._add(self.reserved_gpu_s, num_gpus, start_s, end_s)

    def busy(self, num_gpus: int, start_s: float, end_s: float) -> None:
        self._add(self.busy_gpu_s, num_gpus, start_s, end_s)
