"""The cluster as a Ray cluster has it: its live nodes and their GPUs, the GPUs that other Ray
work holds, laid over an optional cluster file for what Ray does not know (links).

- Nodes: every live Ray node with GPUs. Its name is its `flexpipe/node` label (`ray start
  --labels flexpipe/node=node1`, how a node meets its entry in the cluster file), else
  `ray-` and the first 8 hex digits of its Ray node id.
- GPU type: the `flexpipe/gpu-type` label (a catalog name), else Ray's accelerator type (the
  `ray.io/accelerator-type` label or an `accelerator_type:X` resource) through `RAY_TYPES`.
  A GPU the cluster file lists keeps the file's (more precise) type, id and tenants.
- Memory: the catalog's (flexpipe/hardware.py); where a node has an NVIDIA driver, NVML on
  that node says how much others hold (`nvml=True`, one zero-resource task per node).
- Busy: GPUs held by other Ray work (total GPUs - available - those of our own placement
  groups) look fully used by `other Ray work`, from the node's highest index down. Our own
  placement groups are named `flexpipe:<deployment>:<instance>:<gpu ids>` (`pg_name`), so
  every controller, also one restarted after a crash, tells its own GPUs from others'.
- Links: the cluster file's (Ray does not know NVLink topology); GPUs it does not mention talk
  through the CPU, nodes over the default network.

The result goes through `parse_cluster`, the validation a file gets. `cluster_doc` is pure
(exact tests); `read_ray_cluster` asks Ray.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flexpipe.cluster.errors import ClusterError
from flexpipe.cluster.model import Cluster
from flexpipe.cluster.parse import parse_cluster
from flexpipe.hardware import GPUS, GiB, gpu_spec
from flexpipe.ray_client import RayNode, RayPlacementGroup

__all__ = [
    "GPU_TYPE_LABEL",
    "NODE_LABEL",
    "OTHER_RAY_WORK",
    "RAY_TYPES",
    "catalog_type",
    "cluster_doc",
    "node_name",
    "our_gpus",
    "pg_name",
    "pg_prefix",
    "read_ray_cluster",
]

NODE_LABEL = "flexpipe/node"
GPU_TYPE_LABEL = "flexpipe/gpu-type"
OTHER_RAY_WORK = "other Ray work"
_RAY_TYPE_LABEL = "ray.io/accelerator-type"
_RAY_TYPE_RESOURCE = "accelerator_type:"

# Ray's accelerator types (ray.util.accelerators) -> catalog names. Ray does not tell SXM from
# PCIe, nor (for a bare "A100") 40 from 80 GB: the board form most clusters run is assumed;
# the `flexpipe/gpu-type` label or the cluster file says otherwise.
RAY_TYPES: dict[str, str] = {
    "A100": "A100-80G-SXM",
    "A100-80G": "A100-80G-SXM",
    "A100-40G": "A100-40G-SXM",
    "H100": "H100-80G-SXM",
    "H200": "H200-141G",
    "H20": "H20-96G",
    "B200": "B200-180G",
    "V100": "V100-32G",
    "GeForce-RTX-4090": "RTX-4090",
    "AMD-Instinct-MI300X-OAM": "MI300X",
}


def catalog_type(ray_type: str) -> str:
    """The catalog GPU type of a Ray accelerator type (`A100`, `L40S`) or a catalog name."""
    name = RAY_TYPES.get(ray_type, ray_type)
    try:
        return gpu_spec(name).name
    except Exception:
        raise ClusterError(
            [
                f"Ray accelerator type {ray_type!r} is not in flexpipe's catalog "
                f"({', '.join(sorted(GPUS))}); label the node with "
                f"{GPU_TYPE_LABEL}=<catalog name> or list its GPUs in the cluster file"
            ]
        ) from None


def node_name(node: RayNode) -> str:
    """The node's name in the cluster: its `flexpipe/node` label, else `ray-<id prefix>`."""
    return node.labels.get(NODE_LABEL) or f"ray-{node.node_id[:8]}"


def ray_gpu_type(node: RayNode) -> str | None:
    """The node's GPU type as Ray (or the admin's label) says, in catalog terms."""
    if GPU_TYPE_LABEL in node.labels:
        return catalog_type(node.labels[GPU_TYPE_LABEL])
    if node.labels.get(_RAY_TYPE_LABEL):
        return catalog_type(node.labels[_RAY_TYPE_LABEL])
    for resource in node.total:
        if resource.startswith(_RAY_TYPE_RESOURCE):
            return catalog_type(resource[len(_RAY_TYPE_RESOURCE) :])
    return None


def pg_prefix(deployment: str) -> str:
    return f"flexpipe:{deployment}:"


def pg_name(deployment: str, instance: str, gpu_ids: Sequence[str]) -> str:
    """The name of an instance's placement group: whose it is and which GPUs it holds."""
    return f"{pg_prefix(deployment)}{instance}:{'+'.join(gpu_ids)}"


def our_gpus(pgs: Iterable[RayPlacementGroup], deployment: str) -> dict[str, set[str]]:
    """Node id -> the GPU ids our live placement groups hold there (from their names)."""
    prefix = pg_prefix(deployment)
    out: dict[str, set[str]] = {}
    for pg in pgs:
        if not pg.name.startswith(prefix) or pg.state == "REMOVED":
            continue
        gpu_ids = pg.name.rsplit(":", 1)[-1].split("+")
        for gpu_id, node_id in zip(gpu_ids, pg.bundle_nodes, strict=False):
            if node_id is not None:
                out.setdefault(node_id, set()).add(gpu_id)
    return out


def _gpu_count(node: RayNode, key: str = "GPU") -> float:
    return float(node.total.get(key, 0.0))


def cluster_doc(
    nodes: Sequence[RayNode],
    pgs: Sequence[RayPlacementGroup],
    overlay: Cluster | None = None,
    *,
    deployment: str = "default",
    name: str = "ray",
    nvml_used_bytes: Mapping[str, Mapping[int, float]] | None = None,
) -> dict[str, Any]:
    """The Ray cluster as a cluster-file document (validated by `parse_cluster`).

    `nvml_used_bytes`: node id -> GPU index -> bytes used, from NVML on that node (nodes
    without a driver are absent)."""
    base: dict[str, Any] = overlay.to_doc() if overlay is not None else {"name": name}
    by_name = {n["name"]: n for n in base.get("nodes", [])}
    ours = our_gpus(pgs, deployment)
    nvml = nvml_used_bytes or {}
    out_nodes: list[dict[str, Any]] = []
    seen: set[str] = set()
    for node in nodes:
        num_gpus = math.floor(_gpu_count(node) + 1e-9)
        if not node.alive or num_gpus == 0:
            continue
        label = node_name(node)
        if label in seen:
            raise ClusterError(
                [f"ray: two live nodes are named {label!r} (label {NODE_LABEL}); names are unique"]
            )
        seen.add(label)
        file_node = by_name.get(label, {})
        file_gpus = {int(g["index"]): g for g in file_node.get("gpus", [])}
        ray_type = ray_gpu_type(node)
        gpus: list[dict[str, Any]] = []
        for index in range(num_gpus):
            if index in file_gpus:
                gpu = dict(file_gpus[index])
            elif ray_type is None:
                raise ClusterError(
                    [
                        f"ray: node {label!r} declares GPUs but no type: start it with "
                        f"--resources '{{\"accelerator_type:A100\": N}}' or label it "
                        f"{GPU_TYPE_LABEL}=<catalog name>, or list its GPUs in the cluster file"
                    ]
                )
            else:
                gpu = {"id": f"{label}/gpu{index}", "type": ray_type, "index": index}
            used = nvml.get(node.node_id, {}).get(index)
            if (
                used is not None
                and used >= 1 * GiB
                and gpu.get("id") not in ours.get(node.node_id, set())
            ):
                gpu["used_gib"] = max(float(gpu.get("used_gib", 0.0)), round(used / GiB, 2))
                gpu.setdefault("owner", "other processes (NVML)")
            gpus.append(gpu)
        mine = ours.get(node.node_id, set())
        held = _gpu_count(node) - float(node.available.get("GPU", 0.0))
        busy = max(0, round(held) - len(mine & {str(g["id"]) for g in gpus}))
        for gpu in reversed(gpus):
            if busy == 0:
                break
            if gpu["id"] in mine:
                continue
            gpu["used_gib"] = gpu_spec(str(gpu["type"])).memory_bytes / GiB
            gpu["owner"] = OTHER_RAY_WORK
            gpu.pop("free_until_s", None)
            busy -= 1
        present = {str(g["id"]) for g in gpus}
        doc: dict[str, Any] = {
            "name": label,
            "note": f"Ray node {node.node_id[:16]} at {node.ip}",
            "gpus": gpus,
        }
        if "network" in file_node:
            doc["network"] = file_node["network"]
        links = [
            {**lk, "gpus": [g for g in lk["gpus"] if g in present]}
            for lk in file_node.get("links", [])
        ]
        links = [lk for lk in links if len(lk["gpus"]) >= 2]
        if links:
            doc["links"] = links
        out_nodes.append(doc)
    if not out_nodes:
        raise ClusterError(["ray: no live node of the Ray cluster has a GPU (num_gpus)"])
    # the file's order, then the nodes it does not name by name: the same order on every read
    order = {name: i for i, name in enumerate(by_name)}
    out_nodes.sort(key=lambda n: (order.get(n["name"], len(order)), n["name"]))
    names = {n["name"] for n in out_nodes}
    result: dict[str, Any] = {
        "name": base.get("name", name),
        "description": f"{len(out_nodes)} Ray node(s) with GPUs"
        + (f", links from {overlay.source}" if overlay is not None else ""),
        "defaults": base.get("defaults", {}),
        "nodes": out_nodes,
    }
    node_links = [p for p in base.get("node_links", []) if set(p["nodes"]) <= names]
    if node_links:
        result["node_links"] = node_links
    return result


def read_ray_cluster(
    address: str,
    overlay: Cluster | None = None,
    *,
    deployment: str = "default",
    nvml: bool = True,
    nvml_timeout_s: float = 20.0,
) -> Cluster:
    """Ask the Ray cluster at `address` (connecting this process once) for its inventory."""
    from flexpipe import ray_client

    ray_client.connect(address)
    nodes = ray_client.nodes()
    pgs = ray_client.placement_groups()
    used: dict[str, dict[int, float]] = {}
    if nvml:
        gpu_nodes = [n.node_id for n in nodes if n.alive and _gpu_count(n) > 0]
        found = ray_client.run_on_nodes(gpu_nodes, _nvml_used_bytes, nvml_timeout_s)
        used = {node_id: u for node_id, u in found.items() if u is not None}
    doc = cluster_doc(nodes, pgs, overlay, deployment=deployment, nvml_used_bytes=used)
    return parse_cluster(doc, f"ray://{address}")


def _nvml_used_bytes() -> dict[int, float] | None:
    """On a node: GPU index -> bytes in use, or None without an NVIDIA driver."""
    from flexpipe.cluster.nvml import DiscoverError, read_inventory

    try:
        inv = read_inventory()
    except DiscoverError:
        return None
    return {g.index: g.used_bytes for g in inv.gpus}
