"""Watch a Ray cluster's inventory: every `interval_s`, read it (flexpipe/cluster/ray_inventory)
and compare it with the last cluster (`resources.diff`): a node that left is `lost` GPUs, a
node that joined is `joined` GPUs, other Ray work taking or giving back GPUs is `occupied` /
`freed`. The same shape as `ClusterWatch` (`cluster`, `poll(now_s)`, `changes()`), so the
controller takes either.

A change in GPUs held by other Ray work must be seen in two polls in a row before it counts:
Ray updates a node's available resources a moment after a placement group is created or
removed, and one poll in between would report our own GPUs as taken by others. Nodes joining
or leaving count at once. A read that fails (the head unreachable) keeps the last cluster and
is reported once until it changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from flexpipe.cluster import Cluster, ClusterError
from flexpipe.control.watch.poller import Change, changed, check_interval, poll_changes, report_once

__all__ = ["RayWatch"]

log = logging.getLogger("flexpipe.control.watch.ray_watch")


def _log_warning(line: str) -> None:
    log.warning("%s", line)


def _gpu_set(cluster: Cluster) -> set[tuple[str, str, int, str]]:
    return {(g.id, g.node, g.index, g.type) for g in cluster.gpus}


class RayWatch:
    """The Ray cluster's inventory as last read, and the changes since."""

    def __init__(
        self,
        read: Callable[[], Cluster],
        interval_s: float = 2.0,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.time,
        report: Callable[[str], None] = _log_warning,
    ) -> None:
        """`read`: one inventory read (`lambda: read_ray_cluster(address, overlay)`); the
        first must succeed."""
        self._read = read
        self.interval_s = check_interval(interval_s)
        self._sleep = sleep
        self._clock = clock
        self._report = report
        self.error: str | None = None
        self.num_polls = 0
        self.cluster: Cluster = read()
        self._pending: Cluster | None = None  # a usage change seen once, not yet counted

    def poll(self, now_s: float) -> Change | None:
        """Read once; the new cluster and its events when it changed, else None."""
        self.num_polls += 1
        try:
            new = self._read()
        except (ClusterError, RuntimeError, OSError) as exc:
            line = f"ray inventory: {exc} (keeping the last cluster)"
            self.error = report_once(self.error, line, self._report)
            return None
        self.error = None
        if new == self.cluster:
            self._pending = None
            return None
        if _gpu_set(new) == _gpu_set(self.cluster) and new != self._pending:
            self._pending = new  # only usage changed: count it when the next poll agrees
            return None
        self._pending = None
        change = changed(self.cluster, new, now_s)
        self.cluster = new
        return change

    def changes(self) -> AsyncIterator[Change]:
        """`poll` every `interval_s`; each change (cancel the consuming task to stop)."""
        return poll_changes(self.poll, self.interval_s, self._sleep, self._clock)
