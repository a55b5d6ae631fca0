"""The arrival rate an instance serves within its SLOs: queueing, not mean throughput.

One source of truth for "how many requests/s can this instance take and still meet its TTFT
and TPOT SLOs", used by the planner (`sizing: slo`) and the `peak-slo` baseline's queue check
(docs/planner.md, "Sized at the SLO", has the calibration).

The engine is a continuous-batching server with `b` slots (its `max_num_seqs`). With every
slot busy it completes `mu` requests/s (the steady state's `requests_per_s`); below that its
TPOT is shorter (taken linear in the concurrency between one and `b`), so at a rate `lambda`
`n(lambda)` slots are busy (Little's law with that TPOT). A request that finds the engine
full waits; once admitted its first token comes `ttft_full` later (its prefill and the step
it joins). Two ways to miss:

- TTFT: the wait as an M/M/c queue made to carry the arrivals' burstiness by Hayward's
  approximation (traffic of peakedness `z = (ca2 + 1) / 2` offered to `c` servers behaves
  like Poisson traffic `A / z` offered to `c / z`; `ca2` the arrivals' index of dispersion,
  1 for Poisson, output lengths exponential):

      c      = min(b, MAX_QUEUE_SERVERS)        (a batch's slots share one GPU's steps)
      P_wait = ErlangC(c / z, n(lambda) * c / b / z)
      miss   = P_wait * exp(-(MU_SCALE * mu - lambda) * (ttft_slo - ttft_full) / z)

- TPOT: a request of `k` tokens sees `k - 1` steps; each is the decode interval `d`, and `N`
  of them also carry a newly arrived prompt's prefill `P`, so its TPOT is
  `d + P * N / (k - 1)`, N Poisson with mean `lambda * (k - 1) * tpot` (scaled by `ca2`
  as above): short answers miss first. Output lengths geometric with the demand's mean.

The SLO rate is the largest `lambda` whose two shares together stay within `miss_budget`
(1 %: attainment 0.99) of a trickle's (what no capacity removes). Both grow with `lambda`:
bisection. `MU_SCALE` and `MAX_QUEUE_SERVERS` were fitted against the simulator (the
requests in flight are longer than the mean, so the engine saturates below `mu`; a batch's
slots are not independent servers).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

__all__ = [
    "MAX_QUEUE_SERVERS",
    "MISS_BUDGET",
    "MU_SCALE",
    "SloShape",
    "dispersion_of_counts",
    "erlang_c",
    "miss_share",
    "mmc_wait_quantile_s",
    "slo_rate_per_s",
    "tpot_miss_share",
    "ttft_miss_share",
]

# The share of requests allowed to miss an SLO: attainment 0.99.
MISS_BUDGET = 0.01
# Calibrated against the simulator (docs/planner.md "Sized at the SLO"): the engine saturates
# at this share of its steady-state throughput, and queues as at most this many servers.
MU_SCALE = 0.9
MAX_QUEUE_SERVERS = 16
TPOT_PREFILL_SPREAD = 2.0


@dataclass(frozen=True, slots=True)
class SloShape:
    """What the queue needs of an instance: its figures at full concurrency and alone."""

    batch: int  # slots (max_num_seqs)
    requests_per_s: float  # completions/s with every slot busy (mu)
    ttft_full_s: float  # TTFT of a request admitted into a full batch
    tpot_full_s: float  # mean TPOT with every slot busy
    tpot_one_s: float  # mean TPOT at concurrency 1
    output_tokens: int  # mean output length

    @property
    def prefill_s(self) -> float:
        """One mean prompt's prefill (the steady state's TTFT is its prefill plus a step)."""
        return max(0.0, self.ttft_full_s - self.tpot_full_s)

    @property
    def _tpot_slope_s(self) -> float:
        return (self.tpot_full_s - self.tpot_one_s) / max(1, self.batch - 1)

    def busy_slots(self, rate_per_s: float) -> float:
        """Mean requests in flight at `rate_per_s`: `n = rate * out * tpot(n)`, tpot linear."""
        slope = self._tpot_slope_s
        x = rate_per_s * max(1, self.output_tokens)
        if x * slope >= 1:
            return math.inf
        return max(0.0, x * (self.tpot_one_s - slope) / (1.0 - x * slope))

    def tpot_at_s(self, rate_per_s: float) -> float:
        """Mean TPOT at `rate_per_s` (at most the full batch's)."""
        n = min(float(self.batch), max(1.0, self.busy_slots(rate_per_s)))
        return self.tpot_one_s + self._tpot_slope_s * (n - 1)


def erlang_c(num_servers: float, offered_load: float) -> float:
    """P(an arrival waits) in M/M/c, `offered_load` = lambda / mu_server. A fractional
    `num_servers` (Hayward's scaled system) is rounded down, at least 1. Erlang B's
    recursion: stable for hundreds of servers."""
    c = max(1, int(num_servers))
    if offered_load <= 0:
        return 0.0
    if offered_load >= c:
        return 1.0
    blocking = 1.0
    for k in range(1, c + 1):
        blocking = offered_load * blocking / (k + offered_load * blocking)
    return c * blocking / (c - offered_load * (1.0 - blocking))


def mmc_wait_quantile_s(
    num_servers: int, server_rate_per_s: float, rate_per_s: float, tail: float = 0.01
) -> float:
    """The wait's `1 - tail` quantile in M/M/c (exponential tail past P(wait)); infinite at
    or over capacity. (The `peak-slo` baseline's check: each instance a server.)"""
    capacity = num_servers * server_rate_per_s
    if rate_per_s <= 0:
        return 0.0
    if server_rate_per_s <= 0 or rate_per_s >= capacity:
        return math.inf
    p_wait = erlang_c(num_servers, rate_per_s / server_rate_per_s)
    if p_wait <= 0:
        return 0.0
    return max(0.0, math.log(p_wait / tail)) / (capacity - rate_per_s)


def ttft_miss_share(
    shape: SloShape, rate_per_s: float, ttft_slo_s: float, arrival_cv2: float = 1.0
) -> float:
    """The share of requests whose TTFT exceeds `ttft_slo_s` (the module docstring)."""
    mu = shape.requests_per_s * MU_SCALE
    if shape.ttft_full_s > ttft_slo_s or rate_per_s >= mu:
        return 1.0
    if rate_per_s <= 0:
        return 0.0
    z = max(1e-9, (arrival_cv2 + 1.0) / 2)
    servers = min(shape.batch, MAX_QUEUE_SERVERS)
    busy = min(float(shape.batch), shape.busy_slots(rate_per_s)) * servers / shape.batch
    p_wait = erlang_c(servers / z, busy / z)
    return min(1.0, p_wait * math.exp(-(mu - rate_per_s) * (ttft_slo_s - shape.ttft_full_s) / z))


def tpot_miss_share(
    shape: SloShape, rate_per_s: float, tpot_slo_s: float, arrival_cv2: float = 1.0
) -> float:
    """The share of requests whose own TPOT exceeds `tpot_slo_s` (the module docstring)."""
    tpot_s = shape.tpot_at_s(rate_per_s)
    prefill_s = shape.prefill_s
    decode_s = tpot_s * max(0.0, 1.0 - rate_per_s * prefill_s)
    if decode_s > tpot_slo_s:
        return 1.0
    out = max(1, shape.output_tokens)
    stay = 1.0 - 1.0 / out  # geometric lengths: P(k) = (1 - stay) stay^(k - 1), k >= 1
    if prefill_s <= 0 or rate_per_s <= 0 or stay <= 0:
        return 0.0
    # A bursty request arrives with others (in a clump of gaps shorter than a step): their
    # prefills land on its first steps, (ca2 - 1) / 2 of them on average.
    clump = max(0.0, (arrival_cv2 - 1.0) / 2)
    missed = 0.0
    steps = 1  # k - 1; P(k - 1 in [a, b)) = stay^a - stay^b
    while steps < 100 * out:
        # one step at a time for short answers, then bins 15 % wide (the share is smooth there
        # and falls with the steps: the bin's first step speaks for it, conservatively)
        upto = steps + 1 if steps < 16 else math.ceil(steps * 1.15)
        weight = stay**steps - stay**upto
        mean = rate_per_s * steps * tpot_s + clump
        allowed = math.floor((tpot_slo_s - decode_s) * steps / prefill_s)
        share = _poisson_tail(mean, allowed)
        missed += weight * share
        if (share < 1e-9 and steps > mean + 10) or stay**upto < 1e-9:
            break
        steps = upto
    return missed


def _poisson_tail(mean: float, allowed: int) -> float:
    """P(N > allowed), N Poisson with `mean` (normal, with continuity, for a large mean)."""
    if mean <= 0 or allowed >= mean + 10 * math.sqrt(mean) + 10:
        return 0.0  # (below 1e-12: not worth the sum)
    if mean > 50:
        return 0.5 * math.erfc((allowed + 0.5 - mean) / math.sqrt(2 * mean))
    term = math.exp(-mean)
    cdf = term
    for i in range(1, allowed + 1):
        term *= mean / i
        cdf += term
        if term < 1e-12 and i > mean:
            break
    return max(0.0, 1.0 - cdf)


def miss_share(
    shape: SloShape,
    rate_per_s: float,
    ttft_slo_s: float,
    tpot_slo_s: float,
    arrival_cv2: float = 1.0,
) -> float:
    """The predicted share of requests that miss the TTFT or the TPOT SLO at `rate_per_s`."""
    ttft = ttft_miss_share(shape, rate_per_s, ttft_slo_s, arrival_cv2)
    if ttft >= 1.0:
        return 1.0
    return min(1.0, ttft + tpot_miss_share(shape, rate_per_s, tpot_slo_s, arrival_cv2))


@lru_cache(maxsize=65536)
def slo_rate_per_s(
    shape: SloShape,
    ttft_slo_s: float,
    tpot_slo_s: float,
    arrival_cv2: float = 1.0,
    miss_budget: float = MISS_BUDGET,
) -> float:
    """The largest arrival rate at which at most `miss_budget` more requests miss an SLO
    than at a trickle (0 when even a trickle's TTFT or TPOT misses). The trickle's misses
    (short answers behind a clump's prefills) are no rate's to fix: more instances would not
    remove them. Cached: a planner asks it of the same few shapes."""
    if shape.requests_per_s <= 0:
        return 0.0
    lo, hi = 0.0, shape.requests_per_s * MU_SCALE
    floor = miss_share(shape, hi * 1e-3, ttft_slo_s, tpot_slo_s, arrival_cv2)
    if floor >= 1.0:
        return 0.0
    for _ in range(14):  # to 6e-5 of mu
        mid = (lo + hi) / 2
        if miss_share(shape, mid, ttft_slo_s, tpot_slo_s, arrival_cv2) <= floor + miss_budget:
            lo = mid
        else:
            hi = mid
    return lo


def dispersion_of_counts(counts: Sequence[float]) -> float | None:
    """The arrivals' burstiness from their counts in consecutive equal windows: the index of
    dispersion (variance / mean; 1 for Poisson, about cv^2 for gaps of that cv), from the
    differences of neighbouring windows (Allan variance) so that a slow trend (a daily curve)
    is not taken for burstiness. None with fewer than 3 windows or no arrival (then the
    caller assumes Poisson)."""
    if len(counts) < 3:
        return None
    mean = sum(counts) / len(counts)
    if mean <= 0:
        return None
    diffs = [(b - a) ** 2 for a, b in itertools.pairwise(counts)]
    return sum(diffs) / len(diffs) / 2 / mean
