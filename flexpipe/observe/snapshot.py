"""One snapshot of a running flexpipe, built purely from readings (`readings.Readings`): the
instances with their lifecycle state, health and load; each model's rate, TTFT and TPOT p95
against its SLO, queue, prefix-cache hit rate and GPU utilisation (seed 001 §5.3's five
numbers); the GPUs and what occupies them; the last decision.

Rates, percentiles and ratios are over the window since `before` (the previous reading) when
there is one, else since the processes started (`window_s` None). Percentiles come from the
histogram buckets (`control.samples.bucket_quantile`, what PromQL's histogram_quantile does).
Sim engines at a time scale report wall time; the controller compares modelled time with the
SLOs, and so does the snapshot: latencies and rates here are in modelled seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from flexpipe.control.samples import bucket_delta, bucket_quantile, parse_histograms
from flexpipe.observe.readings import Readings

__all__ = [
    "TPOT",
    "TTFT",
    "GpuView",
    "InstanceView",
    "ModelView",
    "Snapshot",
    "parse_samples",
    "snapshot",
]

TTFT = "flexpipe_time_to_first_token_seconds"
TPOT = "flexpipe_time_per_output_token_seconds"
P95 = 0.95

Samples = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> [(labels, value)]


def parse_samples(text: str | None) -> Samples:
    """Prometheus text to sample name -> [(labels, value)] (counters keep `_total`)."""
    out: Samples = {}
    if not text:
        return out
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sum of `name` over the series whose labels include `labels`; None when absent."""
    rows = [
        v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
    ]
    return sum(rows) if rows else None


@dataclass(frozen=True)
class InstanceView:
    name: str
    model: str
    gear: str
    gpus: tuple[str, ...]
    url: str
    state: str  # lifecycle: starting, rehearsing, active, draining
    health: str  # the gateway's view: active, draining, ejected; "unreachable"; "not routed"
    num_running: int | None
    num_waiting: int | None
    num_in_flight: int | None  # open at the gateway
    max_num_seqs: int | None
    kv_usage: float | None  # 0..1
    prefix_hit_rate: float | None  # 0..1
    gpu_utilization: float | None  # 0..1: modelled busy time over (modelled) elapsed time


@dataclass(frozen=True)
class ModelView:
    name: str
    num_instances: int
    request_rate_per_s: float | None  # finished at the gateway (no window: the controller's)
    error_rate: float | None  # share of finished requests that were not 2xx
    ttft_p95_s: float | None
    tpot_p95_s: float | None
    ttft_slo_s: float | None  # the models file's p99 SLO
    tpot_slo_s: float | None
    num_queued: int  # waiting in its engines (+ the gateway's queue for a lone model)
    prefix_hit_rate: float | None
    gpu_utilization: float | None
    generation_tokens_per_s: float | None


@dataclass(frozen=True)
class GpuView:
    id: str
    node: str
    type: str
    capacity_bytes: float
    used_by_others_bytes: float
    owner: str | None
    occupied_by: str | None  # an admin occupation (flexpipe cluster occupy)
    instance: str | None  # the flexpipe instance on it
    gear: str | None
    state: str | None


@dataclass(frozen=True)
class Snapshot:
    at_s: float
    controller_url: str
    gateway_url: str | None
    gateway_up: bool
    engine: str
    time_scale: float
    window_s: float | None  # None: since start
    cluster: str
    num_gateway_queued: int
    instances: tuple[InstanceView, ...]
    models: tuple[ModelView, ...]
    gpus: tuple[GpuView, ...]
    num_shifts: int
    last_decision: str | None  # "hold|shift (trigger): reason"
    last_outcome: str | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------


def _delta(now: float | None, before: float | None) -> float | None:
    if now is None:
        return None
    if before is None:
        return now
    return max(0.0, now - before) if now >= before else now  # a restart resets counters


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


@dataclass(frozen=True)
class _Engine:
    running: float | None
    waiting: float | None
    kv: float | None
    max_num_seqs: float | None
    hits: float | None
    queries: float | None
    busy_s: float | None
    tokens: float | None

    @staticmethod
    def of(text: str | None) -> _Engine | None:
        if text is None:
            return None
        s = parse_samples(text)
        return _Engine(
            _value(s, "vllm:num_requests_running"),
            _value(s, "vllm:num_requests_waiting"),
            _value(s, "vllm:kv_cache_usage_perc"),
            _value(s, "flexpipe:max_num_seqs"),
            _value(s, "vllm:prefix_cache_hits_total"),
            _value(s, "vllm:prefix_cache_queries_total"),
            _value(s, "flexpipe:modelled_busy_seconds_total"),
            _value(s, "vllm:generation_tokens_total"),
        )


def _int(x: float | None) -> int | None:
    return None if x is None else round(x)


def _decision(doc: Any) -> str | None:
    if not isinstance(doc, Mapping):
        return None
    return f"{doc.get('action')} ({doc.get('trigger')}): {doc.get('reason')}"


def _outcome(doc: Any) -> str | None:
    if not isinstance(doc, Mapping):
        return None
    word = "succeeded" if doc.get("succeeded") else "rolled back"
    phases = doc.get("phases_s") or {}
    took = sum(float(v) for v in phases.values()) if isinstance(phases, Mapping) else 0.0
    reason = f": {doc['reason']}" if doc.get("reason") else ""
    return f"{word} in {took:.1f} s{reason}"


def _mean(values: Iterable[tuple[float | None, float]]) -> float | None:
    """Weighted mean of the known values."""
    known = [(v, w) for v, w in values if v is not None]
    total_w = sum(w for _, w in known)
    return None if not known or total_w <= 0 else sum(v * w for v, w in known) / total_w


def snapshot(now: Readings, before: Readings | None = None) -> Snapshot:
    """The snapshot of `now`, with rates over the window since `before`."""
    st = now.status
    scale = float(st.get("time_scale") or 1.0)
    scale = scale if scale > 0 else 1.0
    window_s = None if before is None else max(1e-9, now.at_s - before.at_s)
    modelled_s = None if window_s is None else window_s / scale
    gw = parse_samples(now.gateway_metrics)
    gw0 = parse_samples(before.gateway_metrics) if before is not None else None
    pool_state = {
        lab["instance"]: lab.get("state", "") for lab, _ in gw.get("flexpipe_instance_up", [])
    }

    engines = {u: _Engine.of(t) for u, t in now.engine_metrics.items()}
    engines0 = {u: _Engine.of(t) for u, t in (before.engine_metrics if before else {}).items()}

    instances: list[InstanceView] = []
    busy: dict[str, tuple[float | None, float]] = {}
    for doc in st.get("instances", []):
        url = str(doc.get("url", ""))
        e, e0 = engines.get(url), engines0.get(url)
        if e is None:
            health = "unreachable"
        elif url not in pool_state:
            health = "not routed"
        else:
            health = pool_state[url]
        hits = _delta(e.hits, e0.hits if e0 else None) if e else None
        queries = _delta(e.queries, e0.queries if e0 else None) if e else None
        util = None
        if e is not None and e0 is not None and modelled_s and e.busy_s is not None:
            util = min(1.0, (_delta(e.busy_s, e0.busy_s) or 0.0) / modelled_s)
        gpus = tuple(str(g) for g in doc.get("gpus", []))
        busy[url] = (util, float(len(gpus) or 1))
        instances.append(
            InstanceView(
                name=str(doc.get("name", "")),
                model=str(doc.get("model", "")),
                gear=str(doc.get("gear", "")),
                gpus=gpus,
                url=url,
                state=str(doc.get("state", "")),
                health=health,
                num_running=_int(e.running) if e else None,
                num_waiting=_int(e.waiting) if e else None,
                num_in_flight=_int(_value(gw, "flexpipe_in_flight_requests", instance=url)),
                max_num_seqs=_int(e.max_num_seqs) if e else None,
                kv_usage=e.kv if e else None,
                prefix_hit_rate=_ratio(hits, queries),
                gpu_utilization=util,
            )
        )

    num_gateway_queued = _int(_value(gw, "flexpipe_queued_requests")) or 0
    model_docs = [m for m in st.get("models", []) if isinstance(m, Mapping)]
    names = [str(m["name"]) for m in model_docs] or sorted({i.model for i in instances})
    slo = {str(m["name"]): m.get("slo") or {} for m in model_docs}
    # without a window: the controller's own measure (finished requests over its last minute)
    rate = {str(m["name"]): float(m["request_rate_per_s"]) for m in model_docs
            if m.get("request_rate_per_s") is not None}  # fmt: skip
    hist = parse_histograms(now.gateway_metrics or "", (TTFT, TPOT))
    hist0 = parse_histograms(before.gateway_metrics or "", (TTFT, TPOT)) if before else {}
    models = []
    for name in names:
        mine = [i for i in instances if i.model == name]
        done = _value(gw, "flexpipe_requests_total", model=name)
        done0 = _value(gw0, "flexpipe_requests_total", model=name) if gw0 is not None else None
        ok = sum(
            v for lab, v in gw.get("flexpipe_requests_total", [])
            if lab.get("model") == name and lab.get("status", "").startswith("2")
        )  # fmt: skip
        ok0 = sum(
            v for lab, v in (gw0 or {}).get("flexpipe_requests_total", [])
            if lab.get("model") == name and lab.get("status", "").startswith("2")
        )  # fmt: skip
        num_done = _delta(done, done0)
        num_ok = ok - ok0 if gw0 is not None and ok >= ok0 else ok
        p95 = {}
        for metric in (TTFT, TPOT):
            buckets = bucket_delta(hist.get((metric, name), ()), hist0.get((metric, name)))
            q = bucket_quantile(P95, buckets)
            p95[metric] = None if q is None else q / scale
        hits = queries = 0.0
        tokens: float | None = None
        for i in mine:
            e, e0 = engines.get(i.url), engines0.get(i.url)
            if e is None:
                continue
            hits += _delta(e.hits, e0.hits if e0 else None) or 0.0
            queries += _delta(e.queries, e0.queries if e0 else None) or 0.0
            if e0 is not None and e.tokens is not None:
                tokens = (tokens or 0.0) + (_delta(e.tokens, e0.tokens) or 0.0)
        waiting = sum(i.num_waiting or 0 for i in mine)
        ttft_slo, tpot_slo = (
            slo.get(name, {}).get("ttft_p99_s"),
            slo.get(name, {}).get("tpot_p99_s"),
        )
        models.append(
            ModelView(
                name=name,
                num_instances=len(mine),
                request_rate_per_s=_ratio(num_done, modelled_s) if modelled_s else rate.get(name),
                error_rate=None if not num_done else (num_done - num_ok) / num_done,
                ttft_p95_s=p95[TTFT],
                tpot_p95_s=p95[TPOT],
                ttft_slo_s=None if ttft_slo is None else float(ttft_slo),
                tpot_slo_s=None if tpot_slo is None else float(tpot_slo),
                num_queued=waiting + (num_gateway_queued if len(names) == 1 else 0),
                prefix_hit_rate=_ratio(hits, queries),
                gpu_utilization=_mean(busy[i.url] for i in mine),
                generation_tokens_per_s=_ratio(tokens, modelled_s) if tokens is not None else None,
            )
        )

    on_gpu = {g: i for i in instances for g in i.gpus}
    resources = st.get("resources") or {}
    gpu_views: list[GpuView] = []
    for g in resources.get("gpus", []):
        inst = on_gpu.get(str(g["id"]))
        occupied = g.get("occupied")
        gpu_views.append(
            GpuView(
                id=str(g["id"]),
                node=str(g.get("node", "")),
                type=str(g.get("type", "")),
                capacity_bytes=float(g.get("capacity_bytes", 0.0)),
                used_by_others_bytes=float(g.get("used_bytes", 0.0)),
                owner=g.get("owner"),
                occupied_by=occupied.get("owner") if isinstance(occupied, Mapping) else None,
                instance=inst.name if inst else None,
                gear=inst.gear if inst else None,
                state=inst.state if inst else None,
            )
        )

    return Snapshot(
        at_s=now.at_s,
        controller_url=now.controller_url,
        gateway_url=st.get("gateway"),
        gateway_up=now.gateway_metrics is not None,
        engine=str(st.get("engine", "")),
        time_scale=scale,
        window_s=window_s,
        cluster=str(resources.get("cluster", "")),
        num_gateway_queued=num_gateway_queued,
        instances=tuple(instances),
        models=tuple(models),
        gpus=tuple(gpu_views),
        num_shifts=int(st.get("num_shifts", 0)),
        last_decision=_decision(st.get("last_decision")),
        last_outcome=_outcome(st.get("last_outcome")),
    )
