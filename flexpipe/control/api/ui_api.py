"""Read-only views of the controller for the dashboard (docs/dashboard.md), behind the same
bearer token as the rest of its admin API:

    GET /admin/topology          the GPU map: nodes, GPUs (type, memory of other tenants and
                                 of flexpipe's engines), links (fast or slow), the instances on
                                 them with gear and lifecycle state, each model's SLOs; the
                                 gateway replicas the controller drives (`gateways`)
    GET /admin/shifts?limit=N[&all=1]
                                 the newest N entries of the shift log (holds left out) that
                                 this controller's deployment wrote (all=1: every
                                 deployment's on the store), each `ShiftEntry.to_dict()`,
                                 oldest first, and the deployment's id

`topology_doc` is pure (cluster and instances in, JSON-ready dict out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flexpipe.cluster import Cluster
from flexpipe.control.api.admin_api import authorize
from flexpipe.control.gateway_fleet import fleet_view
from flexpipe.gears.gear import DEFAULT_GPU_MEMORY_UTILIZATION
from flexpipe.hardware import DEFAULT_FAST_LINK_BYTES_PER_S, LinkSpec
from flexpipe.http.server import App, HttpError, Request, Response, json_response
from flexpipe.perf.memory import engine_budget_bytes
from flexpipe.policies.planner import ModelDemand, PlannedInstance
from flexpipe.store.shift_entry import KINDS

if TYPE_CHECKING:
    from flexpipe.control.controller import Controller

__all__ = ["SHIFTS_PATH", "TOPOLOGY_PATH", "UiApi", "UiInstance", "topology_doc"]

TOPOLOGY_PATH = "/admin/topology"
SHIFTS_PATH = "/admin/shifts"
_MAX_SHIFTS = 500
_SHOWN_KINDS = tuple(k for k in KINDS if k != "hold")  # a hold per tick would drown the rest


@dataclass(frozen=True, slots=True)
class UiInstance:
    """One running instance as the map shows it."""

    key: str
    name: str
    model: str
    gear: str
    stages: tuple[tuple[str, ...], ...]  # GPU ids per pipeline stage
    url: str
    state: str  # starting | rehearsing | active | draining
    gpu_memory_fraction: float | None = None  # shares its GPU (docs/gpu-sharing.md)


def _link(spec: LinkSpec) -> dict[str, Any]:
    return {
        "link": spec.name,
        "gb_per_s": round(spec.bandwidth_bytes_per_s / 1e9, 3),
        "fast": spec.bandwidth_bytes_per_s >= DEFAULT_FAST_LINK_BYTES_PER_S,
    }


def _instance(i: UiInstance) -> dict[str, Any]:
    return {
        "key": i.key,
        "name": i.name,
        "model": i.model,
        "gear": i.gear,
        "stages": [list(s) for s in i.stages],
        "url": i.url,
        "state": i.state,
    }


def topology_doc(
    cluster: Cluster,
    instances: Sequence[UiInstance],
    demands: Sequence[ModelDemand],
    time_scale: float = 1.0,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
) -> dict[str, Any]:
    """The GPU map. `cluster` is the cluster as free for us (other tenants' memory used,
    admin occupations laid over it); an engine's memory on a GPU is what the memory plan lets
    it take there (min(utilisation x capacity, free)), the same budget its KV cache is sized
    from; a GPU shared in memory lists every instance on it (`instances`), the memory theirs
    together."""
    on_gpu: dict[str, list[tuple[UiInstance, int]]] = {}  # gpu id -> (instance, stage index)
    for inst in instances:
        for stage_index, stage in enumerate(inst.stages):
            for gpu_id in stage:
                on_gpu.setdefault(gpu_id, []).append((inst, stage_index))
    nodes = []
    for node in cluster.nodes:
        gpus = []
        for gpu in node.gpus:
            tenants = on_gpu.get(gpu.id, [])
            here = tenants[0] if tenants else None
            ours = sum(
                engine_budget_bytes(
                    cluster.slot(gpu.id), i.gpu_memory_fraction or gpu_memory_utilization
                )
                for i, _ in tenants
            )
            gpus.append(
                {
                    "id": gpu.id,
                    "type": gpu.type,
                    "index": gpu.index,
                    "capacity_bytes": gpu.capacity_bytes,
                    "others_bytes": gpu.used_bytes,
                    "owner": gpu.owner,
                    "flexpipe_bytes": max(0.0, ours),
                    "free_until_s": gpu.free_until_s,
                    "instance": None if here is None else here[0].key,
                    "stage": None if here is None else here[1],
                    **({"instances": [i.key for i, _ in tenants]} if len(tenants) > 1 else {}),
                }
            )
        ids = [g.id for g in node.gpus]
        links = [
            {"gpus": [a, b], **_link(cluster.link_between(a, b))}
            for i, a in enumerate(ids)
            for b in ids[i + 1 :]
        ]
        nodes.append(
            {"name": node.name, "network": _link(node.network.spec), "gpus": gpus, "links": links}
        )
    names = [n.name for n in cluster.nodes]
    node_links = [
        {"nodes": [a, b], **_link(cluster.network_between(a, b))}
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    ]
    return {
        "cluster": cluster.name,
        "time_scale": time_scale,
        "nodes": nodes,
        "node_links": node_links,
        "instances": [_instance(i) for i in instances],
        "models": [
            {
                "name": d.name,
                "slo": {"ttft_p99_s": d.slo.ttft_p99_s, "tpot_p99_s": d.slo.tpot_p99_s},
            }
            for d in demands
        ],
    }


def _names(key: str, p: PlannedInstance) -> tuple[str, str, str, str, tuple[tuple[str, ...], ...]]:
    return key, p.name, p.model, p.gear.key(), p.stages


class UiApi:
    """The two routes, on the controller's admin app (its `_auth` guards them)."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    def add_routes(self, app: App) -> None:
        app.add_route("GET", TOPOLOGY_PATH, self.topology)
        app.add_route("GET", SHIFTS_PATH, self.shifts)

    async def topology(self, req: Request) -> Response:
        authorize(req, self.c.cfg.token)
        instances = [
            UiInstance(*_names(i.key, i.planned), i.url, i.state, i.planned.gpu_memory_fraction)
            for i in self.c.running.values()
        ]
        doc = topology_doc(self.c.cluster, instances, self.c.cfg.demands, self.c.cfg.time_scale)
        # the gateway replicas the controller drives (None: one, without a fleet)
        doc["gateways"] = fleet_view(self.c.gateway)
        return json_response(doc)

    async def shifts(self, req: Request) -> Response:
        authorize(req, self.c.cfg.token)
        raw = (req.query_params().get("limit") or ["100"])[0]
        try:
            limit = int(raw)
        except ValueError:
            raise HttpError(400, f"limit must be an integer, got {raw!r}", param="limit") from None
        if not 1 <= limit <= _MAX_SHIFTS:
            raise HttpError(400, f"limit must be 1 to {_MAX_SHIFTS}", param="limit")
        every = (req.query_params().get("all") or ["0"])[0]
        if every not in ("0", "1"):
            raise HttpError(400, f"all must be 0 or 1, got {every!r}", param="all")
        # one store may hold the logs of several deployments (other ports, earlier tests)
        mine = None if every == "1" else self.c.deployment
        log = self.c.shift_log
        entries = (
            [] if log is None else log.entries(kinds=_SHOWN_KINDS, limit=limit, deployment=mine)
        )
        return json_response(
            {"deployment": self.c.deployment, "entries": [e.to_dict() for e in entries]}
        )
