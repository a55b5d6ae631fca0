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

Pure bookkeeping, no clock, no I/O: the live gateway keeps its waiters' futures here, the
simulator its calls.
"""

from __future__ import annotations

import bisect
from typing import Generic, TypeVar

__all__ = ["WaitQueue"]

T = TypeVar("T")


def _ticket_of(entry: tuple[int, object]) -> int:
    return entry[0]


class WaitQueue(Generic[T]):
    def __init__(self) -> None:
        self._lines: dict[str, list[tuple[int, T]]] = {}  # model -> (ticket, waiter), in order
        self._num = 0
        self._next_ticket = 0

    def ticket(self) -> int:
        """A new request's place: after every request that queued before it."""
        self._next_ticket += 1
        return self._next_ticket

    def push(self, model: str, waiter: T, ticket: int) -> None:
        """`waiter` waits in `model`'s line at `ticket`'s place."""
        line = self._lines.setdefault(model, [])
        bisect.insort(line, (ticket, waiter), key=_ticket_of)
        self._num += 1

    def remove(self, model: str, waiter: T) -> bool:
        """Take `waiter` out of `model`'s line (False if it was not there)."""
        line = self._lines.get(model)
        if not line:
            return False
        for i, (_, w) in enumerate(line):
            if w is waiter:
                del line[i]
                self._num -= 1
                if not line:
                    del self._lines[model]
                return True
        return False

    def line(self, model: str, after: int = 0) -> list[T]:
        """`model`'s waiters with a ticket past `after`, oldest first."""
        return [w for t, w in self._lines.get(model, ()) if t > after]

    def pop_first(self, model: str) -> T | None:
        """`model`'s oldest waiter, out of the line (None: nobody waits for it)."""
        line = self._lines.get(model)
        if not line:
            return None
        _, waiter = line.pop(0)
        self._num -= 1
        if not line:
            del self._lines[model]
        return waiter

    def waiters(self) -> list[T]:
        """Every waiter, by ticket (the order they first queued in)."""
        entries = [e for line in self._lines.values() for e in line]
        entries.sort(key=_ticket_of)
        return [w for _, w in entries]

    def pop_all(self) -> list[T]:
        """`waiters()`, and the queue is empty."""
        out = self.waiters()
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
