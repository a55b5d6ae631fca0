"""Cold start and wake-up of one instance from each weight source: the rows `flexpipe
estimate` prints and `python -m bench actuation` tabulates (one place for both). Pure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flexpipe.hardware import (
    DEFAULT_LOCAL_NVME_BYTES_PER_S,
    DEFAULT_NETWORK_STORAGE_BYTES_PER_S,
    LINKS,
    GpuSpec,
    LinkSpec,
    link_spec,
)
from flexpipe.perf.model import PerfModel
from flexpipe.perf.weights import (
    HOST_RAM,
    WeightSource,
    host_ram,
    local_nvme,
    network_storage,
    page_cache,
    peer_gpu,
)


@dataclass(frozen=True, slots=True)
class SourceRow:
    """One source: its effective bandwidth (the slowest GPU's host link where only host links
    bound it), the load, a cold start from it and a wake-up from it."""

    source: str
    detail: str
    bandwidth_bytes_per_s: float
    load_s: float
    cold_start_s: float  # engine start-up + load
    wake_s: float  # level 1 for the sleeping copy, level 2 for the others


def peer_link_for(spec: GpuSpec) -> LinkSpec:
    """A peer in the same node: over the GPU's NVLink, or PCIe of its generation without."""
    if spec.nvlink_generation is not None:
        return link_spec(spec.nvlink_generation)
    return link_spec(spec.host_link_generation if spec.host_link_generation in LINKS else "pcie4")


def node_sources(
    pm: PerfModel,
    local_nvme_bytes_per_s: float = DEFAULT_LOCAL_NVME_BYTES_PER_S,
    network_storage_bytes_per_s: float = DEFAULT_NETWORK_STORAGE_BYTES_PER_S,
    peer_link: LinkSpec | None = None,
) -> tuple[WeightSource, ...]:
    """Every source a node offers an instance: its sleeping copy, the page cache, the NVMe,
    network storage and a peer GPU (default: the first GPU's `peer_link_for`)."""
    link = peer_link or peer_link_for(pm.placement.gpus[0].spec)
    return (
        host_ram(),
        page_cache(),
        local_nvme(local_nvme_bytes_per_s),
        network_storage(network_storage_bytes_per_s),
        peer_gpu(link, pm.efficiency.p2p_bandwidth_efficiency),
    )


def source_rows(
    pm: PerfModel,
    sources: Sequence[WeightSource],
    node_of: Callable[[str], str] | None = None,
) -> list[SourceRow]:
    """One row per source, then the default (storage: today's cold start), fastest first."""
    rows: list[SourceRow] = []
    host_s = min(sh.host_link_bytes_per_s for sh in pm.weight_shards())
    for src in (*sources, pm.default_weight_source()):
        load = pm.weights_load_s(src, node_of)
        wake = pm.wake_s(1, None, node_of) if src.kind == HOST_RAM else load
        bandwidth = host_s if src.bandwidth_bytes_per_s is None else src.bandwidth_bytes_per_s
        cold = pm.cold_start_s(None, src, node_of)
        rows.append(SourceRow(src.kind, src.detail, bandwidth, load, cold, wake))
    return sorted(rows, key=lambda r: r.load_s)


def fastest_source(
    pm: PerfModel, sources: Sequence[WeightSource], node_of: Callable[[str], str] | None = None
) -> WeightSource:
    """The source the weights load from fastest (ties: the first given)."""
    if not sources:
        return pm.default_weight_source()
    return min(sources, key=lambda s: pm.weights_load_s(s, node_of))


__all__ = ["SourceRow", "fastest_source", "node_sources", "peer_link_for", "source_rows"]
