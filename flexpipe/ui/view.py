"""The dashboard's one JSON document ("the view"), assembled from snapshots: the gateway's
readings (flexpipe/ui/series.py), and, when the gateway knows its controller, the GPU map
(`GET /admin/topology`) and the shift log (`GET /admin/shifts`). Pure: `now_s` and every
snapshot come in; nothing here reads a clock or does I/O. docs/dashboard.md lists the fields.

Latencies and rates are in the model's seconds: sim engines at a time scale run `time_scale`
wall seconds per modelled second, and SLOs and the gear table are modelled (what the controller
does too). A model's GPU utilisation, and where it came from (`gpu_utilization_source`):
"dcgm", the mean over its instances' GPUs of how busy the DCGM exporters measured them (real
engines: vLLM, SGLang; wall time, never scaled); else "modelled", its sim engines' modelled busy
time over the modelled time elapsed, the mean over its instances; else None, where neither
exists, which the dashboard and `flexpipe status` both show as "n/a".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flexpipe.ui.series import History, Point, dcgm_busy_now

__all__ = [
    "GPU_UTILIZATION_SOURCES",
    "VIEW_VERSION",
    "ControllerSnapshot",
    "ExporterState",
    "assemble_view",
    "gpu_utilization",
    "shift_row",
    "shifts_shown",
]

VIEW_VERSION = 1
WINDOW_S = 60.0  # the "now" figures: over the last minute


@dataclass(frozen=True, slots=True)
class ControllerSnapshot:
    """What the gateway last got from its controller (None fields: not got yet / failed)."""

    url: str
    topology: Mapping[str, Any] | None = None
    shifts: Sequence[Mapping[str, Any]] | None = None  # its deployment's newest entries
    error: str | None = None  # the last poll's failure, in one line
    at_s: float | None = None  # when the last poll succeeded
    shifts_all: Sequence[Mapping[str, Any]] | None = None  # every deployment's on its store
    deployment: str | None = None  # what its shift log entries are written as


@dataclass(frozen=True, slots=True)
class ExporterState:
    """One DCGM exporter the gateway scrapes (its `dcgm_urls`), as its last scrape left it."""

    url: str
    num_gpus: int = 0  # GPUs its last answer reported
    error: str | None = None  # why its last scrape failed, in one line (None: it answered)


_RATES = ("request_rate_per_s", "error_rate_per_s", "tokens_per_s")
# where a GPU utilisation came from: measured on the GPUs, or the sim engine's model of them
GPU_UTILIZATION_SOURCES = ("dcgm", "modelled")


def gpu_utilization(fig: Mapping[str, Any], scale: float) -> tuple[float | None, str | None]:
    """A model's utilisation (0..1) and its source, from a series point's figures: measured
    beats modelled (DCGM's figure leaves the sim engines out, so the two never describe the
    same instance); the modelled busy time per wall second is scaled to modelled seconds."""
    measured = fig.get("gpu_busy")
    if measured is not None:
        return round(min(1.0, float(measured)), 4), "dcgm"
    busy = fig.get("busy_s_per_s")
    if busy is not None:
        return round(min(1.0, busy * scale), 4), "modelled"
    return None, None


def _scaled_model(fig: Mapping[str, Any], scale: float) -> dict[str, Any]:
    """A model's figures in modelled seconds: latencies / scale, rates x scale, and its GPU
    utilisation (0..1) with its source."""
    out = {k: v for k, v in fig.items() if k not in ("busy_s_per_s", "gpu_busy")}
    for key in ("ttft_s", "tpot_s"):
        q = fig.get(key)
        if isinstance(q, Mapping):
            out[key] = {k: None if v is None else round(v / scale, 6) for k, v in q.items()}
    for key in _RATES:
        if fig.get(key) is not None:
            out[key] = round(fig[key] * scale, 4)
    out["gpu_utilization"], out["gpu_utilization_source"] = gpu_utilization(fig, scale)
    return out


def _scaled(point: Point, scale: float) -> Point:
    models = {m: _scaled_model(f, scale) for m, f in point["models"].items()}
    return {**point, "models": models}


def _seconds_between(a: str | None, b: str | None) -> float | None:
    if not a or not b:
        return None
    try:
        return round((datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds(), 3)
    except ValueError:
        return None


def shift_row(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A shift log entry (`ShiftEntry.to_dict()`) with what the timeline shows first: "from →
    to" (the words of `flexpipe shifts`) and how long it took."""
    # imported here: the CLI package loads every command (typer, rich), which a gateway
    # without a controller never needs
    from flexpipe.cli.shifts import moves_text
    from flexpipe.store.shift_entry import ShiftEntry

    try:
        from_to = moves_text(ShiftEntry.from_dict(entry))
    except (KeyError, TypeError, ValueError):
        from_to = "—"
    return {
        **entry,
        "from_to": from_to,
        "duration_s": _seconds_between(entry.get("at"), entry.get("finished_at")),
    }


def _at_s(entry: Mapping[str, Any]) -> float | None:
    try:
        return datetime.fromisoformat(str(entry.get("at"))).timestamp()
    except ValueError:
        return None


def shifts_shown(
    controller: ControllerSnapshot | None, started_at_s: float | None, every: bool = False
) -> tuple[list[Mapping[str, Any]], int]:
    """The shift log entries the timeline shows, and how many of those polled it leaves out.
    By default this run's: entries of the controller's deployment since this gateway started
    (the store is shared: other deployments write there, and an earlier `flexpipe up` on the
    same port was the same deployment); `every`: every deployment's, earlier runs too."""
    if controller is None:
        return [], 0
    own = list(controller.shifts or ())
    run = [e for e in own if started_at_s is None or (_at_s(e) or started_at_s) >= started_at_s]
    polled = own if controller.shifts_all is None else list(controller.shifts_all)
    if every:
        return polled, 0
    shown_ids = {e.get("id") for e in run}
    return run, sum(1 for e in polled if e.get("id") not in shown_ids)


def _instances(
    gateway: Sequence[Mapping[str, Any]],
    topology: Mapping[str, Any] | None,
    dcgm: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """The gateway's pool joined with the controller's instances by URL. `state` is the
    lifecycle state where the controller knows it (starting, rehearsing, active, draining),
    else the gateway's (active, draining, ejected); an ejected instance stays ejected.
    `dcgm`: url -> how busy DCGM saw its GPUs at the last reading (mean over them)."""
    busy = dcgm or {}
    planned = {str(i["url"]): i for i in (topology or {}).get("instances", [])}
    out = []
    for inst in gateway:
        url = str(inst["url"])
        ctl = planned.pop(url, None)
        state = str(inst.get("state"))
        if ctl is not None and state != "ejected":
            state = str(ctl.get("state", state))
        out.append(
            {
                "url": url,
                "model": inst.get("model"),
                "state": state,
                "gateway_state": inst.get("state"),
                "name": None if ctl is None else ctl.get("name"),
                "key": None if ctl is None else ctl.get("key"),
                "gear": None if ctl is None else ctl.get("gear"),
                "stages": None if ctl is None else ctl.get("stages"),
                "num_in_flight": inst.get("num_in_flight", 0),
                "num_running": inst.get("num_running", 0),
                "num_waiting": inst.get("num_waiting", 0),
                "max_concurrency": inst.get("max_concurrency", 0),
                "kv_usage": inst.get("kv_usage", 0.0),
                "weight": inst.get("weight", 1.0),
                **_measured(busy.get(url)),
            }
        )
    for url, ctl in planned.items():  # launched, not in the gateway's pool yet
        out.append(
            {
                "url": url,
                "model": ctl.get("model"),
                "state": ctl.get("state"),
                "gateway_state": None,
                "name": ctl.get("name"),
                "key": ctl.get("key"),
                "gear": ctl.get("gear"),
                "stages": ctl.get("stages"),
                "num_in_flight": 0,
                "num_running": 0,
                "num_waiting": 0,
                "max_concurrency": 0,
                "kv_usage": 0.0,
                "weight": 0.0,
                **_measured(busy.get(url)),
            }
        )
    return out


def _measured(busy: float | None) -> dict[str, Any]:
    """An instance's GPU utilisation as DCGM measured it (the modelled one needs two readings
    of its engine: `flexpipe status` has it)."""
    return {
        "gpu_utilization": None if busy is None else round(min(1.0, busy), 4),
        "gpu_utilization_source": None if busy is None else "dcgm",
    }


def _models(
    instances: Sequence[Mapping[str, Any]],
    topology: Mapping[str, Any] | None,
    window: Point | None,
) -> list[dict[str, Any]]:
    slos = {str(m["name"]): m.get("slo") for m in (topology or {}).get("models", [])}
    names = set(slos) | {str(i["model"]) for i in instances if i.get("model")}
    if window is not None:
        names |= set(window["models"])
    return [
        {
            "name": name,
            "slo": slos.get(name),
            "now": None if window is None else window["models"].get(name),
            "instances": [i["url"] for i in instances if i.get("model") == name],
        }
        for name in sorted(names)
    ]


def _cluster(
    topology: Mapping[str, Any] | None, instances: Sequence[Mapping[str, Any]]
) -> dict[str, Any] | None:
    """The map: the controller's topology, each occupied GPU with its instance's state."""
    if topology is None:
        return None
    by_key = {i["key"]: i for i in instances if i.get("key")}
    nodes = []
    for node in topology.get("nodes", []):
        gpus = []
        for gpu in node.get("gpus", []):
            inst = by_key.get(gpu.get("instance"))
            # (a GPU shared in memory: every instance on it, docs/gpu-sharing.md)
            shared = [by_key[k] for k in gpu.get("instances", []) if k in by_key]
            gpus.append(
                {
                    **gpu,
                    **(
                        {
                            "shared": [
                                {f: i.get(f) for f in ("model", "gear", "state")} for i in shared
                            ]
                        }
                        if shared
                        else {}
                    ),
                    "model": None if inst is None else inst.get("model"),
                    "gear": None if inst is None else inst.get("gear"),
                    "state": None if inst is None else inst.get("state"),
                    "url": None if inst is None else inst.get("url"),
                }
            )
        nodes.append({**node, "gpus": gpus})
    return {
        "name": topology.get("cluster"),
        "nodes": nodes,
        "node_links": list(topology.get("node_links", [])),
    }


def assemble_view(
    now_s: float,
    history: History,
    controller: ControllerSnapshot | None,
    interval_s: float,
    since_s: float | None = None,
    admin_enabled: bool = False,
    started_at_s: float | None = None,
    every_shift: bool = False,
    exporters: Sequence[ExporterState] | None = None,
) -> dict[str, Any]:
    """The view at `now_s`; `series` holds the points after `since_s` (all for None: a
    client that has the earlier ones asks only for what is new). `shifts`: this run's (since
    `started_at_s`, when the gateway started), or every deployment's with `every_shift`.
    `exporters`: the DCGM exporters the gateway scrapes (None: it was given none)."""
    topology = None if controller is None else controller.topology
    scale = float((topology or {}).get("time_scale") or 1.0)
    latest = history.latest
    dcgm = dcgm_busy_now(latest) if latest else {}
    instances = _instances(latest.instances if latest else (), topology, dcgm)
    window = history.window(WINDOW_S)
    if window is not None:
        window = _scaled(window, scale)
    shifts, num_hidden = shifts_shown(controller, started_at_s, every_shift)
    return {
        "version": VIEW_VERSION,
        "source": "live",
        "at_s": now_s,
        "interval_s": interval_s,
        "window_s": WINDOW_S,
        "max_age_s": history.max_age_s,
        "time_scale": scale,
        "admin_enabled": admin_enabled,
        "num_queued": latest.num_queued if latest else 0,
        "instances": instances,
        "models": _models(instances, topology, window),
        "series": [_scaled(p, scale) for p in history.since(since_s)],
        "cluster": _cluster(topology, instances),
        "shifts": [shift_row(e) for e in shifts],
        "shifts_scope": "all" if every_shift else "run",
        "num_hidden_shifts": num_hidden,  # of those polled: earlier runs, other deployments
        "deployment": None if controller is None else controller.deployment,
        "started_at_s": started_at_s,
        "controller": None
        if controller is None
        else {"url": controller.url, "error": controller.error, "at_s": controller.at_s},
        # the gateway replicas the controller drives, as it last saw them (url, up, in flight,
        # requests/s, pool in sync or stale: control/gateway_fleet.py); [] without a fleet
        "gateways": list((topology or {}).get("gateways") or []),
        "dcgm": None
        if exporters is None
        else {
            "exporters": [
                {"url": e.url, "num_gpus": e.num_gpus, "error": e.error} for e in exporters
            ]
        },
    }
