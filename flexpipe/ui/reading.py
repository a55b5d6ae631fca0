"""One reading of the gateway for the dashboard: cumulative counters and histogram buckets per
model, the engines' counters per instance, the load right now and, where the operator named
DCGM exporters, how busy each instance's GPUs are. Pure: the I/O side
(flexpipe/gateway/ui_routes.py) hands in what it collected; rates and percentiles come from
the difference of two readings (flexpipe/ui/series.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Metric

from flexpipe.control.core.samples import Buckets

__all__ = [
    "EngineCounters",
    "ModelReading",
    "Reading",
    "parse_engine_counters",
    "read_registry",
]

_TTFT = "flexpipe_time_to_first_token_seconds"
_TPOT = "flexpipe_time_per_output_token_seconds"
_REQUESTS = "flexpipe_requests"
_NOT_AN_ERROR = ("200", "cancelled")  # cancelled: the client left, or a move re-sent it
# vLLM's counter names (the sim engine exports the same), and the sim engine's modelled busy
# time (vLLM exports none: its GPU utilisation is not known here) -> EngineCounters field
_ENGINE_COUNTERS = {
    b"vllm:generation_tokens_total": "num_generated_tokens",
    b"vllm:prefix_cache_queries_total": "num_prefix_queries",
    b"vllm:prefix_cache_hits_total": "num_prefix_hits",
    b"flexpipe:modelled_busy_seconds_total": "busy_s",
}


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """An engine's cumulative counters (tokens, busy time), from its /metrics."""

    num_generated_tokens: float = 0.0
    num_prefix_queries: float = 0.0  # prompt tokens looked up in the prefix cache
    num_prefix_hits: float = 0.0  # of which found there
    busy_s: float | None = None  # modelled seconds its GPUs computed; None: not exported


@dataclass(frozen=True, slots=True)
class ModelReading:
    """One model's cumulative figures at the gateway."""

    num_ok: float = 0.0  # requests answered 200
    num_errors: float = 0.0  # requests ended otherwise (not counting clients that left)
    ttft: Buckets = ()  # (upper bound s, cumulative count), ascending
    tpot: Buckets = ()


@dataclass(frozen=True, slots=True)
class Reading:
    at_s: float  # unix seconds
    models: Mapping[str, ModelReading] = field(default_factory=dict)
    engines: Mapping[str, EngineCounters] = field(default_factory=dict)  # instance url -> counters
    instances: tuple[Mapping[str, Any], ...] = ()  # the pool's `Instance.as_dict()`
    num_queued: int = 0  # requests waiting at the gateway for a free instance
    # instance url -> how busy each of its GPUs was, as the DCGM exporters report it now (0..1
    # per GPU that reported one; flexpipe/observe/dcgm.py); empty without exporters
    gpu_busy: Mapping[str, tuple[float, ...]] = field(default_factory=dict)


def read_registry(families: Iterable[Metric]) -> dict[str, ModelReading]:
    """Per model: requests by outcome and the TTFT / TPOT histograms, from the gateway's
    collected Prometheus registry (`registry.collect()`)."""
    ok: dict[str, float] = {}
    errors: dict[str, float] = {}
    buckets: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for family in families:
        if family.name == _REQUESTS:
            for s in family.samples:
                if not s.name.endswith("_total"):
                    continue
                model, status = s.labels.get("model", ""), s.labels.get("status", "")
                if status == "200":
                    ok[model] = ok.get(model, 0.0) + s.value
                elif status not in _NOT_AN_ERROR:
                    errors[model] = errors.get(model, 0.0) + s.value
        elif family.name in (_TTFT, _TPOT):
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    key = (family.name, s.labels.get("model", ""))
                    buckets.setdefault(key, []).append((float(s.labels["le"]), s.value))
    models = set(ok) | set(errors) | {m for _, m in buckets}
    return {
        m: ModelReading(
            ok.get(m, 0.0),
            errors.get(m, 0.0),
            tuple(sorted(buckets.get((_TTFT, m), ()))),
            tuple(sorted(buckets.get((_TPOT, m), ()))),
        )
        for m in sorted(models)
    }


def parse_engine_counters(text: bytes) -> EngineCounters:
    """The counters of an engine's Prometheus text, each summed over its label sets."""
    out: dict[str, float] = {}
    for line in text.split(b"\n"):
        if not line.startswith((b"vllm:", b"flexpipe:")):
            continue
        end = min((i for i in (line.find(b"{"), line.find(b" ")) if i >= 0), default=len(line))
        name = _ENGINE_COUNTERS.get(line[:end])
        if name is None:
            continue
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(b" ", 1)[1])
        except (ValueError, IndexError):
            continue
    return EngineCounters(**out)
