"""Where weights come from (flexpipe/perf/weights.py) and what start-up, sleep and wake cost:
pure functions, exact floats."""

from __future__ import annotations

import pytest

from flexpipe.cluster import parse_cluster
from flexpipe.cluster.errors import ClusterError
from flexpipe.hardware import GPUS, gpu_spec, link_spec
from flexpipe.perf import perf_model_for
from flexpipe.perf.weights import (
    GpuShard,
    host_ram,
    load_s,
    local_nvme,
    network_storage,
    page_cache,
    peer_gpu,
    source_of,
    storage,
)

SEVEN_B_BYTES = 13476831232.0  # llama-2-7b, fp16: num_params x 2
SEVEN_B_GPU_BYTES = 13476823040.0  # what its one GPU holds (the memory plan's per-GPU share)


def test_host_links_from_the_datasheets() -> None:
    gb = 1e9
    assert gpu_spec("A100-80G-SXM").host_link_bandwidth_bytes_per_s == 32 * gb
    assert gpu_spec("L4").host_link_bandwidth_bytes_per_s == 32 * gb
    assert gpu_spec("H100-80G-SXM").host_link_bandwidth_bytes_per_s == 64 * gb
    assert gpu_spec("H200-141G").host_link_bandwidth_bytes_per_s == 64 * gb
    assert gpu_spec("V100-32G").host_link_bandwidth_bytes_per_s == 16 * gb
    assert {g.host_link_generation for g in GPUS.values()} == {"pcie3", "pcie4", "pcie5"}


def test_default_cold_start_is_unchanged() -> None:
    """2 GB/s for the whole checkpoint plus 20 s of start-up, as before sources existed."""
    pm = perf_model_for("llama-2-7b", "tp=1", "A100-80G-SXM")
    assert pm.memory.weights_bytes == SEVEN_B_BYTES
    assert pm.cold_start_s() == SEVEN_B_BYTES / 2e9 + 20.0 == 26.738415616
    assert pm.cold_start_s(4e9) == SEVEN_B_BYTES / 4e9 + 20.0
    assert pm.cold_start_s(None, pm.default_weight_source()) == pm.cold_start_s()
    assert pm.weights_load_s() == SEVEN_B_BYTES / 2e9


def test_level1_sleep_and_wake_copy_over_the_host_link() -> None:
    a100 = perf_model_for("llama-2-7b", "tp=1", "A100-80G-SXM")
    assert a100.memory.per_gpu[0].weights_bytes == SEVEN_B_GPU_BYTES
    assert a100.sleep_s(1) == SEVEN_B_GPU_BYTES / (32e9 * 0.8)
    assert a100.wake_s(1) == SEVEN_B_GPU_BYTES / (32e9 * 0.8)
    h100 = perf_model_for("llama-2-7b", "tp=1", "H100-80G-SXM")
    assert h100.wake_s(1) == SEVEN_B_GPU_BYTES / (64e9 * 0.8)
    assert a100.cold_start_s(None, host_ram()) == SEVEN_B_GPU_BYTES / (32e9 * 0.8) + 20.0


def test_levels_0_and_2_copy_nothing_on_sleep_and_level2_loads_on_wake() -> None:
    pm = perf_model_for("llama-2-7b", "tp=1", "A100-80G-SXM")
    assert pm.sleep_s(0) == pm.sleep_s(2) == pm.wake_s(0) == 0.0
    assert pm.wake_s(2) == SEVEN_B_BYTES / 2e9  # the default source: storage
    # one GPU on one node: the disk (7 GB/s) paces it, not the host link (25.6 GB/s)
    assert pm.wake_s(2, local_nvme()) == SEVEN_B_GPU_BYTES / 7e9
    assert pm.wake_s(2, network_storage()) == SEVEN_B_GPU_BYTES / 3.125e9
    assert pm.wake_s(2, page_cache()) == SEVEN_B_GPU_BYTES / (32e9 * 0.8)
    with pytest.raises(ValueError, match="sleep level"):
        pm.sleep_s(3)


def test_a_pipeline_stage_loads_only_its_layers() -> None:
    pm = perf_model_for("llama-2-7b", "pp=2", "A100-80G-SXM")
    first, last = (g.weights_bytes for g in pm.memory.per_gpu)
    assert first == last == SEVEN_B_GPU_BYTES / 2  # 16 layers and embedding or lm_head each
    assert pm.wake_s(1) == max(first, last) / (32e9 * 0.8)
    # one node's disk is shared by both stages
    assert pm.wake_s(2, local_nvme()) == (first + last) / 7e9
    # one stage per node: each node's disk reads its stage alone
    nodes = {"gpu0": "a", "gpu1": "b"}
    assert pm.wake_s(2, local_nvme(), nodes.__getitem__) == max(first, last) / 7e9


def test_a_peer_gpu_sends_over_its_link_with_no_host_copy() -> None:
    pm = perf_model_for("llama-2-7b", "tp=2", "A100-80G-SXM")
    per_gpu = max(g.weights_bytes for g in pm.memory.per_gpu)
    nvlink = peer_gpu(link_spec("nvlink3"), 0.8)
    assert nvlink.bandwidth_bytes_per_s == 300e9 * 0.8
    assert pm.wake_s(2, nvlink) == per_gpu / (300e9 * 0.8)
    over_ib = peer_gpu(link_spec("ib200"), 0.8)
    assert pm.cold_start_s(None, over_ib) == per_gpu / (25e9 * 0.8) + 20.0


def test_load_s_takes_the_slower_of_the_source_and_the_host_links() -> None:
    shards = (
        GpuShard("g0", "n0", 10e9, 25e9),
        GpuShard("g1", "n0", 10e9, 5e9),  # a slow host link
        GpuShard("g2", "n1", 4e9, 25e9),
    )
    assert load_s(shards, host_ram()) == 10e9 / 5e9
    assert load_s(shards, local_nvme(4e9)) == 20e9 / 4e9  # node n0 reads 20 GB
    assert load_s(shards, local_nvme(40e9)) == 10e9 / 5e9  # the host link paces it
    assert load_s(shards, storage(2e9)) == 20e9 / 2e9
    assert load_s((), host_ram()) == 0.0


def test_source_of_by_kind() -> None:
    assert source_of("local_nvme") == local_nvme()
    assert source_of("network_storage", 12.5e9) == network_storage(12.5e9)
    assert source_of("peer_gpu", None, link_spec("nvlink4"), 0.8) == peer_gpu(
        link_spec("nvlink4"), 0.8
    )
    with pytest.raises(ValueError, match="unknown weight source"):
        source_of("tape")
    with pytest.raises(ValueError, match="needs a link"):
        source_of("peer_gpu")
    with pytest.raises(ValueError, match="> 0"):
        source_of("local_nvme", 0.0)


def _cluster(node: dict[str, object]) -> dict[str, object]:
    base: dict[str, object] = {"name": "n1", "gpus": [{"id": "g0", "type": "A100-80G-SXM"}]}
    return {"name": "c", "nodes": [{**base, **node}]}


def test_cluster_file_storage_and_host_ram() -> None:
    c = parse_cluster(
        _cluster({"local_nvme_gb_per_s": 12, "network_storage_gb_per_s": 12.5, "host_ram_gib": 512})
    )
    node = c.nodes[0]
    assert node.local_nvme_bytes_per_s == 12e9
    assert node.network_storage_bytes_per_s == 12.5e9
    assert node.host_ram_capacity_bytes == 512 * 2.0**30
    assert parse_cluster(c.to_doc()) == c  # the keys round-trip


def test_cluster_file_defaults_when_a_node_says_nothing() -> None:
    node = parse_cluster(_cluster({})).nodes[0]
    assert (node.local_nvme_gb_per_s, node.network_storage_gb_per_s, node.host_ram_bytes) == (
        None,
        None,
        None,
    )
    assert node.local_nvme_bytes_per_s == 7e9
    assert node.network_storage_bytes_per_s == 3.125e9
    assert node.host_ram_capacity_bytes == 2 * 80 * 2.0**30  # twice its GPU memory


def test_cluster_file_rejects_bad_storage_values() -> None:
    with pytest.raises(ClusterError) as err:
        parse_cluster(_cluster({"local_nvme_gb_per_s": 0, "host_ram_gib": "lots"}))
    text = str(err.value)
    assert "nodes[0].local_nvme_gb_per_s: must be > 0" in text
    assert "nodes[0].host_ram_gib: expected a number" in text
