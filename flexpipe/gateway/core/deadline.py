"""Deadline-aware admission (pure): the slack of a waiting request, the order of a model's
line by it, the rule that sheds a request that cannot meet its TTFT SLO anyway, and the
measured rates the estimate uses (docs/gateway.md, "Deadline-aware admission").

Opt-in (`admission: {order: slack, shed_late: true}` in the gateway config); with the default
(`order: fcfs`, `shed_late: false`) nothing here is asked and the queue is first come, first
served. The live gateway (`Gateway._pick`) and the simulator (`SimGateway._route`) build a
`Shed` from the same numbers and `admit` applies it; both order their lines with `rank`.

The estimate, kept simple on purpose (`slack_s`): a request's TTFT deadline is its arrival
plus its model's TTFT SLO; it needs `num_ahead + 1` of its model's requests to finish before
it has a slot (a freed slot only serves its own model), at the model's measured completion
rate; its prefill is left to the margin. Slack = deadline - now - that wait (no wait when
it has a slot; none either while no rate is measured yet: no evidence, no shedding).
"""

from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

from flexpipe.gateway.config import AdmissionConfig
from flexpipe.gateway.core.wait_queue import Rank, WaitQueue

__all__ = [
    "Deadlines",
    "FairShare",
    "ServiceRates",
    "Shed",
    "expected_wait_s",
    "is_late",
    "rank",
    "slack_s",
]

RATE_WINDOW_S = 10.0  # completions counted for a model's measured rate
SHARE_WINDOW_S = 60.0  # how long a tenant's served requests count against its share


def expected_wait_s(num_ahead: int, rate_per_s: float) -> float:
    """Seconds until a slot is free for a request with `num_ahead` of its model's waiters
    before it: `num_ahead + 1` completions at `rate_per_s` (0 while no rate is measured)."""
    return (num_ahead + 1) / rate_per_s if rate_per_s > 0 else 0.0


def slack_s(ttft_deadline_s: float, now: float, wait_s: float) -> float:
    """How long the request could still wait and make its TTFT deadline (negative: late)."""
    return ttft_deadline_s - now - wait_s


def is_late(slack: float, margin_s: float) -> bool:
    """Negative by more than the margin (exactly at it is not late): shed, not served late."""
    return slack < -margin_s


def rank(order: str, ttft_deadline_s: float, usage: float) -> Rank:
    """A waiter's place in its model's line before its ticket (wait_queue.py): nothing for
    `fcfs` (tickets alone); for `slack`, least slack first, which within one model's line
    (every waiter faces the same wait at the head) is the earliest TTFT deadline; then the
    tenant with less of its fair share used recently (`FairShare.usage`)."""
    if order != "slack":
        return ()
    return (ttft_deadline_s, usage)


@dataclass(frozen=True, slots=True)
class Shed:
    """What `admit` needs to shed a late request: its model's TTFT SLO, its deadline, the
    wait it would have if it queued now, and the margin."""

    ttft_slo_s: float
    ttft_deadline_s: float
    wait_s: float
    margin_s: float

    def slack_s(self, now: float, has_slot: bool) -> float:
        return slack_s(self.ttft_deadline_s, now, 0.0 if has_slot else self.wait_s)

    @property
    def last_s(self) -> float:
        """Past this a request still without a slot is late whatever the estimate (its slack
        is below -margin by the wait still ahead): the queue's wait ends here."""
        return self.ttft_deadline_s + self.margin_s

    def message(self, model: str, now: float, has_slot: bool) -> str:
        late_s = max(0.0, -self.slack_s(now, has_slot))
        return (
            f"The request cannot meet the TTFT SLO of {self.ttft_slo_s:g} s of model "
            f"`{model}`: its first token would come about {late_s:.1f} s past it, so it is "
            "refused now instead of served late; retry later"
        )


class ServiceRates:
    """Requests finished per second, per model, over the last `window_s` (over the time
    since the first one while that is shorter): the pace at which a model's line moves."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._ends: dict[str, deque[float]] = {}
        self._first_s: dict[str, float] = {}

    def record(self, model: str, now: float) -> None:
        self._ends.setdefault(model, deque()).append(now)
        self._first_s.setdefault(model, now)

    def rate(self, model: str, now: float) -> float:
        ends = self._ends.get(model)
        if not ends:
            return 0.0
        while ends and ends[0] <= now - self.window_s:
            ends.popleft()
        span_s = min(self.window_s, now - self._first_s[model])
        return len(ends) / span_s if span_s > 0 else 0.0


class FairShare:
    """Each tenant's recently served requests against its share: `usage` is a count that
    decays by e every `window_s`, every tenant with an equal share.
    A tenant above its share yields, at equal slack, to one below it (`rank`)."""

    def __init__(self, window_s: float = SHARE_WINDOW_S) -> None:
        self.window_s = window_s
        self._counts: dict[str, tuple[float, float]] = {}  # tenant -> (count, at_s)

    def _count(self, tenant: str, now: float) -> float:
        count, at_s = self._counts.get(tenant, (0.0, now))
        return count * math.exp(-max(0.0, now - at_s) / self.window_s)

    def served(self, tenant: str, now: float) -> None:
        self._counts[tenant] = (self._count(tenant, now) + 1.0, now)

    def usage(self, tenant: str | None, now: float) -> float:
        """0 for a request of no tenant (no API keys configured)."""
        return 0.0 if tenant is None else self._count(tenant, now)


class Deadlines:
    """The state and the questions both shells ask, from the gateway config's `admission`
    block: a waiter's `rank`, the `Shed` for `admit`, the lines' priority order; the shells
    report each finished request (`finished`) and each routed one (`served`)."""

    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self.rates = ServiceRates()
        self.shares = FairShare()
        # the lines' order when every waiter looks again (None: by ticket, as fcfs)
        self.priority: dict[str, float] | None = (
            dict(cfg.priority) if cfg.order == "slack" else None
        )

    def ttft_deadline_s(self, model: str, arrival_s: float) -> float:
        slo_s = self.cfg.ttft_slo_s.get(model)
        return math.inf if slo_s is None else arrival_s + slo_s

    def rank(self, model: str, arrival_s: float, tenant: str | None, now: float) -> Rank:
        return rank(
            self.cfg.order, self.ttft_deadline_s(model, arrival_s), self.shares.usage(tenant, now)
        )

    def shed(self, model: str, arrival_s: float, num_ahead: int, now: float) -> Shed | None:
        """None unless shedding is on and `model` has a TTFT SLO."""
        slo_s = self.cfg.ttft_slo_s.get(model)
        if not self.cfg.shed_late or slo_s is None:
            return None
        wait_s = expected_wait_s(num_ahead, self.rates.rate(model, now))
        return Shed(slo_s, arrival_s + slo_s, wait_s, self.cfg.shed_margin_s)

    def shed_in(
        self,
        waiters: WaitQueue[Any],
        model: str,
        arrival_s: float,
        ticket: int | None,
        place: Rank,
        now: float,
    ) -> Shed | None:
        """`shed` for a request at its place in `waiters` (`ticket` None: not yet queued, so
        behind every waiter of its rank)."""
        num_ahead = waiters.num_ahead(model, sys.maxsize if ticket is None else ticket, place)
        return self.shed(model, arrival_s, num_ahead, now)

    def finished(self, model: str, now: float) -> None:
        self.rates.record(model, now)

    def served(self, tenant: str | None, now: float) -> None:
        if tenant is not None:
            self.shares.served(tenant, now)
