"""The cluster model: nodes, their GPUs as they really are (partly used by other tenants,
free only for a while) and the links between them. Immutable dataclasses with O(1) lookups.

Sources of a `Cluster` (each gives the same type): a cluster file (`parse`, format in
docs/cluster-file.md), the generator (`generate`), NVML on this machine (`nvml`) and a Ray
cluster (`ray_inventory`). Which link two GPUs talk over is decided in `topology`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from flexpipe.cluster.errors import ClusterError, exceeds, unknown
from flexpipe.cluster.topology import (
    DEFAULT_INTRA_NODE_LINK,
    effective_link,
    fast_domains,
    gpu_pair_links,
    pair,
    slower,
    slowest_link,
)
from flexpipe.gears.gear import GpuSlot
from flexpipe.hardware import (
    DEFAULT_FAST_LINK_BYTES_PER_S,
    DEFAULT_HOST_RAM_PER_GPU_MEMORY,
    DEFAULT_LOCAL_NVME_BYTES_PER_S,
    DEFAULT_NETWORK_STORAGE_BYTES_PER_S,
    GB,
    GiB,
    GpuSpec,
    LinkSpec,
    gpu_spec,
    link_spec,
)

__all__ = [
    "Cluster",
    "Gpu",
    "GpuGroupLink",
    "NetworkLink",
    "Node",
    "NodePairLink",
]


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU as the cluster has it now."""

    id: str  # unique across the cluster
    node: str
    type: str  # canonical catalog name (flexpipe.hardware.GPUS)
    index: int  # index within the node (CUDA_VISIBLE_DEVICES)
    used_bytes: float = 0.0  # held by other tenants
    free_until_s: float | None = None  # free for us until then; None: indefinitely
    owner: str | None = None  # who holds the used memory
    note: str | None = None

    @property
    def spec(self) -> GpuSpec:
        return gpu_spec(self.type)

    @property
    def capacity_bytes(self) -> float:
        return self.spec.memory_bytes

    @property
    def free_bytes(self) -> float:
        return max(0.0, self.capacity_bytes - self.used_bytes)


@dataclass(frozen=True, slots=True)
class GpuGroupLink:
    """GPUs of one node joined pairwise by one link class (an NVLink island, an NVSwitch, a
    PCIe switch). `measured_gb_per_s` (GB = 1e9 B, per GPU per direction) overrides the
    catalog bandwidth, `measured_latency_us` the catalog latency."""

    gpus: tuple[str, ...]
    link: str  # canonical catalog link name
    measured_gb_per_s: float | None = None
    measured_latency_us: float | None = None  # one-way, per hop (e.g. nccl-tests at 8 B)

    @property
    def spec(self) -> LinkSpec:
        return effective_link(self.link, self.measured_gb_per_s, self.measured_latency_us)


@dataclass(frozen=True, slots=True)
class NetworkLink:
    """A node's network (its NIC class), optionally with a measured bandwidth."""

    link: str  # canonical catalog link name
    measured_gb_per_s: float | None = None
    measured_latency_us: float | None = None  # one-way, per hop (e.g. nccl-tests at 8 B)

    @property
    def spec(self) -> LinkSpec:
        return effective_link(self.link, self.measured_gb_per_s, self.measured_latency_us)


@dataclass(frozen=True, slots=True)
class NodePairLink:
    """The network between two particular nodes, overriding their `network`s."""

    nodes: tuple[str, str]
    link: str
    measured_gb_per_s: float | None = None
    measured_latency_us: float | None = None  # one-way, per hop (e.g. nccl-tests at 8 B)

    @property
    def spec(self) -> LinkSpec:
        return effective_link(self.link, self.measured_gb_per_s, self.measured_latency_us)


@dataclass(frozen=True, slots=True)
class Node:
    """A node. Where its GPUs read weights from (docs/cluster-file.md, "Storage and host
    RAM"): `local_nvme_gb_per_s`, `network_storage_gb_per_s` (GB = 1e9 B, sequential read)
    and `host_ram_bytes` (for sleeping engines' weight copies); None: the catalog defaults."""

    name: str
    gpus: tuple[Gpu, ...]
    network: NetworkLink
    links: tuple[GpuGroupLink, ...] = ()
    note: str | None = None
    local_nvme_gb_per_s: float | None = None
    network_storage_gb_per_s: float | None = None
    host_ram_bytes: float | None = None

    @property
    def local_nvme_bytes_per_s(self) -> float:
        gb = self.local_nvme_gb_per_s
        return DEFAULT_LOCAL_NVME_BYTES_PER_S if gb is None else gb * GB

    @property
    def network_storage_bytes_per_s(self) -> float:
        gb = self.network_storage_gb_per_s
        return DEFAULT_NETWORK_STORAGE_BYTES_PER_S if gb is None else gb * GB

    @property
    def host_ram_capacity_bytes(self) -> float:
        """Host RAM as declared, or DEFAULT_HOST_RAM_PER_GPU_MEMORY x the GPUs' memory."""
        if self.host_ram_bytes is not None:
            return self.host_ram_bytes
        gpu_bytes = sum(gpu_spec(g.type).memory_bytes for g in self.gpus)
        return DEFAULT_HOST_RAM_PER_GPU_MEMORY * gpu_bytes


@dataclass(frozen=True)
class Cluster:
    """A validated cluster. Immutable: `with_used` / `with_gpu` return changed copies.

    Built by `parse_cluster` / `load_cluster` (which validate the document and report every
    mistake); constructing one directly only checks what the lookups need.
    """

    name: str
    nodes: tuple[Node, ...]
    node_links: tuple[NodePairLink, ...] = ()
    default_intra_node_link: str = DEFAULT_INTRA_NODE_LINK
    description: str | None = None
    source: str = field(default="<cluster>", compare=False)
    # Lookup tables, built once in __post_init__ (a 1,024-GPU cluster answers link queries in
    # O(1)): gpu id -> Gpu, node name -> Node, (gpu a, gpu b) -> effective link for declared
    # intra-node pairs, (node a, node b) -> effective network link for declared pairs.
    _gpus: dict[str, Gpu] = field(init=False, repr=False, compare=False)
    _gpu_tuple: tuple[Gpu, ...] = field(init=False, repr=False, compare=False)
    _nodes: dict[str, Node] = field(init=False, repr=False, compare=False)
    _gpu_pairs: dict[tuple[str, str], LinkSpec] = field(init=False, repr=False, compare=False)
    _node_pairs: dict[tuple[str, str], LinkSpec] = field(init=False, repr=False, compare=False)
    _intra_default: LinkSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        gpus: dict[str, Gpu] = {}
        nodes: dict[str, Node] = {}
        for node in self.nodes:
            if node.name in nodes:
                raise ClusterError([f"{self.source}: duplicate node {node.name!r}"])
            nodes[node.name] = node
            for gpu in node.gpus:
                if gpu.id in gpus:
                    raise ClusterError([f"{self.source}: duplicate GPU id {gpu.id!r}"])
                gpus[gpu.id] = gpu
        gpu_pairs = gpu_pair_links(self.nodes)
        node_pairs = {pair(*p.nodes): p.spec for p in self.node_links}
        object.__setattr__(self, "_gpus", gpus)
        object.__setattr__(self, "_gpu_tuple", tuple(gpus.values()))
        object.__setattr__(self, "_nodes", nodes)
        object.__setattr__(self, "_gpu_pairs", gpu_pairs)
        object.__setattr__(self, "_node_pairs", node_pairs)
        object.__setattr__(self, "_intra_default", link_spec(self.default_intra_node_link))

    # -- lookups ---------------------------------------------------------------------------

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        """Every GPU, in file order (node by node)."""
        return self._gpu_tuple

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        return tuple(self._gpus)

    def gpu(self, gpu_id: str) -> Gpu:
        try:
            return self._gpus[gpu_id]
        except KeyError:
            raise ClusterError([f"{self.source}: {unknown('GPU', gpu_id, self._gpus)}"]) from None

    def node(self, name: str) -> Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise ClusterError([f"{self.source}: {unknown('node', name, self._nodes)}"]) from None

    def slot(self, gpu_id: str) -> GpuSlot:
        """The GPU as a placement sees it: its spec and the memory free for us."""
        gpu = self.gpu(gpu_id)
        return GpuSlot(gpu.id, gpu.spec, gpu.free_bytes)

    @property
    def total_free_bytes(self) -> float:
        return sum(g.free_bytes for g in self._gpus.values())

    def network_between(self, node_a: str, node_b: str) -> LinkSpec:
        """The effective network between two different nodes: a declared `node_links` entry,
        else the slower of the two nodes' networks."""
        declared = self._node_pairs.get(pair(node_a, node_b))
        if declared is not None:
            return declared
        return slower(self.node(node_a).network.spec, self.node(node_b).network.spec)

    def link_between(self, gpu_a: str, gpu_b: str) -> LinkSpec:
        """The effective link between two different GPUs (measured bandwidth applied)."""
        a, b = self.gpu(gpu_a), self.gpu(gpu_b)
        if a.id == b.id:
            raise ClusterError([f"{self.source}: no link between {gpu_a!r} and itself"])
        if a.node != b.node:
            return self.network_between(a.node, b.node)
        return self._gpu_pairs.get(pair(a.id, b.id), self._intra_default)

    def slowest_link(self, gpu_ids: Iterable[str]) -> LinkSpec:
        """The slowest effective link between any two of `gpu_ids` (at least two GPUs): what
        a ring all-reduce over them is paced by."""
        return slowest_link(self, gpu_ids)

    def fast_domains(
        self, min_bandwidth_bytes_per_s: float = DEFAULT_FAST_LINK_BYTES_PER_S
    ) -> list[tuple[str, ...]]:
        """GPUs grouped by links at least this fast: where tensor parallelism may go (see
        `flexpipe.cluster.topology.fast_domains`)."""
        return fast_domains(self, min_bandwidth_bytes_per_s)

    # -- changed copies -----------------------------------------------------------------------

    def with_gpu(self, gpu_id: str, **changes: Any) -> Cluster:
        """A copy with one GPU's fields changed (`used_bytes`, `free_until_s`, `owner`, ...)."""
        old = self.gpu(gpu_id)
        new = replace(old, **changes)
        if new.id != old.id or new.node != old.node:
            raise ClusterError([f"{self.source}: with_gpu cannot change a GPU's id or node"])
        _check_gpu(new, self.source)
        nodes = tuple(
            replace(n, gpus=tuple(new if g.id == gpu_id else g for g in n.gpus))
            if n.name == old.node
            else n
            for n in self.nodes
        )
        return replace(self, nodes=nodes)

    def with_used(self, gpu_id: str, used_bytes: float, owner: str | None = None) -> Cluster:
        """A copy where `gpu_id` has `used_bytes` held by others (0: its tenant left)."""
        return self.with_gpu(gpu_id, used_bytes=float(used_bytes), owner=owner)

    # -- serialisation ------------------------------------------------------------------------

    def to_doc(self) -> dict[str, Any]:
        """A plain dict in the file format; `parse_cluster(c.to_doc())` equals `c`."""
        doc: dict[str, Any] = {"name": self.name}
        if self.description:
            doc["description"] = self.description
        doc["defaults"] = {"intra_node_link": self.default_intra_node_link}
        nodes = []
        for node in self.nodes:
            n: dict[str, Any] = {"name": node.name}
            if node.note:
                n["note"] = node.note
            n["network"] = _link_doc(
                node.network.link,
                node.network.measured_gb_per_s,
                latency_us=node.network.measured_latency_us,
            )
            gpus = []
            for g in node.gpus:
                gd: dict[str, Any] = {"id": g.id, "type": g.type, "index": g.index}
                if g.used_bytes:
                    gd["used_gib"] = g.used_bytes / GiB  # exact: division by a power of two
                if g.free_until_s is not None:
                    gd["free_until_s"] = g.free_until_s
                if g.owner is not None:
                    gd["owner"] = g.owner
                if g.note is not None:
                    gd["note"] = g.note
                gpus.append(gd)
            n["gpus"] = gpus
            if node.local_nvme_gb_per_s is not None:
                n["local_nvme_gb_per_s"] = node.local_nvme_gb_per_s
            if node.network_storage_gb_per_s is not None:
                n["network_storage_gb_per_s"] = node.network_storage_gb_per_s
            if node.host_ram_bytes is not None:
                n["host_ram_gib"] = node.host_ram_bytes / GiB  # exact: a power of two
            if node.links:
                n["links"] = [
                    {
                        "gpus": list(lk.gpus),
                        **_link_doc(lk.link, lk.measured_gb_per_s, True, lk.measured_latency_us),
                    }
                    for lk in node.links
                ]
            nodes.append(n)
        doc["nodes"] = nodes
        if self.node_links:
            doc["node_links"] = [
                {
                    "nodes": list(p.nodes),
                    **_link_doc(p.link, p.measured_gb_per_s, True, p.measured_latency_us),
                }
                for p in self.node_links
            ]
        return doc

    def to_yaml(self) -> str:
        return yaml.safe_dump(
            self.to_doc(), sort_keys=False, default_flow_style=None, width=100, allow_unicode=True
        )


def _link_doc(
    link: str, measured: float | None, always_dict: bool = False, latency_us: float | None = None
) -> Any:
    if measured is None and latency_us is None and not always_dict:
        return link
    out: dict[str, Any] = {"link": link}
    if measured is not None:
        out["measured_gb_per_s"] = measured
    if latency_us is not None:
        out["measured_latency_us"] = latency_us
    return out


def _check_gpu(gpu: Gpu, source: str) -> None:
    place = f"{source}: {gpu.id}"
    if gpu.used_bytes < 0:
        raise ClusterError([f"{place}: used memory must be >= 0 (got {gpu.used_bytes:g} B)"])
    if gpu.used_bytes > gpu.capacity_bytes:
        raise ClusterError([f"{place}: {exceeds(gpu.used_bytes, gpu.spec)}"])
    if gpu.free_until_s is not None and gpu.free_until_s < 0:
        raise ClusterError([f"{place}: free_until_s must be >= 0 (got {gpu.free_until_s:g})"])
