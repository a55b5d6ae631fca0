"""What every cluster watch shares (the cluster file, NVML discovery, a Ray cluster's
inventory): each has a synchronous `poll(now_s)` that returns the new cluster and its events
when it changed, and runs it on an interval here; a problem is reported once, and again only
when it changes (not at every poll)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from flexpipe.cluster import Cluster
from flexpipe.control.core.resources import ResourceEvent, diff

__all__ = ["Change", "changed", "check_interval", "poll_changes", "report_once"]

Change = tuple[Cluster, list[ResourceEvent]]  # the new cluster, its events against the last


def check_interval(interval_s: float) -> float:
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s:g}")
    return interval_s


def changed(last: Cluster, new: Cluster, now_s: float) -> Change | None:
    """`new` and `diff(last, new, now_s)`, or None when they are the same cluster."""
    return None if new == last else (new, diff(last, new, now_s))


def report_once(last: str | None, line: str, report: Callable[[str], None]) -> str:
    """Report `line` unless it was the last one reported; returns it (the new last)."""
    if line != last:
        report(line)
    return line


async def poll_changes(
    poll: Callable[[float], Change | None],
    interval_s: float,
    sleep: Callable[[float], Awaitable[None]],
    clock: Callable[[], float],
) -> AsyncIterator[Change]:
    """Every `interval_s`, `poll(clock())` in a worker thread (a read may block: a large
    file, NVML, Ray's head); yield each change, forever (cancel the consuming task to stop)."""
    while True:
        await sleep(interval_s)
        change = await asyncio.to_thread(poll, clock())
        if change is not None:
            yield change
