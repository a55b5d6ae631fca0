"""Readings of each model's serving signals for the shift policy (`Sample`), from what the
gateway exposes: its instances (in flight, running, waiting, slots) and its latency
histograms. Pure: the controller fetches the texts, `Sampler.sample(now, ...)` reads them.

Latency p99s are over the window since the previous reading: the difference of the
cumulative histogram buckets between two readings, interpolated inside the bucket that holds
the 99th percentile (what PromQL's histogram_quantile does over a rate).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from flexpipe.policies.shift.signals import Sample

__all__ = [
    "TPOT_HISTOGRAM",
    "TTFT_HISTOGRAM",
    "Buckets",
    "GatewayTotals",
    "Sampler",
    "bucket_delta",
    "bucket_quantile",
    "gateway_totals",
    "parse_histograms",
]

# the gateway's latency histograms the policy reads (flexpipe.gateway.gateway_metrics)
TTFT_HISTOGRAM = _TTFT = "flexpipe_time_to_first_token_seconds"
TPOT_HISTOGRAM = _TPOT = "flexpipe_time_per_output_token_seconds"

Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending


def parse_histograms(text: str, names: Iterable[str]) -> dict[tuple[str, str], Buckets]:
    """(metric name, model) -> cumulative buckets, from Prometheus text."""
    wanted = set(names)
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                key = (family.name, s.labels.get("model", ""))
                out.setdefault(key, []).append((float(s.labels["le"]), float(s.value)))
    return {k: tuple(sorted(v)) for k, v in out.items()}


@dataclass(frozen=True, slots=True)
class GatewayTotals:
    """The gateway's queue and its finished requests, from its Prometheus text."""

    num_queued: int  # requests waiting, every model
    queued_by_model: dict[str, int] | None  # None: a gateway that does not say
    done_by_model: dict[str, float]  # cumulative finished requests (any status)


def gateway_totals(text: str) -> GatewayTotals:
    queued = 0
    by_model: dict[str, int] | None = None
    done: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "flexpipe_queued_requests":
            queued = int(sum(s.value for s in family.samples))
        elif family.name == "flexpipe_model_queued_requests":
            by_model = {s.labels["model"]: int(s.value) for s in family.samples}
        elif family.name == "flexpipe_requests":
            for s in family.samples:
                if s.name.endswith("_total"):
                    m = s.labels.get("model", "")
                    done[m] = done.get(m, 0.0) + s.value
    return GatewayTotals(queued, by_model, done)


def bucket_quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of a (delta) histogram, linear inside its bucket; None when empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # beyond the last finite bucket: its bound
            inside = count - lower_count
            frac = (rank - lower_count) / inside if inside > 0 else 1.0
            return lower_bound + (bound - lower_bound) * frac
        lower_bound, lower_count = bound, count
    return lower_bound


def _serving(instance: Mapping[str, Any]) -> bool:
    """Healthy and active or draining: what carries the model's load now (one starting or
    rehearsing serves no one yet)."""
    return bool(instance.get("healthy", True)) and instance.get("state") in ("active", "draining")


def bucket_delta(now: Buckets, before: Buckets | None) -> Buckets:
    """The histogram of what was observed between two readings (`now` alone: none before)."""
    if before is None or len(before) != len(now):
        return now
    return tuple((b, max(0.0, c - c0)) for (b, c), (_, c0) in zip(now, before, strict=True))


@dataclass
class Sampler:
    """Turns successive gateway readings into one `Sample` per model."""

    _last: dict[tuple[str, str], Buckets] = field(default_factory=dict)

    def sample(
        self,
        now_s: float,
        models: Sequence[str],
        instances: Sequence[Mapping[str, Any]],
        metrics_text: str,
        num_queued_at_gateway: int = 0,
        queued_by_model: Mapping[str, int] | None = None,
    ) -> dict[str, Sample]:
        """`queued_by_model`: the gateway's wait queue by model (what a model with no
        instance has as demand); without it, the whole queue counts for a lone model."""
        hist = parse_histograms(metrics_text, (_TTFT, _TPOT))
        return self.sample_histograms(
            now_s, models, instances, hist, num_queued_at_gateway, queued_by_model
        )

    def sample_histograms(
        self,
        now_s: float,
        models: Sequence[str],
        instances: Sequence[Mapping[str, Any]],
        histograms: Mapping[tuple[str, str], Buckets],
        num_queued_at_gateway: int = 0,
        queued_by_model: Mapping[str, int] | None = None,
    ) -> dict[str, Sample]:
        """`sample` from the latency histograms as `parse_histograms` reads them from the
        gateway's text ((TTFT_HISTOGRAM or TPOT_HISTOGRAM, model) -> cumulative buckets)."""
        hist = histograms
        out = {}
        for model in models:
            mine = [i for i in instances if i.get("model") == model and _serving(i)]
            slots = sum(int(i.get("max_concurrency", 0)) for i in mine)
            running = sum(int(i.get("num_running", 0)) for i in mine)
            in_flight = sum(int(i.get("num_in_flight", 0)) for i in mine)
            waiting = sum(int(i.get("num_waiting", 0)) for i in mine)
            busy = max(running, in_flight - waiting)
            p99 = {}
            for name in (_TTFT, _TPOT):
                key = (name, model)
                now_b = hist.get(key, ())
                p99[name] = bucket_quantile(0.99, bucket_delta(now_b, self._last.get(key)))
                self._last[key] = now_b
            if queued_by_model is not None:
                share = int(queued_by_model.get(model, 0))
            else:
                share = num_queued_at_gateway if len(models) == 1 else 0
            out[model] = Sample(
                at_s=now_s,
                queue_depth=waiting + share,
                queue_capacity=max(1, slots),
                ttft_p99_s=p99[_TTFT],
                tpot_p99_s=p99[_TPOT],
                utilization=min(1.0, busy / slots) if slots else 0.0,
            )
        return out
