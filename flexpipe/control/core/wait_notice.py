"""What the controller says about requests waiting in the gateway for a model with no
instance (scaled to zero, or its last engine died): once when they start waiting, once when
that ends — not on every answer of the gateway's demand wait (it printed a line a tick)."""

from __future__ import annotations

from collections.abc import Collection, Mapping

__all__ = ["WaitNotice"]


class WaitNotice:
    def __init__(self) -> None:
        self.waiting: set[str] = set()  # models said to have requests waiting

    def queued(self, asked: Collection[str], counts: Mapping[str, int]) -> list[str]:
        """The gateway's answer for the models `asked`: requests queued per model."""
        now = {m for m, n in counts.items() if n > 0}
        lines = []
        start = sorted(now - self.waiting)
        if start:
            lines.append(f"controller: requests wait for {', '.join(start)}")
        for model in sorted((self.waiting & set(asked)) - now):
            lines.append(f"controller: no request waits for {model} any more")
        self.waiting = (self.waiting - set(asked)) | now
        return lines

    def serving(self, models: Collection[str]) -> list[str]:
        """`models` have an instance (again): their waiting requests go to it."""
        done = sorted(self.waiting & set(models))
        self.waiting -= set(done)
        return [f"controller: {m} serves again; the requests that waited go to it" for m in done]
