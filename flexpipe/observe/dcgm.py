"""GPU metrics from real GPUs: NVIDIA's DCGM exporter, joined to the instances on them.

dcgm-exporter (one per GPU node, port 9400) exposes a series per GPU labelled `gpu` (the device
index on its host), `UUID`, `device` (`nvidia0`), `modelName` and `Hostname`. How busy a GPU is
comes from `DCGM_FI_PROF_GR_ENGINE_ACTIVE` (the fraction of time the graphics engine ran, a
profiling metric) where the GPU and exporter provide it, else `DCGM_FI_DEV_GPU_UTIL` (percent
of time a kernel ran; coarser). An instance's GPUs are known by (node, device index): the join
is on (hostname, gpu), with the cluster's node names taken as hostnames unless a mapping says
otherwise. The same join in PromQL, on the board: deploy/grafana/flexpipe.json.

Pure: text in, readings and rows out (docs/engines.md, docs/observability.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flexpipe.launch.base import GpuPlace

__all__ = [
    "BUSY_METRICS",
    "GpuReading",
    "InstanceGpu",
    "gpu_busy_by_instance",
    "gpu_instance_labels",
    "instance_busy",
    "join_instances",
    "parse_dcgm",
    "topology_places",
]

# the busy metric, best first, and what divides it into a fraction (GPU_UTIL is in percent)
BUSY_METRICS: tuple[tuple[str, float], ...] = (
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 1.0),
    ("DCGM_FI_DEV_GPU_UTIL", 100.0),
)
_MIB = 1024 * 1024
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU as its node's DCGM exporter saw it."""

    hostname: str
    index: int  # the device index on its host (DCGM's `gpu` label)
    uuid: str
    model_name: str
    busy: float | None  # fraction of the interval the GPU computed (None: not exported)
    busy_metric: str | None  # which DCGM field it came from
    memory_used_bytes: float | None
    memory_free_bytes: float | None
    power_w: float | None


@dataclass(frozen=True, slots=True)
class InstanceGpu:
    """One GPU of an instance and its reading (None: no exporter reported it)."""

    instance: str
    gpu_id: str
    hostname: str
    index: int
    reading: GpuReading | None


def host_key(hostname: str) -> str:
    """Hostnames compared as DCGM and clusters write them: case-blind, short name."""
    return hostname.strip().lower().split(".", 1)[0]


def parse_dcgm(text: str) -> dict[tuple[str, int], GpuReading]:
    """Every GPU of a DCGM exposition (one exporter's, or several concatenated), by
    (host_key(Hostname), gpu index)."""
    values: dict[tuple[str, int], dict[str, float]] = {}
    labels_of: dict[tuple[str, int], dict[str, str]] = {}
    for line in text.splitlines():
        if not line.startswith("DCGM_"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        if "gpu" not in labels or "Hostname" not in labels:
            continue
        try:
            key = (host_key(labels["Hostname"]), int(labels["gpu"]))
            value = float(m.group(3))
        except ValueError:
            continue
        values.setdefault(key, {})[m.group(1)] = value
        labels_of.setdefault(key, labels)
    out = {}
    for key, fields in values.items():
        busy, busy_metric = None, None
        for name, divisor in BUSY_METRICS:
            if name in fields:
                busy, busy_metric = fields[name] / divisor, name
                break
        used = fields.get("DCGM_FI_DEV_FB_USED")
        free = fields.get("DCGM_FI_DEV_FB_FREE")
        labels = labels_of[key]
        out[key] = GpuReading(
            hostname=labels["Hostname"],
            index=key[1],
            uuid=labels.get("UUID", ""),
            model_name=labels.get("modelName", ""),
            busy=busy,
            busy_metric=busy_metric,
            memory_used_bytes=None if used is None else used * _MIB,  # (DCGM reports MiB)
            memory_free_bytes=None if free is None else free * _MIB,
            power_w=fields.get("DCGM_FI_DEV_POWER_USAGE"),
        )
    return out


def join_instances(
    readings: Mapping[tuple[str, int], GpuReading],
    placements: Mapping[str, Sequence[GpuPlace]],
    hostnames: Mapping[str, str] | None = None,
) -> list[InstanceGpu]:
    """Each GPU of each instance (`placements`: instance name -> its GPUs, as
    `EngineSpec.placement` or `control.launching.gpu_places` give them) with its reading.
    `hostnames`: cluster node name -> the host name DCGM reports (default: the same)."""
    rows = []
    for instance in sorted(placements):
        for place in placements[instance]:
            host = (hostnames or {}).get(place.node, place.node)
            rows.append(
                InstanceGpu(
                    instance,
                    place.gpu_id,
                    host,
                    place.index,
                    readings.get((host_key(host), place.index)),
                )
            )
    return rows


def gpu_busy_by_instance(rows: Sequence[InstanceGpu]) -> dict[str, tuple[float, ...]]:
    """Each instance's busy fractions, one per GPU of it that reported one (instances with
    none left out): a model's utilisation is the mean over all its instances' GPUs."""
    seen: dict[str, list[float]] = {}
    for row in rows:
        if row.reading is not None and row.reading.busy is not None:
            seen.setdefault(row.instance, []).append(row.reading.busy)
    return {name: tuple(v) for name, v in sorted(seen.items())}


def instance_busy(rows: Sequence[InstanceGpu]) -> dict[str, float]:
    """Each instance's mean busy fraction over its GPUs that reported one."""
    return {name: sum(v) / len(v) for name, v in gpu_busy_by_instance(rows).items()}


def topology_places(topology: Mapping[str, Any] | None) -> dict[str, tuple[GpuPlace, ...]]:
    """Each instance's GPUs, by its URL, from the controller's GPU map (`GET /admin/topology`,
    control/api/ui_api.py: nodes with their GPUs' ids and device indices, instances with the
    GPU ids of each stage): what the gateway joins DCGM's readings to. GPU ids the map does
    not place are left out."""
    where: dict[str, GpuPlace] = {}
    for node in (topology or {}).get("nodes", []) or []:
        for gpu in node.get("gpus", []) or []:
            try:
                where[str(gpu["id"])] = GpuPlace(
                    str(gpu["id"]), str(node["name"]), int(gpu["index"]), str(gpu.get("type", ""))
                )
            except (KeyError, TypeError, ValueError):
                continue
    out: dict[str, tuple[GpuPlace, ...]] = {}
    for inst in (topology or {}).get("instances", []) or []:
        if not inst.get("url"):
            continue
        ids = [str(g) for stage in inst.get("stages") or [] for g in stage]
        out[str(inst["url"])] = tuple(where[g] for g in ids if g in where)
    return out


def gpu_instance_labels(
    placements: Mapping[str, Sequence[GpuPlace]],
    models: Mapping[str, str],
    hostnames: Mapping[str, str] | None = None,
) -> list[dict[str, str]]:
    """The labels of the info series that joins DCGM's per-GPU series to instances in PromQL
    (`flexpipe_gpu_instance{Hostname, gpu, flexpipe_instance, model} 1`): DCGM's own label
    names, so `* on (Hostname, gpu) group_left (flexpipe_instance, model)` joins them."""
    return [
        {
            "Hostname": row.hostname,
            "gpu": str(row.index),
            "flexpipe_instance": row.instance,
            "model": models.get(row.instance, ""),
        }
        for row in join_instances({}, placements, hostnames)
    ]
