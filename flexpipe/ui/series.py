"""The dashboard's time series: a ring of readings over the last `max_age_s` (15 minutes), and
per pair of consecutive readings one point per model — request and error rates, TTFT and
TPOT p50/p95/p99 over the interval (the difference of the cumulative histograms,
interpolated inside the bucket as PromQL's histogram_quantile does: `bucket_quantile`, the
controller's own), output tokens/s, prefix-cache hit rate and busy time from the engines'
counters, how busy the DCGM exporters saw its GPUs, and the queue and load at the end of the
interval. Pure: readings carry their time. Rates are per wall second here; the view
(flexpipe/ui/view.py) turns them into modelled ones.

`flexpipe status` and `top` show these same figures (they read the gateway's view), so the
terminal and the dashboard never disagree about a model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from flexpipe.control.core.samples import Buckets, bucket_delta, bucket_quantile
from flexpipe.ui.reading import EngineCounters, ModelReading, Reading

__all__ = ["QUANTILES", "History", "dcgm_busy_now", "model_point", "window_point"]

QUANTILES = (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))
Point = dict[str, Any]  # {"t": unix s, "dt_s": s, "models": {model: figures}}


def _quantiles(now: Buckets, before: Buckets) -> dict[str, float | None]:
    delta = bucket_delta(now, before)
    out: dict[str, float | None] = {}
    for name, q in QUANTILES:
        v = bucket_quantile(q, delta)
        out[name] = None if v is None else round(v, 6)
    return out


def _grown(now: float, before: float) -> float:
    """A counter's increase; a counter that went back (an engine restarted) counts from 0."""
    return now - before if now >= before else now


@dataclass(frozen=True, slots=True)
class _Grown:
    """The engines' growth over a span: tokens, and busy time against the time watched."""

    counters: EngineCounters
    watched_s: float = 0.0  # wall seconds x instances whose busy time was read at both ends

    def __add__(self, other: _Grown) -> _Grown:
        a, b = self.counters, other.counters
        busy = None if a.busy_s is None and b.busy_s is None else (a.busy_s or 0) + (b.busy_s or 0)
        return _Grown(
            EngineCounters(
                a.num_generated_tokens + b.num_generated_tokens,
                a.num_prefix_queries + b.num_prefix_queries,
                a.num_prefix_hits + b.num_prefix_hits,
                busy,
            ),
            self.watched_s + other.watched_s,
        )


def _engine_delta(r0: Reading, r1: Reading, urls: list[str]) -> _Grown:
    """Summed over `urls` present in both readings (a new instance's first reading only sets
    its baseline: its tokens before that are not in any interval)."""
    out = _Grown(EngineCounters())
    for url in urls:
        a, b = r0.engines.get(url), r1.engines.get(url)
        if a is None or b is None:
            continue
        busy, watched = None, 0.0
        if a.busy_s is not None and b.busy_s is not None:
            busy, watched = _grown(b.busy_s, a.busy_s), r1.at_s - r0.at_s
        grown = EngineCounters(
            _grown(b.num_generated_tokens, a.num_generated_tokens),
            _grown(b.num_prefix_queries, a.num_prefix_queries),
            _grown(b.num_prefix_hits, a.num_prefix_hits),
            busy,
        )
        out = out + _Grown(grown, watched)
    return out


def _engines_between(model: str, readings: Sequence[Reading]) -> _Grown:
    """The engines' growth over consecutive readings, each pair over the model's instances
    at its end: instances that came and went within the span count for their part."""
    out = _Grown(EngineCounters())
    for r0, r1 in pairwise(readings):
        urls = [str(i["url"]) for i in r1.instances if i.get("model") == model]
        out = out + _engine_delta(r0, r1, urls)
    return out


def _is_sim(counters: EngineCounters | None) -> bool:
    """An engine that exports its modelled busy time: the sim engine (what its GPU does is
    not what serves it; the model says how busy it would be)."""
    return counters is not None and counters.busy_s is not None


def _dcgm_busy(model: str, readings: Sequence[Reading]) -> float | None:
    """The mean busy fraction of the model's GPUs as DCGM reported them at `readings` (each
    reading's instances of the model, one value per GPU that reported one; sim engines left
    out: their busy time is modelled); None where no GPU of the model reported."""
    values: list[float] = []
    for r in readings:
        for inst in r.instances:
            url = str(inst.get("url"))
            if inst.get("model") == model and not _is_sim(r.engines.get(url)):
                values.extend(r.gpu_busy.get(url, ()))
    return sum(values) / len(values) if values else None


def dcgm_busy_now(reading: Reading) -> dict[str, float]:
    """Each instance's mean busy fraction over its GPUs as DCGM reported them at `reading`
    (sim engines and instances no exporter reports left out)."""
    return {
        url: sum(v) / len(v)
        for url, v in sorted(reading.gpu_busy.items())
        if v and not _is_sim(reading.engines.get(url))
    }


def model_point(
    model: str, r0: Reading, r1: Reading, between: Sequence[Reading] = ()
) -> dict[str, Any]:
    """One model's figures over the interval r0.at_s → r1.at_s (load: at r1). `between`: the
    readings in between, for the engines' counters (instances replaced within the span)."""
    dt_s = r1.at_s - r0.at_s
    if dt_s <= 0:
        raise ValueError(f"readings out of order: {r0.at_s} then {r1.at_s}")
    m0, m1 = r0.models.get(model, ModelReading()), r1.models.get(model, ModelReading())
    mine = [i for i in r1.instances if i.get("model") == model]
    grown = _engines_between(model, [r0, *between, r1])
    engines = grown.counters
    dcgm = _dcgm_busy(model, [*between, r1])  # gauges: those at the interval's end and within
    models_at_gateway = {i.get("model") for i in r1.instances if i.get("model")}
    queued_here = r1.num_queued if len(models_at_gateway) == 1 else 0  # one model: all its
    return {
        "request_rate_per_s": round(_grown(m1.num_ok, m0.num_ok) / dt_s, 4),
        "error_rate_per_s": round(_grown(m1.num_errors, m0.num_errors) / dt_s, 4),
        "ttft_s": _quantiles(m1.ttft, m0.ttft),
        "tpot_s": _quantiles(m1.tpot, m0.tpot),
        "tokens_per_s": round(engines.num_generated_tokens / dt_s, 3),
        "prefix_hit_rate": (
            round(engines.num_prefix_hits / engines.num_prefix_queries, 4)
            if engines.num_prefix_queries > 0
            else None
        ),
        # modelled busy seconds per wall second per instance (the view scales it into a
        # utilisation); None: no engine of the model reports its busy time (vLLM)
        "busy_s_per_s": (
            round(engines.busy_s / grown.watched_s, 6)
            if engines.busy_s is not None and grown.watched_s > 0
            else None
        ),
        # the mean busy fraction of its GPUs over the interval's readings as the DCGM
        # exporters measured them (what the view prefers); None: no exporter reports them
        "gpu_busy": None if dcgm is None else round(dcgm, 6),
        "queue": sum(int(i.get("num_waiting", 0)) for i in mine) + queued_here,
        "in_flight": sum(int(i.get("num_in_flight", 0)) for i in mine),
        "num_instances": len(mine),
    }


def _models(*readings: Reading) -> list[str]:
    names: set[str] = set()
    for r in readings:
        names |= set(r.models)
        names |= {str(i["model"]) for i in r.instances if i.get("model")}
    return sorted(names)


def _point(r0: Reading, r1: Reading, between: Sequence[Reading] = ()) -> Point:
    return {
        "t": r1.at_s,
        "dt_s": round(r1.at_s - r0.at_s, 3),
        "models": {m: model_point(m, r0, r1, between) for m in _models(r0, r1)},
    }


def window_point(readings: Sequence[Reading], window_s: float) -> Point | None:
    """The figures over the last `window_s` (from the newest reading back to the oldest one
    within the window, at least the one before the newest); None with fewer than two."""
    if len(readings) < 2:
        return None
    newest = readings[-1]
    first = len(readings) - 2
    for i, r in enumerate(readings):
        if newest.at_s - r.at_s <= window_s:
            first = min(i, first)
            break
    span = list(readings)[first:]
    return _point(span[0], newest, span[1:-1])


class History:
    """Readings over the last `max_age_s`, and the point between each and the one before.
    A deque: appending and dropping the oldest are O(1) at one reading every few seconds."""

    def __init__(self, max_age_s: float = 900.0) -> None:
        if max_age_s <= 0:
            raise ValueError("max_age_s must be > 0")
        self.max_age_s = max_age_s
        self.readings: deque[Reading] = deque()
        self.points: deque[Point] = deque()

    def add(self, reading: Reading) -> Point | None:
        """Keep `reading`; returns its point (None for the first, or one not after the last)."""
        point = None
        if self.readings:
            if reading.at_s <= self.readings[-1].at_s:
                return None
            point = _point(self.readings[-1], reading)
            self.points.append(point)
        self.readings.append(reading)
        oldest = reading.at_s - self.max_age_s
        while len(self.readings) > 1 and self.readings[0].at_s < oldest:
            self.readings.popleft()
        while self.points and self.points[0]["t"] < oldest:
            self.points.popleft()
        return point

    def since(self, t_s: float | None) -> list[Point]:
        """The points after `t_s` (all of them for None), oldest first."""
        if t_s is None:
            return list(self.points)
        out: list[Point] = []
        for p in reversed(self.points):
            if p["t"] <= t_s:
                break
            out.append(p)
        return out[::-1]

    def window(self, window_s: float) -> Point | None:
        return window_point(self.readings, window_s)

    @property
    def latest(self) -> Reading | None:
        return self.readings[-1] if self.readings else None
