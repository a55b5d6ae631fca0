"""`flexpipe discover` against a fake NVML (same functions as pynvml): GPU types from NVML
names, memory held by others, NVLink / PCIe / through-the-CPU links, the cluster file it
prints loads, the bandwidth probe's skip messages, and the no-GPU message."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.cluster import load_cluster, nvml
from flexpipe.cluster.nvml import (
    DiscoverError,
    catalog_type,
    cluster_doc,
    probe_bandwidth,
    read_inventory,
    to_cluster,
)

GiB = 2**30


@dataclass
class FakeGpu:
    name: str
    total_gib: float
    used_gib: float = 0.4
    pcie_gen: int = 4
    num_procs: int = 0


class FakeNvml:
    """The pynvml functions discover calls, over a declared topology."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        nvlink: set[tuple[int, int]] = frozenset(),  # type: ignore[assignment]
        hostbridge: set[tuple[int, int]] = frozenset(),  # type: ignore[assignment]
        init_error: Exception | None = None,
    ) -> None:
        self.gpus = gpus
        self.nvlink = nvlink
        self.hostbridge = hostbridge
        self.init_error = init_error
        self.num_inits = 0
        self.num_shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.num_inits += 1

    def nvmlShutdown(self) -> None:
        self.num_shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return self.gpus[h].name

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        g = self.gpus[h]
        return SimpleNamespace(total=g.total_gib * GiB, used=g.used_gib * GiB)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return self.gpus[h].pcie_gen

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[object]:
        return [object()] * self.gpus[h].num_procs

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        assert index == 2  # NVML_P2P_CAPS_INDEX_NVLINK
        return 0 if (min(a, b), max(a, b)) in self.nvlink else 4  # 4: NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return 30 if (min(a, b), max(a, b)) in self.hostbridge else 50  # HOSTBRIDGE / SYSTEM


def fragmented() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu("NVIDIA A100-SXM4-80GB", 80, used_gib=40, num_procs=2),
            FakeGpu("NVIDIA A100-SXM4-80GB", 80),
            FakeGpu("NVIDIA A100 80GB PCIe", 80, pcie_gen=4),
            FakeGpu("NVIDIA L4", 22.5),
        ],
        nvlink={(0, 1)},
        hostbridge={(1, 2)},
    )


def test_catalog_names_from_nvml_names() -> None:
    assert catalog_type("NVIDIA A100-SXM4-40GB", 40 * GiB) == "A100-40G-SXM"
    assert catalog_type("NVIDIA A100-SXM4-80GB", 80 * GiB) == "A100-80G-SXM"
    assert catalog_type("NVIDIA H100 80GB HBM3", 80 * GiB) == "H100-80G-SXM"
    assert catalog_type("NVIDIA H100 PCIe", 80 * GiB) == "H100-80G-PCIe"
    assert catalog_type("NVIDIA H20", 96 * GiB) == "H20-96G"
    assert catalog_type("NVIDIA H200", 141 * GiB) == "H200-141G"
    assert catalog_type("NVIDIA B200", 180 * GiB) == "B200-180G"
    assert catalog_type("NVIDIA L20", 48 * GiB) == "L20"
    assert catalog_type("NVIDIA A40", 48 * GiB) == "A40"
    assert catalog_type("NVIDIA H200", 141 * GiB) == "H200-141G"
    assert catalog_type("Tesla V100-SXM2-32GB", 32 * GiB) == "V100-32G"
    assert catalog_type("NVIDIA L4", 22.5 * GiB) == "L4"
    assert catalog_type("NVIDIA L40S", 45 * GiB) == "L40S"
    with pytest.raises(DiscoverError, match="not in flexpipe's catalog"):
        catalog_type("NVIDIA GB300", 288 * GiB)


def test_topology_becomes_a_cluster_file() -> None:
    nvml = fragmented()
    inv = read_inventory(nvml, node="box")
    assert nvml.num_inits == 1 and nvml.num_shutdowns == 1
    doc = cluster_doc(inv)
    cluster = to_cluster(doc)
    assert [g.type for g in cluster.gpus] == ["A100-80G-SXM", "A100-80G-SXM", "A100-80G-PCIe", "L4"]
    assert [g.index for g in cluster.gpus] == [0, 1, 2, 3]
    assert cluster.link_between("gpu0", "gpu1").name == "nvlink3"
    assert cluster.link_between("gpu1", "gpu2").name == "pcie4"
    assert cluster.link_between("gpu0", "gpu3").name == "cpu"  # NVML SYSTEM: through the CPU
    gpu0 = cluster.gpu("gpu0")
    assert gpu0.used_bytes == 40 * GiB and gpu0.owner == "2 process(es) at discovery"
    assert cluster.gpu("gpu1").used_bytes == 0  # the driver's 0.4 GiB is not a tenant
    assert cluster.fast_domains()[0] == ("gpu0", "gpu1")


def test_nvswitch_board_is_one_group_and_measurements_override() -> None:
    eight = FakeNvml(
        [FakeGpu("NVIDIA H100 80GB HBM3", 80, pcie_gen=5) for _ in range(8)],
        nvlink={(a, b) for a in range(8) for b in range(a + 1, 8)},
    )
    inv = read_inventory(eight, node="hgx")
    inv.measured_gb_per_s[(0, 1)] = 180.0
    doc = cluster_doc(inv)
    (group,) = doc["nodes"][0]["links"]
    assert len(group["gpus"]) == 8 and group["link"] == "nvlink4"
    assert group["measured_gb_per_s"] == 180.0
    cluster = to_cluster(doc)
    assert cluster.link_between("gpu3", "gpu7").bandwidth_bytes_per_s == 180e9


def test_no_driver_is_a_clear_message() -> None:
    class LibraryNotFound(Exception):
        pass

    nvml = FakeNvml([], init_error=LibraryNotFound("NVML Shared Library Not Found"))
    with pytest.raises(DiscoverError, match="no NVIDIA GPU found on this machine"):
        read_inventory(nvml)
    with pytest.raises(DiscoverError, match="NVML found no GPU"):
        read_inventory(FakeNvml([]))


def test_bandwidth_probe_skips_with_a_message() -> None:
    one = read_inventory(FakeNvml([FakeGpu("NVIDIA L4", 22.5)]), node="n")
    assert probe_bandwidth(one) == ({}, "bandwidth probe skipped: it needs at least two GPUs")
    inv = read_inventory(fragmented(), node="n")
    measured, message = probe_bandwidth(inv)
    try:
        import torch  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        assert measured == {} and "skipped: PyTorch is not installed" in message
    else:  # pragma: no cover - machines with PyTorch: no CUDA here (fake GPUs)
        assert "skipped" in message or measured


def test_discover_cli_prints_a_loadable_cluster_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nvml, "_load_nvml", fragmented)
    out = tmp_path / "discovered.yaml"
    res = CliRunner().invoke(app, ["discover", "--name", "lab", "-o", str(out)])
    assert res.exit_code == 0, res.output
    cluster = load_cluster(out)
    assert cluster.name == "lab" and len(cluster.gpus) == 4
    res = CliRunner().invoke(app, ["discover"])
    assert res.exit_code == 0 and "nvlink3" in res.output and "A100-80G-PCIe" in res.output


def test_discover_cli_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        nvml, "_load_nvml", lambda: FakeNvml([], init_error=RuntimeError("Driver Not Loaded"))
    )
    res = CliRunner().invoke(app, ["discover", "--probe"])
    assert res.exit_code == 1
    assert "no NVIDIA GPU found" in res.output and "Driver Not Loaded" in res.output
    assert "bandwidth probe skipped" in res.output
    assert "Traceback" not in res.output
