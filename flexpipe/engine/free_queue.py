"""The block manager's free queue: free KV blocks in eviction order (least recently freed
first), with O(1) append, O(1) pop of the oldest and O(1) removal from the middle (a cache hit
on a free block).

A `deque` of block ids with lazy removal: removing a block only counts it in `_skip[block]`;
the entry stays in the deque and is dropped when it reaches the head. A block has at most one
live entry, its latest (it is appended only once its last reference is dropped, which cannot
happen while it is free), so every skipped entry of a block comes before its live one; when
there are more skipped entries than blocks, the deque is rebuilt without them. A
deque's `popleft`/`append` are several times cheaper than an `OrderedDict`'s `popitem` and
insertion, and allocating and freeing a request's blocks is the simulator's most frequent
bookkeeping (every prompt block of every request, twice).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator


class FreeQueue:
    __slots__ = ("_num_free", "_num_skipped", "_queue", "_skip")

    def __init__(self, num_blocks: int) -> None:
        self._queue: deque[int] = deque(range(num_blocks))
        self._skip = [0] * num_blocks  # block id -> its removed entries still in the deque
        self._num_free = num_blocks
        self._num_skipped = 0  # sum of `_skip`

    def __len__(self) -> int:
        return self._num_free

    def __iter__(self) -> Iterator[int]:
        """The free blocks, oldest first."""
        skip = {b: n for b, n in enumerate(self._skip) if n} if self._num_skipped else {}
        for b in self._queue:
            n = skip.get(b, 0)
            if n:
                skip[b] = n - 1
            else:
                yield b

    def append(self, block: int) -> None:
        self._queue.append(block)
        self._num_free += 1

    def remove(self, block: int) -> None:
        """Take a free block out of the queue (the caller knows it is free)."""
        self._skip[block] += 1
        self._num_skipped += 1
        self._num_free -= 1
        if self._num_skipped > len(self._skip):
            self._compact()

    def _compact(self) -> None:
        """Drop every skipped entry (more of them than blocks: hits on free blocks outpaced
        the pops that drop them at the head), so the deque stays within twice the blocks."""
        live = deque(iter(self))
        self._queue = live
        self._skip = [0] * len(self._skip)
        self._num_skipped = 0

    def pop(self, num: int) -> list[int]:
        """The `num` oldest free blocks, oldest first (the caller checked there are as many)."""
        popleft = self._queue.popleft
        out = [popleft() for _ in range(num)]
        self._num_free -= num
        if self._num_skipped:
            skip = self._skip
            if any(skip[b] for b in out):
                out = self._drop_skipped(out, num)
        return out

    def pop_one(self) -> int:
        """The oldest free block (`pop(1)[0]`)."""
        b = self._queue.popleft()
        self._num_free -= 1
        if self._num_skipped and self._skip[b]:
            return self._drop_skipped([b], 1)[0]
        return b

    def _drop_skipped(self, popped: list[int], num: int) -> list[int]:
        skip = self._skip
        popleft = self._queue.popleft
        out: list[int] = []
        pending = deque(popped)
        while len(out) < num:
            b = pending.popleft() if pending else popleft()
            if skip[b]:
                skip[b] -= 1
                self._num_skipped -= 1
            else:
                out.append(b)
        return out
