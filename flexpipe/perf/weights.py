"""Where an engine's weights come from, and how long bringing them onto its GPUs takes.

A cold start is the engine's fixed start-up (process, CUDA context, allocator, profiling run,
CUDA-graph capture: `Efficiency.engine_startup_s`) plus loading the weights. A sleeping vLLM
engine (sleep mode) keeps its process, allocator and graphs: waking it costs the load only.
The load comes from the fastest source the node has (docs/performance-model.md, "Where weights
come from"):

- `host_ram`: the engine's own sleeping copy (level 1), pinned; bound by each GPU's host link.
- `page_cache`: the checkpoint's pages still in the node's RAM; each GPU's host link.
- `local_nvme`: the node's NVMe; the disk (shared by the node's GPUs), then the host links.
- `network_storage`: NFS or an object store; the NIC (shared), then the host links.
- `peer_gpu`: a GPU already holding the same layers; the link to it (NVLink, or the network).
- `storage`: the default, `Efficiency.storage_bandwidth_bytes_per_s` for the whole checkpoint
  read once (today's cold start).

Every GPU loads only its own shard (a pipeline stage its layers, a tensor-parallel rank its
slice): GPUs load in parallel, a source shared by a node's GPUs divides its bandwidth among
them, and a load through host memory also waits for the slowest GPU's host link (the two are
pipelined, so the slower of the two paces it). Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flexpipe.hardware import (
    DEFAULT_LOCAL_NVME_BYTES_PER_S,
    DEFAULT_NETWORK_STORAGE_BYTES_PER_S,
    LinkSpec,
)

HOST_RAM = "host_ram"
PAGE_CACHE = "page_cache"
LOCAL_NVME = "local_nvme"
NETWORK_STORAGE = "network_storage"
PEER_GPU = "peer_gpu"
STORAGE = "storage"
KINDS = (HOST_RAM, PAGE_CACHE, LOCAL_NVME, NETWORK_STORAGE, PEER_GPU, STORAGE)


@dataclass(frozen=True, slots=True)
class WeightSource:
    """One place weights can be read from, with the bandwidth it is read at.

    `bandwidth_bytes_per_s`: achieved; None where only the GPUs' host links bound the copy
    (host RAM, page cache). `shared_per_node`: one reader (a disk, a NIC) that a node's GPUs
    share, rather than one link per GPU. `via_host_link`: the bytes cross each GPU's host link.
    """

    kind: str
    bandwidth_bytes_per_s: float | None
    shared_per_node: bool
    via_host_link: bool
    detail: str


@dataclass(frozen=True, slots=True)
class GpuShard:
    """The weight bytes one GPU of an instance loads, and the host link it has."""

    gpu: str
    node: str
    weight_bytes: float
    host_link_bytes_per_s: float  # achieved (datasheet rate x host_link_efficiency)


def host_ram() -> WeightSource:
    return WeightSource(HOST_RAM, None, False, True, "sleeping copy in pinned host RAM")


def page_cache() -> WeightSource:
    return WeightSource(PAGE_CACHE, None, False, True, "checkpoint pages in the page cache")


def local_nvme(bandwidth_bytes_per_s: float = DEFAULT_LOCAL_NVME_BYTES_PER_S) -> WeightSource:
    return WeightSource(LOCAL_NVME, bandwidth_bytes_per_s, True, True, "the node's NVMe")


def network_storage(
    bandwidth_bytes_per_s: float = DEFAULT_NETWORK_STORAGE_BYTES_PER_S,
) -> WeightSource:
    return WeightSource(
        NETWORK_STORAGE, bandwidth_bytes_per_s, True, True, "network storage over the NIC"
    )


def peer_gpu(link: LinkSpec, p2p_efficiency: float) -> WeightSource:
    """A GPU holding the same layers sends them over `link` (GPU to GPU, no host copy)."""
    return WeightSource(
        PEER_GPU,
        link.bandwidth_bytes_per_s * p2p_efficiency,
        False,
        False,
        f"a peer GPU over {link.name}",
    )


def storage(bandwidth_bytes_per_s: float) -> WeightSource:
    """The default source: one reader for the whole instance (what `cold_start_s` assumes)."""
    return WeightSource(STORAGE, bandwidth_bytes_per_s, True, False, "default storage")


def source_of(
    kind: str,
    bandwidth_bytes_per_s: float | None = None,
    peer_link: LinkSpec | None = None,
    p2p_efficiency: float = 0.8,
) -> WeightSource:
    """A source by kind (`KINDS`); `bandwidth_bytes_per_s` overrides the default of a disk,
    a network store or a peer (achieved); a peer needs one or `peer_link`."""
    bw = bandwidth_bytes_per_s
    if bw is not None and bw <= 0:
        raise ValueError("a weight source's bandwidth must be > 0")
    if kind == HOST_RAM:
        return host_ram()
    if kind == PAGE_CACHE:
        return page_cache()
    if kind == LOCAL_NVME:
        return local_nvme() if bw is None else local_nvme(bw)
    if kind == NETWORK_STORAGE:
        return network_storage() if bw is None else network_storage(bw)
    if kind == PEER_GPU:
        if bw is not None:
            return WeightSource(PEER_GPU, bw, False, False, "a peer GPU")
        if peer_link is None:
            raise ValueError("a peer_gpu source needs a link or a bandwidth")
        return peer_gpu(peer_link, p2p_efficiency)
    if kind == STORAGE:
        if bw is None:
            raise ValueError("a storage source needs a bandwidth")
        return storage(bw)
    raise ValueError(f"unknown weight source {kind!r}; known: {', '.join(KINDS)}")


def load_s(shards: Sequence[GpuShard], source: WeightSource) -> float:
    """Seconds to bring every shard onto its GPU from `source` (GPUs load in parallel)."""
    source_s = 0.0
    bandwidth = source.bandwidth_bytes_per_s
    if bandwidth is not None:
        if source.shared_per_node:
            per_node: dict[str, float] = {}
            for sh in shards:
                per_node[sh.node] = per_node.get(sh.node, 0.0) + sh.weight_bytes
            source_s = max(per_node.values(), default=0.0) / bandwidth
        else:
            source_s = max((sh.weight_bytes for sh in shards), default=0.0) / bandwidth
    host_s = 0.0
    if source.via_host_link:
        host_s = max((sh.weight_bytes / sh.host_link_bytes_per_s for sh in shards), default=0.0)
    return max(source_s, host_s)


__all__ = [
    "HOST_RAM",
    "KINDS",
    "LOCAL_NVME",
    "NETWORK_STORAGE",
    "PAGE_CACHE",
    "PEER_GPU",
    "STORAGE",
    "GpuShard",
    "WeightSource",
    "host_ram",
    "load_s",
    "local_nvme",
    "network_storage",
    "page_cache",
    "peer_gpu",
    "source_of",
    "storage",
]
