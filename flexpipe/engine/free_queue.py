"""The block manager's free queue: free KV blocks in eviction order (least recently freed
first), kept as ranges of blocks rather than one entry per block.

Blocks are freed a request at a time, tail first, and a request's blocks are runs of one
prefix-cache entry after another (flexpipe.engine.block_manager, `Run`), so the blocks freed
together are a few ranges: an `Entry` is either a range of a run's blocks (its offsets
`hi - 1` down to `lo`, in queue order) or a number of anonymous blocks (no cache entry: any
one is as good as another, so they need no names). Popping n blocks takes from the oldest
entries; evicting a run's blocks shortens its cached prefix (`Run.extent`).

A cache hit takes free blocks back out of the middle of the queue: always a run's lowest free
offsets, which its most recently queued entries hold, so those entries are cut from below
(`Run.take_free`) and an entry cut to nothing is dropped when it reaches the head.

Why ranges: allocating, registering, freeing and evicting every prompt block of every request
one by one was the simulator's most frequent bookkeeping, and the dicts it touched per block
outgrew the CPU caches.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flexpipe.engine.block_manager import Run


class Entry:
    """Free blocks queued together: `run`'s offsets hi - 1 down to lo, or (run None) hi - lo
    anonymous blocks. Empty once hi <= lo."""

    __slots__ = ("hi", "lo", "run")

    def __init__(self, run: Run | None, lo: int, hi: int) -> None:
        self.run = run
        self.lo = lo
        self.hi = hi


class FreeQueue:
    __slots__ = ("_entries", "_num_free")

    def __init__(self, num_blocks: int) -> None:
        self._entries: deque[Entry] = deque([Entry(None, 0, num_blocks)])
        self._num_free = num_blocks

    def __len__(self) -> int:
        return self._num_free

    def entries(self) -> list[Entry]:
        """The live entries, oldest first (for inspection)."""
        return [e for e in self._entries if e.hi > e.lo]

    def add_anonymous(self, num: int) -> None:
        if num > 0:
            last = self._entries[-1] if self._entries else None
            if last is not None and last.run is None and last.hi > last.lo:
                last.hi += num  # (anonymous blocks are interchangeable: one entry)
            else:
                self._entries.append(Entry(None, 0, num))
            self._num_free += num

    def add_run(self, run: Run, lo: int, hi: int) -> None:
        """`run`'s offsets hi - 1 down to lo were freed."""
        entry = Entry(run, lo, hi)
        self._entries.append(entry)
        run.entries.append(entry)
        self._num_free += hi - lo

    def taken(self, num: int) -> None:
        """`num` free blocks were taken out of the middle by cache hits (`Run.take_free`)."""
        self._num_free -= num

    def pop(self, num: int) -> None:
        """Take the `num` oldest free blocks for reuse, evicting their cache entries (the
        caller checked there are as many)."""
        self._num_free -= num
        entries = self._entries
        while num:
            entry = entries[0]
            live = entry.hi - entry.lo
            if live > num:
                entry.hi -= num
                if entry.run is not None:
                    entry.run.evict_to(entry.hi)
                return
            entries.popleft()
            if live <= 0:
                continue  # cut to nothing by cache hits
            num -= live
            run = entry.run
            if run is not None:
                run.entries.remove(entry)
                run.evict_to(entry.lo)

    def forget_runs(self) -> None:
        """Every free block forgets its cache entry (the prefix cache was reset)."""
        num = self._num_free
        self._entries = deque([Entry(None, 0, num)] if num else [])
