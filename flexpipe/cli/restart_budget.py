"""When `flexpipe up` starts a dead child again: a budget per child over a sliding window, with
exponential backoff between restarts. Pure: the restart times and `now` in, a decision out.

A controller that served before and spent its budget is still retried, slowly: while it is
away the gateway and the engines serve on (only shifting stops), so giving up on it would stop
a healthy service. A gateway that spent its budget, or a controller that never served, stops
`up`: nothing serves without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RestartBudget", "RestartDecision", "decide_restart"]


@dataclass(frozen=True, slots=True)
class RestartBudget:
    max_restarts: int = 5  # per child, within window_s
    window_s: float = 600.0
    first_backoff_s: float = 1.0  # before the second restart in the window (the first: none)
    max_backoff_s: float = 30.0
    slow_retry_s: float = 60.0  # once the budget is spent (a controller that served)


@dataclass(frozen=True, slots=True)
class RestartDecision:
    restart: bool  # False: stop `up`
    delay_s: float = 0.0  # start it again after this long
    exhausted: bool = False  # the window's budget is spent
    num_recent: int = 0  # restarts of this child within the window, before this one


def decide_restart(
    restarts_s: Sequence[float], now_s: float, budget: RestartBudget, *, keep_trying: bool
) -> RestartDecision:
    """A child exited at `now_s`; `restarts_s`: when it was started again before.
    `keep_trying`: retry slowly once the budget is spent instead of stopping."""
    num_recent = sum(1 for t in restarts_s if now_s - t < budget.window_s)
    if num_recent >= budget.max_restarts:
        if not keep_trying:
            return RestartDecision(False, exhausted=True, num_recent=num_recent)
        return RestartDecision(True, budget.slow_retry_s, exhausted=True, num_recent=num_recent)
    delay_s = 0.0
    if num_recent:
        delay_s = min(budget.max_backoff_s, budget.first_backoff_s * 2.0 ** (num_recent - 1))
    return RestartDecision(True, delay_s, num_recent=num_recent)
