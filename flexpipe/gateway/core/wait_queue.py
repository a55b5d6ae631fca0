"""The gateway's wait queue: requests waiting for a slot, first come first served per model.

A slot that frees can only serve its own instance's model, so each model has its own line,
ordered by each request's ticket (taken when it first queued):

- a freed slot wakes the oldest waiter *of that model*. With one line for all models, a
  freed slot of one model woke another model's waiter, which found no slot and went to the
  back, while the waiter the slot was for slept on, often until its wait ran out (429);
- a woken request that still finds no slot (another took it first) goes back to its place,
  not to the back: a busy model's line no longer rotates, and its oldest request is served
  first;
- while a model has waiters, a new request of it queues behind them rather than taking a
  slot first (the caller asks `count(model)` before it takes one).

With `admission: {order: slack}` a waiter's place is its rank (core/deadline.py `rank`: least
slack first, then the tenant below its fair share), then its ticket; with the default order the
rank is empty and tickets alone decide.

Pure bookkeeping, no clock, no I/O: the live gateway keeps its waiters' futures here, the
simulator its calls.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Generic, TypeVar

__all__ = ["WaitQueue"]

T = TypeVar("T")

Rank = tuple[float, ...]


def _place_of(entry: tuple[Rank, int, object]) -> tuple[Rank, int]:
    return entry[0], entry[1]


def _ticket_of(entry: tuple[Rank, int, object]) -> int:
    return entry[1]


class WaitQueue(Generic[T]):
    def __init__(self) -> None:
        # model -> (rank, ticket, waiter), in order
        self._lines: dict[str, list[tuple[Rank, int, T]]] = {}
        self._num = 0
        self._next_ticket = 0

    def ticket(self) -> int:
        """A new request's place: after every request that queued before it."""
        self._next_ticket += 1
        return self._next_ticket

    def push(self, model: str, waiter: T, ticket: int, rank: Rank = ()) -> None:
        """`waiter` waits in `model`'s line at its place: `rank`, then `ticket`."""
        line = self._lines.setdefault(model, [])
        bisect.insort(line, (rank, ticket, waiter), key=_place_of)
        self._num += 1

    def remove(self, model: str, waiter: T) -> bool:
        """Take `waiter` out of `model`'s line (False if it was not there)."""
        line = self._lines.get(model)
        if not line:
            return False
        for i, (_, _, w) in enumerate(line):
            if w is waiter:
                del line[i]
                self._num -= 1
                if not line:
                    del self._lines[model]
                return True
        return False

    def line(self, model: str, after: int = 0, rank: Rank = ()) -> list[T]:
        """`model`'s waiters in order; with `after`, those placed after ticket `after` at
        `rank` (its place: the waiters behind it)."""
        if not after:
            return [w for _, _, w in self._lines.get(model, ())]
        return [w for r, t, w in self._lines.get(model, ()) if (r, t) > (rank, after)]

    def num_ahead(self, model: str, ticket: int, rank: Rank = ()) -> int:
        """How many of `model`'s waiters come before the place (`rank`, `ticket`)."""
        line = self._lines.get(model, [])
        return bisect.bisect_left(line, (rank, ticket), key=_place_of)

    def pop_first(self, model: str) -> T | None:
        """`model`'s oldest waiter, out of the line (None: nobody waits for it)."""
        line = self._lines.get(model)
        if not line:
            return None
        _, _, waiter = line.pop(0)
        self._num -= 1
        if not line:
            del self._lines[model]
        return waiter

    def waiters(self, priority: Mapping[str, float] | None = None) -> list[T]:
        """Every waiter, by ticket (the order they first queued in); with `priority` (model ->
        priority, 1 when not named), a higher-priority model's line first, each in its order."""
        if priority is not None:
            order = sorted(self._lines, key=lambda m: -priority.get(m, 1.0))
            return [w for m in order for _, _, w in self._lines[m]]
        entries = [e for line in self._lines.values() for e in line]
        entries.sort(key=_ticket_of)
        return [w for _, _, w in entries]

    def pop_all(self, priority: Mapping[str, float] | None = None) -> list[T]:
        """`waiters(priority)`, and the queue is empty."""
        out = self.waiters(priority)
        self._lines.clear()
        self._num = 0
        return out

    def count(self, model: str) -> int:
        return len(self._lines.get(model, ()))

    def counts(self) -> dict[str, int]:
        """Waiters by model (the models with any)."""
        return {model: len(line) for model, line in self._lines.items()}

    def __len__(self) -> int:
        return self._num
