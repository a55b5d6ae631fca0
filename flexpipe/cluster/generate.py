"""A generator of large, fragmented clusters for the planner and the simulator.

`generate_cluster(128, 8, seed=0)` gives 128 nodes of 8 GPUs drawn from a mix of node kinds
(HGX A100/H100/H200 boards on NVSwitch, PCIe boxes of L40S/L4/A10G/RTX-4090, PCIe A100s and
V100s in NVLink pairs), each GPU free, partly or fully held by another tenant, or free only
for a while, on InfiniBand/RoCE/Ethernet networks, some of them measured below their rating.
Same arguments, same cluster: everything random comes from `random.Random(seed)`.

The output goes through `parse_cluster`, the same validation a file gets; the CLI writes it
as YAML (`flexpipe cluster generate --nodes 128 --gpus-per-node 8 --seed 0 -o big.yaml`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from flexpipe.cluster.errors import ClusterError
from flexpipe.cluster.model import Cluster
from flexpipe.cluster.parse import parse_cluster
from flexpipe.hardware import GB, gpu_spec, link_spec

__all__ = ["NODE_KINDS", "NodeKind", "generate_cluster"]


@dataclass(frozen=True, slots=True)
class NodeKind:
    """One kind of machine: its GPU, how its GPUs are wired and the NICs it comes with.

    topology: "switch": every GPU on one NVSwitch; "pairs": NVLink-bridged pairs under PCIe
    switches of half the node; "pcie": PCIe switches of half the node each; "cpu": no P2P
    (everything through the CPU, the default intra-node link).
    """

    name: str
    gpu_type: str
    topology: str
    link: str | None  # the NVSwitch / NVLink / PCIe link of the topology
    networks: tuple[str, ...]  # NICs it is found with; one is drawn per node
    weight: float  # relative frequency in the mix


NODE_KINDS: tuple[NodeKind, ...] = (
    NodeKind("hgx-h100", "H100-80G-SXM", "switch", "nvswitch-h100", ("ib400", "roce200"), 3),
    NodeKind("hgx-h200", "H200-141G", "switch", "nvswitch-h100", ("ib400",), 1),
    NodeKind("hgx-a100", "A100-80G-SXM", "switch", "nvswitch-a100", ("ib200", "ib400"), 3),
    NodeKind("hgx-a100-40", "A100-40G-SXM", "switch", "nvswitch-a100", ("ib200", "roce100"), 1),
    NodeKind("pcie-a100", "A100-80G-PCIe", "pairs", "nvlink3", ("roce200", "eth100"), 2),
    NodeKind("pcie-h100", "H100-80G-PCIe", "pcie", "pcie5", ("roce200", "eth100"), 1),
    NodeKind("l40s", "L40S", "pcie", "pcie4", ("roce100", "eth100", "eth25"), 2),
    NodeKind("l4", "L4", "cpu", None, ("eth25", "eth100"), 2),
    NodeKind("a10g", "A10G", "cpu", None, ("eth25",), 1.5),
    # DGX-1's hybrid cube mesh, simplified to NVLink pairs (the planner only uses pairs).
    NodeKind("v100", "V100-32G", "pairs", "nvlink2", ("eth100", "ib200"), 1),
    # Consumer cards: P2P disabled by the driver, so everything goes through the CPU.
    NodeKind("rtx4090", "RTX-4090", "cpu", None, ("eth25",), 1),
)

_TENANTS = ("tenant-a", "tenant-b", "tenant-c", "tenant-d", "tenant-e", "tenant-f")
# Probability that a GPU is held by another tenant, drawn per node: some nodes are nearly
# free, some nearly full. Fragmentation comes from the middle ones.
_NODE_BUSY_LEVELS = (0.05, 0.3, 0.5, 0.7, 0.95)
_FULLY_USED_SHARE = 0.6  # of the held GPUs, this share is held whole
_LEASED_SHARE = 0.2  # of the free GPUs, this share is free only until free_until_s
_MEASURED_NETWORK_SHARE = 0.15  # nodes whose NIC measured below its rating
_MEASURED_LINK_SHARE = 0.1  # intra-node groups measured below their rating


def _halves(indexes: list[int]) -> list[list[int]]:
    mid = (len(indexes) + 1) // 2
    return [h for h in (indexes[:mid], indexes[mid:]) if len(h) >= 2]


def _measured(rng: random.Random, link: str, low: float, high: float) -> float:
    """A measured bandwidth in GB/s: a fraction of the catalog figure, rounded to 0.1."""
    nominal = link_spec(link).bandwidth_bytes_per_s / GB
    return max(0.1, round(nominal * rng.uniform(low, high), 1))


def _link_doc(rng: random.Random, gpus: list[int], link: str) -> dict[str, Any]:
    doc: dict[str, Any] = {"gpus": gpus, "link": link}
    if rng.random() < _MEASURED_LINK_SHARE:
        doc["measured_gb_per_s"] = _measured(rng, link, 0.4, 0.95)
    return doc


def _node_doc(rng: random.Random, kind: NodeKind, name: str, gpus_per_node: int) -> dict[str, Any]:
    capacity_gib = gpu_spec(kind.gpu_type).memory_bytes / 2**30
    busy = rng.choice(_NODE_BUSY_LEVELS)
    gpus: list[dict[str, Any]] = []
    for index in range(gpus_per_node):
        gpu: dict[str, Any] = {"id": f"{name}/gpu{index}", "type": kind.gpu_type, "index": index}
        if rng.random() < busy:
            gpu["owner"] = rng.choice(_TENANTS)
            if rng.random() < _FULLY_USED_SHARE:
                gpu["used_gib"] = capacity_gib
            else:  # partly used, in steps of 0.5 GiB
                gpu["used_gib"] = round(capacity_gib * rng.uniform(0.1, 0.9) * 2) / 2
        elif rng.random() < _LEASED_SHARE:
            gpu["free_until_s"] = float(rng.randrange(5, 240) * 60)
        gpus.append(gpu)

    indexes = list(range(gpus_per_node))
    links: list[dict[str, Any]] = []
    if kind.link is not None and gpus_per_node >= 2:
        if kind.topology == "switch":
            links.append(_link_doc(rng, indexes, kind.link))
        elif kind.topology == "pcie":
            links.extend(_link_doc(rng, half, kind.link) for half in _halves(indexes))
        elif kind.topology == "pairs":
            links.extend({"gpus": half, "link": "pcie4"} for half in _halves(indexes))
            links.extend(
                _link_doc(rng, [i, i + 1], kind.link) for i in range(0, gpus_per_node - 1, 2)
            )

    network_name = rng.choice(kind.networks)
    network: str | dict[str, Any] = network_name
    if rng.random() < _MEASURED_NETWORK_SHARE:
        network = {
            "link": network_name,
            "measured_gb_per_s": _measured(rng, network_name, 0.5, 0.95),
        }
    doc: dict[str, Any] = {"name": name, "note": kind.name, "network": network, "gpus": gpus}
    if links:
        doc["links"] = links
    return doc


def generate_cluster(
    num_nodes: int,
    gpus_per_node: int,
    seed: int,
    *,
    name: str | None = None,
    kinds: tuple[NodeKind, ...] = NODE_KINDS,
) -> Cluster:
    """A random fragmented cluster; deterministic for a given seed and arguments."""
    if num_nodes < 1 or gpus_per_node < 1:
        raise ClusterError(
            [
                f"generate: need at least one node and one GPU per node (got {num_nodes} x "
                f"{gpus_per_node})"
            ]
        )
    rng = random.Random(seed)
    weights = [k.weight for k in kinds]
    chosen = rng.choices(kinds, weights=weights, k=num_nodes)
    width = max(3, len(str(num_nodes - 1)))
    nodes = [
        _node_doc(rng, kind, f"{kind.name}-{i:0{width}d}", gpus_per_node)
        for i, kind in enumerate(chosen)
    ]
    # A few congested node pairs (across an oversubscribed uplink): the slower NIC's class,
    # measured at 30-70% of it.
    node_links: list[dict[str, Any]] = []
    seen: set[tuple[int, int]] = set()
    for _ in range(num_nodes // 16 if num_nodes >= 2 else 0):
        a, b = sorted(rng.sample(range(num_nodes), 2))
        if (a, b) in seen:
            continue
        seen.add((a, b))
        link = min(
            (_network_name(nodes[a]), _network_name(nodes[b])),
            key=lambda n: link_spec(n).bandwidth_bytes_per_s,
        )
        node_links.append(
            {
                "nodes": [nodes[a]["name"], nodes[b]["name"]],
                "link": link,
                "measured_gb_per_s": _measured(rng, link, 0.3, 0.7),
            }
        )
    label = name or f"generated-{num_nodes}x{gpus_per_node}-seed{seed}"
    doc: dict[str, Any] = {
        "name": label,
        "description": (
            f"generate_cluster(num_nodes={num_nodes}, gpus_per_node={gpus_per_node}, seed={seed})"
        ),
        "nodes": nodes,
    }
    if node_links:
        doc["node_links"] = node_links
    return parse_cluster(doc, source=f"<{label}>")


def _network_name(node: dict[str, Any]) -> str:
    network = node["network"]
    return str(network["link"] if isinstance(network, dict) else network)
