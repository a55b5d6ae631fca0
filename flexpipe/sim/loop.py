"""The discrete-event loop: a virtual clock and a heap of actions.

The heap key is `(time_s, priority, seq)`: at equal times a lower priority runs first, and
at equal (time, priority) the action scheduled first runs first (`seq` is this loop's own
counter, so two simulations in one process never interfere). An action is called with its
time and may schedule follow-ups. Nothing here reads a wall clock.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Action = Callable[[float], None]

# priorities at equal times: steps that end first (their tokens exist), then the control
# policy, then arrivals, then the gateway's metrics scrape
STEP_END = 0
CONTROL = 1
ARRIVAL = 2
SCRAPE = 3


class EventLoop:
    def __init__(self) -> None:
        self.now_s = 0.0
        self.num_events = 0
        self._heap: list[tuple[float, int, int, Action]] = []
        self._seq = 0

    def at(self, time_s: float, priority: int, action: Action) -> None:
        """Run `action(time_s)` at `time_s` (never earlier than now)."""
        self._seq += 1
        if time_s < self.now_s:
            time_s = self.now_s
        heapq.heappush(self._heap, (time_s, priority, self._seq, action))

    def run(self, until_s: float) -> None:
        """Run every action due at or before `until_s`; the clock ends at `until_s`."""
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= until_s:
            time_s, _, _, action = pop(heap)
            self.now_s = time_s
            self.num_events += 1
            action(time_s)
        self.now_s = max(self.now_s, until_s)

    @property
    def num_pending(self) -> int:
        return len(self._heap)


# the collector's thresholds while a simulation runs (CPython's defaults: 700, 10, 10)
_RUN_GC_THRESHOLDS = (20_000, 20, 20)


@contextmanager
def relaxed_gc() -> Iterator[None]:
    """Collect garbage less often while a simulation runs, and never look at what exists
    when it starts (the scenario's requests, all generated up front): a run allocates a few
    short-lived objects per event, few of them in cycles, and the collector's passes over
    them were ~4% of a run's CPU time. The process's settings are restored afterwards."""
    thresholds = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0  # (leave a caller's frozen objects frozen)
    if freeze:
        gc.freeze()
    gc.set_threshold(*_RUN_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if freeze:
            gc.unfreeze()
