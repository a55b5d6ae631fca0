"""One snapshot of a running flexpipe, built purely from readings (`readings.Readings`): the
instances with their lifecycle state, health and load; each model's rate, TTFT and TPOT p95
against its SLO, queue, prefix-cache hit rate, GPU utilisation and output tokens/s (seed 001
§5.3's numbers); the GPUs and what occupies them; the last decision.

A model's figures are the dashboard's: the gateway computes them over its last minute
(flexpipe/ui/series.py, scaled to modelled seconds by flexpipe/ui/view.py) and the snapshot
takes them from its view, so `flexpipe status` and the dashboard show the same numbers; a
model's GPU utilisation comes from DCGM where the gateway scrapes exporters, else from the sim
engines' modelled busy time (`gpu_utilization_source` says which), and is None where neither
exists (both show "n/a"). An instance's prefix-cache hit rate and modelled GPU utilisation are
over the window since `before` (the previous reading) when there is one, else since the engine
started (`window_s` None); sim engines at a time scale report wall time, and these are in
modelled seconds too. An instance's DCGM figure is the gateway's last reading of its GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from flexpipe.observe.readings import Readings
from flexpipe.ui.view import GPU_UTILIZATION_SOURCES

__all__ = [
    "GatewayView",
    "GpuView",
    "InstanceView",
    "ModelView",
    "Snapshot",
    "parse_samples",
    "snapshot",
]

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
    state: str  # lifecycle: starting, rehearsing, active, draining, asleep, waking
    # "ok"; "ejected" (active, failed its probes); "unreachable"; "not routed"; "asleep (level N)"
    health: str
    num_running: int | None
    num_waiting: int | None
    num_in_flight: int | None  # open at the gateway
    max_num_seqs: int | None
    kv_usage: float | None  # 0..1
    prefix_hit_rate: float | None  # 0..1
    gpu_utilization: float | None  # 0..1: measured (DCGM) or modelled busy time over time
    gpu_utilization_source: str | None = None  # "dcgm" | "modelled" | None (not known)


@dataclass(frozen=True)
class ModelView:
    """The figures the dashboard shows for the model (None: the gateway has none yet)."""

    name: str
    num_instances: int
    measured: bool  # the gateway's view has its figures (over `Snapshot.gateway_window_s`)
    request_rate_per_s: float | None  # answered (200) at the gateway
    error_rate: float | None  # share of finished requests that failed (a client leaving: not)
    ttft_p95_s: float | None
    tpot_p95_s: float | None
    ttft_slo_s: float | None  # the models file's p99 SLO
    tpot_slo_s: float | None
    num_queued: int | None  # waiting in its engines (+ the gateway's queue for a lone model)
    prefix_hit_rate: float | None
    gpu_utilization: float | None  # measured but None: no DCGM figure nor modelled busy time
    generation_tokens_per_s: float | None
    refused: str | None = None  # why its requests are refused (no GPU free to us can place it)
    gpu_utilization_source: str | None = None  # "dcgm" | "modelled" | None (the view's)


@dataclass(frozen=True)
class GpuView:
    id: str
    node: str
    type: str
    capacity_bytes: float
    used_by_others_bytes: float
    owner: str | None
    occupied_by: str | None  # an admin occupation (flexpipe cluster occupy)
    instance: str | None  # the flexpipe instance on it (the first, when several share it)
    gear: str | None
    state: str | None
    # the other instances on it (sharing it in memory, or asleep beside it): name, gear, state
    shared_with: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class GatewayView:
    """One gateway replica as the controller last saw it (control/gateway_fleet.py)."""

    url: str
    up: bool
    num_in_flight: int | None  # requests open there now
    requests_per_s: float | None  # finished there, over the controller's last two reads
    pool: str  # "in sync", "catching up", "stale: ..." or "unknown" (down, or not read yet)
    seen_s_ago: float | None  # its last answer
    error: str | None = None  # why its last call failed


@dataclass(frozen=True)
class Snapshot:
    at_s: float
    controller_url: str
    gateway_url: str | None
    gateway_up: bool
    engine: str
    time_scale: float
    window_s: float | None  # the instances' figures; None: since start
    gateway_window_s: float | None  # the models' figures (the dashboard's); None: none yet
    cluster: str
    num_gateway_queued: int
    instances: tuple[InstanceView, ...]
    models: tuple[ModelView, ...]
    gpus: tuple[GpuView, ...]
    num_shifts: int
    last_decision: str | None  # "hold|shift (trigger): reason"
    last_outcome: str | None
    # every gateway replica the controller drives (); empty: a controller that says none
    gateways: tuple[GatewayView, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------


def _delta(now: float | None, before: float | None) -> float | None:
    """A counter's increase; its value when there is no earlier one or it went back (the
    process restarted and counts from 0 again)."""
    if now is None:
        return None
    if before is None or now < before:
        return now
    return now - before


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


@dataclass(frozen=True)
class _Window:
    """The two readings a snapshot compares, parsed once."""

    scale: float  # wall seconds per modelled second
    modelled_s: float | None  # the window in modelled seconds; None: since start
    gw: Samples
    engines: dict[str, _Engine | None]
    engines0: dict[str, _Engine | None]

    @staticmethod
    def of(now: Readings, before: Readings | None) -> _Window:
        scale = float(now.status.get("time_scale") or 1.0)
        scale = scale if scale > 0 else 1.0
        window_s = None if before is None else max(1e-9, now.at_s - before.at_s)
        previous = before.engine_metrics if before is not None else {}
        return _Window(
            scale,
            None if window_s is None else window_s / scale,
            parse_samples(now.gateway_metrics),
            {u: _Engine.of(t) for u, t in now.engine_metrics.items()},
            {u: _Engine.of(t) for u, t in previous.items()},
        )

    def counted(self, url: str, field: str) -> float | None:
        """An engine counter over the window (since start without one)."""
        e, e0 = self.engines.get(url), self.engines0.get(url)
        if e is None:
            return None
        return _delta(getattr(e, field), getattr(e0, field) if e0 is not None else None)


def _health(reachable: bool, pool: tuple[str, float] | None) -> str:
    """From the engine's scrape and the gateway's `flexpipe_instance_up{state}` (1 when routed:
    active and healthy). Health is not the lifecycle: a draining instance is "ok"."""
    if not reachable:
        return "unreachable"
    if pool is None:
        return "not routed"
    state, up = pool
    return "ejected" if state == "active" and up < 1 else "ok"


def _instance_view(
    doc: Mapping[str, Any],
    w: _Window,
    pool: Mapping[str, tuple[str, float]],
    measured: Mapping[str, Mapping[str, Any]],
) -> InstanceView:
    """`measured`: the gateway view's instances by URL (DCGM's figure for each, where the
    gateway has one)."""
    url = str(doc.get("url", ""))
    e, e0 = w.engines.get(url), w.engines0.get(url)
    health = _health(e is not None, pool.get(url))
    util, source = None, None
    if e is not None and e0 is not None and w.modelled_s and e.busy_s is not None:
        util = min(1.0, (w.counted(url, "busy_s") or 0.0) / w.modelled_s)
        source = "modelled"
    elif (dcgm := _float((measured.get(url) or {}).get("gpu_utilization"))) is not None:
        util, source = dcgm, "dcgm"
    return InstanceView(
        name=str(doc.get("name", "")),
        model=str(doc.get("model", "")),
        gear=str(doc.get("gear", "")),
        gpus=tuple(str(g) for g in doc.get("gpus", [])),
        url=url,
        state=str(doc.get("state", "")),
        health=health,
        num_running=_int(e.running) if e else None,
        num_waiting=_int(e.waiting) if e else None,
        num_in_flight=_int(_value(w.gw, "flexpipe_in_flight_requests", instance=url)),
        max_num_seqs=_int(e.max_num_seqs) if e else None,
        kv_usage=e.kv if e else None,
        prefix_hit_rate=_ratio(w.counted(url, "hits"), w.counted(url, "queries")),
        gpu_utilization=util,
        gpu_utilization_source=source,
    )


def _asleep_view(doc: Mapping[str, Any]) -> InstanceView:
    """An engine asleep: its state and level, nothing measured (it is not scraped)."""
    level = doc.get("level")
    return InstanceView(
        name=str(doc.get("name", "")),
        model=str(doc.get("model", "")),
        gear=str(doc.get("gear", "")),
        gpus=tuple(str(g) for g in doc.get("gpus", [])),
        url=str(doc.get("url", "")),
        state=str(doc.get("state", "asleep")),
        health="asleep" if level is None else f"asleep (level {level})",
        num_running=None,
        num_waiting=None,
        num_in_flight=None,
        max_num_seqs=None,
        kv_usage=None,
        prefix_hit_rate=None,
        gpu_utilization=None,
    )


def _model_view(
    doc: Mapping[str, Any], mine: Sequence[InstanceView], now: Mapping[str, Any] | None
) -> ModelView:
    """`doc`: the controller's part on the model; `now`: the dashboard's figures for it (the
    view's `models[].now`; None: the gateway has none yet)."""
    fig = now or {}
    ok, errors = _float(fig.get("request_rate_per_s")), _float(fig.get("error_rate_per_s"))
    finished = (ok or 0.0) + (errors or 0.0)
    slo = doc.get("slo") or {}
    return ModelView(
        name=str(doc["name"]),
        num_instances=len(mine),
        measured=now is not None,
        request_rate_per_s=ok,
        error_rate=(errors or 0.0) / finished if finished else None,
        ttft_p95_s=_float((fig.get("ttft_s") or {}).get("p95")),
        tpot_p95_s=_float((fig.get("tpot_s") or {}).get("p95")),
        ttft_slo_s=_float(slo.get("ttft_p99_s")),
        tpot_slo_s=_float(slo.get("tpot_p99_s")),
        num_queued=_int(_float(fig.get("queue"))),
        prefix_hit_rate=_float(fig.get("prefix_hit_rate")),
        gpu_utilization=_float(fig.get("gpu_utilization")),
        generation_tokens_per_s=_float(fig.get("tokens_per_s")),
        refused=str(doc["refused"]) if doc.get("refused") else None,
        gpu_utilization_source=_source(fig.get("gpu_utilization_source")),
    )


def _source(x: Any) -> str | None:
    return str(x) if x in GPU_UTILIZATION_SOURCES else None


def _measured(view: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    """The view's instances by URL (those that carry DCGM's figure)."""
    rows = (view or {}).get("instances") or []
    return {
        str(i["url"]): i
        for i in rows
        if isinstance(i, Mapping) and i.get("url") and i.get("gpu_utilization_source") == "dcgm"
    }


def _figures(view: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    """The view's figures per model (those it has)."""
    models = (view or {}).get("models") or []
    return {
        str(m["name"]): m["now"]
        for m in models
        if isinstance(m, Mapping) and isinstance(m.get("now"), Mapping)
    }


def _float(x: Any) -> float | None:
    return None if x is None else float(x)


def _gpu_views(resources: Mapping[str, Any], instances: Sequence[InstanceView]) -> list[GpuView]:
    on_gpu: dict[str, list[InstanceView]] = {}  # GPU id -> the instances on it, in order
    for i in instances:
        for gpu in i.gpus:
            on_gpu.setdefault(gpu, []).append(i)
    out = []
    for g in resources.get("gpus", []):
        on = on_gpu.get(str(g["id"]), [])
        inst, rest = (on[0], on[1:]) if on else (None, [])
        occupied = g.get("occupied")
        out.append(
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
                shared_with=tuple((i.name, i.gear, i.state) for i in rest),
            )
        )
    return out


def snapshot(now: Readings, before: Readings | None = None) -> Snapshot:
    """The snapshot of `now`, with rates over the window since `before`."""
    st = now.status
    w = _Window.of(now, before)
    pool = {
        lab["instance"]: (lab.get("state", ""), v)
        for lab, v in w.gw.get("flexpipe_instance_up", [])
    }
    measured = _measured(now.gateway_view)
    instances = [_instance_view(doc, w, pool, measured) for doc in st.get("instances", [])]
    # engines asleep (docs/controller.md, "Sleep instead of stop"): listed with their state;
    # they hold their GPUs and serve nothing, so no model counts them among its instances
    asleep = [_asleep_view(doc) for doc in st.get("asleep", []) or [] if isinstance(doc, Mapping)]
    num_gateway_queued = _int(_value(w.gw, "flexpipe_queued_requests")) or 0
    model_docs = [m for m in st.get("models", []) if isinstance(m, Mapping)]
    if not model_docs:  # a controller without the models part: what its instances serve
        model_docs = [{"name": n} for n in sorted({i.model for i in instances})]
    figures = _figures(now.gateway_view)
    models = [
        _model_view(m, [i for i in instances if i.model == m["name"]], figures.get(m["name"]))
        for m in model_docs
    ]
    instances += asleep
    resources = st.get("resources") or {}
    return Snapshot(
        at_s=now.at_s,
        controller_url=now.controller_url,
        gateway_url=st.get("gateway"),
        gateway_up=now.gateway_metrics is not None,
        engine=str(st.get("engine", "")),
        time_scale=w.scale,
        window_s=None if before is None else max(1e-9, now.at_s - before.at_s),
        gateway_window_s=_float((now.gateway_view or {}).get("window_s")) if figures else None,
        cluster=str(resources.get("cluster", "")),
        num_gateway_queued=num_gateway_queued,
        instances=tuple(instances),
        models=tuple(models),
        gpus=tuple(_gpu_views(resources, instances)),
        num_shifts=int(st.get("num_shifts", 0)),
        last_decision=_decision(st.get("last_decision")),
        last_outcome=_outcome(st.get("last_outcome")),
        gateways=tuple(
            _gateway_view(g) for g in st.get("gateways") or () if isinstance(g, Mapping)
        ),
    )


def _gateway_view(doc: Mapping[str, Any]) -> GatewayView:
    in_flight = doc.get("num_in_flight")
    return GatewayView(
        url=str(doc.get("url", "")),
        up=bool(doc.get("up")),
        num_in_flight=None if in_flight is None else int(in_flight),
        requests_per_s=_float(doc.get("requests_per_s")),
        pool=str(doc.get("pool") or "unknown"),
        seen_s_ago=_float(doc.get("seen_s_ago")),
        error=str(doc["error"]) if doc.get("error") else None,
    )
