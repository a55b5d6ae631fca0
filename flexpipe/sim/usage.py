"""GPU time by interval: reserved (an instance holds its GPUs, loading or serving) and busy
(its engine is computing a step), in GPU-seconds per report interval.

The intervals cover the whole run: the scenario's duration (arrivals) and the drain after
it, until the last accepted request ended, so every GPU-second spent on a request the report
counts is billed (`close` pads the series to the run's end).

A sleeping engine (sleep mode) is not reserved: it serves nothing and keeps only part of its
GPUs' memory (vLLM's allocator context, not weights or KV cache) and, at level 1, its weights
in host RAM. Its time is counted apart (`asleep`): GPU-seconds, GPU memory and host RAM
byte-seconds, so that reservation against the peak stays honest.

Engines that share a GPU in memory (docs/gpu-sharing.md) hold and compute on it together: their
spans are kept per GPU and merged at `close`, so that a shared GPU is billed once while any of
them holds it, and busy once while any of them computes."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable


class Usage:
    def __init__(self, duration_s: float, interval_s: float) -> None:
        self.interval_s = interval_s
        n = max(1, math.ceil(duration_s / interval_s))
        self.reserved_gpu_s = [0.0] * n
        self.busy_gpu_s = [0.0] * n
        self.end_s = duration_s  # the run's end (`close`)
        self.last_busy_s = 0.0  # when the last step computed ended
        # held by sleeping engines (totals over the run)
        self.asleep_gpu_s = 0.0
        self.asleep_gpu_memory_byte_s = 0.0
        self.asleep_host_ram_byte_s = 0.0
        # GPU id -> spans (start_s, end_s) of engines sharing it, merged at `close`
        self._shared_reserved: dict[str, list[tuple[float, float]]] = {}
        self._shared_busy: dict[str, list[tuple[float, float]]] = {}

    def _add(self, buckets: list[float], num_gpus: int, start_s: float, end_s: float) -> None:
        if end_s <= start_s:
            return
        step = self.interval_s
        i = int(start_s // step)
        if end_s <= (i + 1) * step and i < len(buckets):  # within one interval (most steps)
            buckets[i] += num_gpus * (end_s - start_s)
            return
        self._grow(math.ceil(end_s / step))
        while start_s < end_s:
            edge = min(end_s, (i + 1) * step)
            buckets[i] += num_gpus * (edge - start_s)
            start_s = edge
            i += 1

    def _grow(self, num_intervals: int) -> None:
        for series in (self.reserved_gpu_s, self.busy_gpu_s):
            if len(series) < num_intervals:
                series.extend([0.0] * (num_intervals - len(series)))

    def reserve(self, num_gpus: int, start_s: float, end_s: float) -> None:
        self._add(self.reserved_gpu_s, num_gpus, start_s, end_s)

    def asleep(
        self, num_gpus: int, start_s: float, end_s: float, gpu_bytes: float, host_bytes: float
    ) -> None:
        """An engine on `num_gpus` asleep from `start_s` to `end_s`, holding `gpu_bytes` of
        their memory and `host_bytes` of host RAM."""
        span_s = max(0.0, end_s - start_s)
        self.asleep_gpu_s += num_gpus * span_s
        self.asleep_gpu_memory_byte_s += gpu_bytes * span_s
        self.asleep_host_ram_byte_s += host_bytes * span_s

    def busy(self, num_gpus: int, start_s: float, end_s: float) -> None:
        if end_s > self.last_busy_s:
            self.last_busy_s = end_s
        self._add(self.busy_gpu_s, num_gpus, start_s, end_s)

    def hold(self, gpu_ids: tuple[str, ...], shared: bool, start_s: float, end_s: float) -> None:
        """An engine on `gpu_ids` held them from `start_s` to `end_s` (`shared`: with others)."""
        if not shared:
            self.reserve(len(gpu_ids), start_s, end_s)
        elif end_s > start_s:
            for g in gpu_ids:
                self._shared_reserved.setdefault(g, []).append((start_s, end_s))

    def on_busy(self, gpu_ids: tuple[str, ...], shared: bool) -> Callable[[float, float], None]:
        """What an engine on `gpu_ids` calls when it computed from `start_s` to `end_s`."""
        if not shared:
            return functools.partial(self.busy, len(gpu_ids))

        def busy(start_s: float, end_s: float) -> None:
            self.last_busy_s = max(self.last_busy_s, end_s)
            for g in gpu_ids:
                self._shared_busy.setdefault(g, []).append((start_s, end_s))

        return busy

    def close(self, end_s: float) -> None:
        """The run ended at `end_s` (at least the duration): the series reach it; shared GPUs'
        spans are merged and counted once."""
        self.end_s = max(self.end_s, end_s)
        self._grow(math.ceil(self.end_s / self.interval_s))
        for spans, buckets in (
            (self._shared_reserved, self.reserved_gpu_s),
            (self._shared_busy, self.busy_gpu_s),
        ):
            for g in sorted(spans):
                for start_s, stop_s in merged(spans[g]):
                    self._add(buckets, 1, start_s, stop_s)
            spans.clear()
        self._grow(math.ceil(self.end_s / self.interval_s))

    def interval_s_at(self, i: int) -> float:
        """The length of interval `i` (the last one may be cut by the run's end)."""
        lo = i * self.interval_s
        return min(lo + self.interval_s, self.end_s) - lo


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of `spans` as disjoint spans, in time order."""
    out: list[tuple[float, float]] = []
    for start_s, end_s in sorted(spans):
        if out and start_s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end_s))
        else:
            out.append((start_s, end_s))
    return out
