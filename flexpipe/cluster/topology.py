"""The topology rules of a cluster: which link two GPUs or two nodes talk over, and what a
placement over concrete GPUs looks like to the performance model.

Effective links are catalog `LinkSpec`s from flexpipe.hardware with any measured bandwidth
applied: nothing here invents a link speed. Defaults: two GPUs of one node with no declared
group between them talk "through the CPU" (`cpu`); two nodes with no declared `node_links`
entry talk over the slower of their two `network`s; a node without `network` uses the
cluster's default network (`eth25`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from flexpipe.cluster.errors import ClusterError, unknown
from flexpipe.gears.gear import GearError, Placement, Stage, even_layer_split
from flexpipe.hardware import GB, LinkSpec, link_spec

if TYPE_CHECKING:
    from flexpipe.cluster.model import Cluster, GpuGroupLink, Node

__all__ = [
    "DEFAULT_INTRA_NODE_LINK",
    "DEFAULT_NETWORK",
    "effective_link",
    "fast_domains",
    "gpu_pair_links",
    "pair",
    "placement_on",
    "slower",
    "slowest_link",
    "sub_cluster",
]

# GPUs of one node with no declared group link between them: PCIe through the CPU (the
# safe assumption: `nvidia-smi topo -m` shows SYS/NODE unless a switch or NVLink is present).
DEFAULT_INTRA_NODE_LINK = "cpu"
# Nodes without a declared network: plain 25 GbE, the slowest common data-center NIC.
DEFAULT_NETWORK = "eth25"


def effective_link(
    name: str, measured_gb_per_s: float | None, measured_latency_us: float | None = None
) -> LinkSpec:
    """The catalog link with a measured bandwidth and latency (if any) in place of the
    datasheet's, marked as measured (the performance model prefers them to a calibrated link
    class)."""
    spec = link_spec(name)
    if measured_gb_per_s is not None:
        spec = replace(
            spec,
            bandwidth_bytes_per_s=measured_gb_per_s * GB,
            description=f"{spec.description}, measured {measured_gb_per_s:g} GB/s",
            bandwidth_measured=True,
        )
    if measured_latency_us is not None:
        spec = replace(
            spec,
            latency_s=measured_latency_us * 1e-6,
            description=f"{spec.description}, measured {measured_latency_us:g} us",
            latency_measured=True,
        )
    return spec


def pair(a: str, b: str) -> tuple[str, str]:
    """The order-free key of a pair of GPUs or nodes."""
    return (a, b) if a <= b else (b, a)


def gpu_pair_links(nodes: Iterable[Node]) -> dict[tuple[str, str], LinkSpec]:
    """(gpu a, gpu b) -> effective link, for every pair inside a declared group link. A pair in
    several groups (an NVLink bridge under a PCIe switch) uses the fastest of them."""
    out: dict[tuple[str, str], LinkSpec] = {}
    for node in nodes:
        for group in node.links:
            spec = _group_spec(group)
            for i, a in enumerate(group.gpus):
                for b in group.gpus[i + 1 :]:
                    key = pair(a, b)
                    old = out.get(key)
                    if old is None or spec.bandwidth_bytes_per_s > old.bandwidth_bytes_per_s:
                        out[key] = spec
    return out


def _group_spec(group: GpuGroupLink) -> LinkSpec:
    return effective_link(group.link, group.measured_gb_per_s, group.measured_latency_us)


def slower(a: LinkSpec, b: LinkSpec) -> LinkSpec:
    """Two nodes with no declared link between them talk over the slower of their networks."""
    return a if a.bandwidth_bytes_per_s <= b.bandwidth_bytes_per_s else b


def slowest_link(cluster: Cluster, gpu_ids: Iterable[str]) -> LinkSpec:
    """The slowest effective link between any two of `gpu_ids` (at least two GPUs): what a
    ring all-reduce over them is paced by."""
    ids = list(gpu_ids)
    if len(ids) < 2:
        raise ClusterError([f"{cluster.source}: a link needs two GPUs; got {ids}"])
    slowest: LinkSpec | None = None
    for i, a in enumerate(ids):
        for b in ids[i + 1 :]:
            spec = cluster.link_between(a, b)
            if slowest is None or spec.bandwidth_bytes_per_s < slowest.bandwidth_bytes_per_s:
                slowest = spec
    assert slowest is not None
    return slowest


def fast_domains(cluster: Cluster, min_bandwidth_bytes_per_s: float) -> list[tuple[str, ...]]:
    """Split the GPUs into groups joined pairwise by links at least this fast: where tensor
    parallelism may go.

    Every GPU is in exactly one group (a GPU with no fast peer is a group of one). Groups are
    built greedily in file order (a GPU joins the first group whose members it all reaches
    fast), which finds the NVLink islands / NVSwitch nodes exactly; with partial meshes it is
    a good, not an optimal, partition. Largest groups first, then file order. Topology only:
    fully used GPUs are in their groups too (filter on `free_bytes`).
    """
    threshold = min_bandwidth_bytes_per_s
    node_names = [n.name for n in cluster.nodes]
    # node -> later nodes reached at least this fast (usually none: networks are slow)
    fast_peers = {
        a: [
            b
            for b in node_names[i + 1 :]
            if cluster.network_between(a, b).bandwidth_bytes_per_s >= threshold
        ]
        for i, a in enumerate(node_names)
    }
    assigned: set[str] = set()
    groups: list[list[str]] = []
    for node in cluster.nodes:
        for gpu in node.gpus:
            if gpu.id in assigned:
                continue
            group = [gpu.id]
            assigned.add(gpu.id)
            candidates = [g.id for g in node.gpus] + [
                g.id for peer in fast_peers[node.name] for g in cluster.node(peer).gpus
            ]
            for cand in candidates:
                if cand in assigned:
                    continue
                if all(
                    cluster.link_between(cand, m).bandwidth_bytes_per_s >= threshold for m in group
                ):
                    group.append(cand)
                    assigned.add(cand)
            groups.append(group)
    order = {gid: i for i, gid in enumerate(cluster.gpu_ids)}
    groups.sort(key=lambda g: (-len(g), order[g[0]]))
    return [tuple(g) for g in groups]


def placement_on(
    cluster: Cluster,
    gpu_ids: Sequence[Sequence[str]],
    num_layers: int,
    layers_per_stage: Sequence[int] | None = None,
) -> Placement:
    """A placement over concrete GPUs: `gpu_ids` lists the pipeline stages in order, each the
    ids of its tensor-parallel GPUs. Each stage's TP link is the slowest effective link inside
    it; the hand-off between consecutive stages runs over the slowest link between
    corresponding TP ranks (rank r of stage i sends to rank r of stage i+1)."""
    stages_ids = [list(s) for s in gpu_ids]
    flat = [g for s in stages_ids for g in s]
    if not stages_ids or any(not s for s in stages_ids):
        raise GearError("a placement needs at least one stage, each with at least one GPU")
    duplicates = sorted({g for g in flat if flat.count(g) > 1})
    if duplicates:
        raise GearError(f"GPUs used twice in one placement: {', '.join(duplicates)}")
    known = set(cluster.gpu_ids)
    missing = [g for g in flat if g not in known]
    if missing:
        ids = {g: None for g in cluster.gpu_ids}
        raise ClusterError([f"{cluster.source}: {unknown('GPU', g, ids)}" for g in missing])
    pp = len(stages_ids)
    layers = tuple(layers_per_stage) if layers_per_stage else even_layer_split(num_layers, pp)
    if len(layers) != pp or sum(layers) != num_layers:
        raise GearError(f"layers_per_stage {layers} must give {pp} stages summing to {num_layers}")
    stages = tuple(
        Stage(
            tuple(cluster.slot(g) for g in ids),
            slowest_link(cluster, ids) if len(ids) > 1 else None,
            layers[i],
        )
        for i, ids in enumerate(stages_ids)
    )
    pp_links = []
    for prev, nxt in itertools.pairwise(stages_ids):
        pairs = list(zip(prev, nxt, strict=False))
        pp_links.append(
            min(
                (cluster.link_between(a, b) for a, b in pairs),
                key=lambda s: s.bandwidth_bytes_per_s,
            )
        )
    return Placement(stages, tuple(pp_links))


def sub_cluster(cluster: Cluster, gpu_ids: Iterable[str]) -> Cluster:
    """Only these GPUs, their nodes and the links among them: all an engine needs to know of
    the cluster to stand for its placement (a worker node has no cluster file)."""
    keep = set(gpu_ids)
    for gpu_id in keep:
        cluster.gpu(gpu_id)  # unknown ids: ClusterError
    nodes = []
    for node in cluster.nodes:
        gpus = tuple(g for g in node.gpus if g.id in keep)
        if not gpus:
            continue
        links = tuple(
            replace(lk, gpus=members)
            for lk in node.links
            if len(members := tuple(g for g in lk.gpus if g in keep)) >= 2
        )
        nodes.append(replace(node, gpus=gpus, links=links))
    names = {n.name for n in nodes}
    node_links = tuple(p for p in cluster.node_links if set(p.nodes) <= names)
    return replace(cluster, nodes=tuple(nodes), node_links=node_links)
