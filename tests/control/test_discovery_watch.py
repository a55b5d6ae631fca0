"""GPU discovery while running (docs/controller.md) against a fake NVML
(tests/perf_and_cluster/test_discover.py's, with compute processes): what NVML shows now becomes the
same resource events as a change of the cluster file; our own engines' memory is not a tenant; noise
is not a change; a GPU that vanished is lost; an NVML failure keeps the last cluster. Then the
controller, built on a cluster `flexpipe discover` wrote, watches by itself and turns a change into
its events."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from test_discover import FakeGpu, FakeNvml

from flexpipe.cluster import Cluster
from flexpipe.cluster.nvml import cluster_doc, read_inventory, to_cluster
from flexpipe.control.api.gateway_client import GatewayClient
from flexpipe.control.controller import Controller
from flexpipe.control.controller_config import ControllerConfig
from flexpipe.control.core.resources import Resources
from flexpipe.control.watch.discovery_watch import DISCOVERED_MARK, LOST_OWNER, DiscoveryWatch
from flexpipe.hardware import GiB
from flexpipe.launch import LocalLauncher
from flexpipe.policies.planner import ModelDemand, Slo

OURS = os.getpid()  # a process of "our engine": its group is what the controller owns


class Nvml(FakeNvml):
    """With each GPU's compute processes: (pid, bytes)."""

    def __init__(self, gpus: list[FakeGpu]) -> None:
        super().__init__(gpus, nvlink={(0, 1)})
        self.procs: dict[int, list[tuple[int, float]]] = {}

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[object]:
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self.procs.get(h, [])]


def box() -> Nvml:
    return Nvml(
        [
            FakeGpu("NVIDIA A100-SXM4-80GB", 80, used_gib=40),  # a tenant holds 40 GiB
            FakeGpu("NVIDIA A100-SXM4-80GB", 80),
            FakeGpu("NVIDIA A100 80GB PCIe", 80),
            FakeGpu("NVIDIA L4", 22.5),
        ]
    )


def discovered(nvml: Nvml) -> Cluster:
    return to_cluster(cluster_doc(read_inventory(nvml, node="box")))


def kinds(events: list[Any]) -> list[tuple[str, str]]:
    return [(e.kind.value, e.gpu) for e in events]


def test_nvml_changes_become_resource_events() -> None:
    nvml = box()
    base = discovered(nvml)
    assert DISCOVERED_MARK in (base.description or "")
    assert base.gpu("gpu0").used_bytes == 40 * GiB
    own: set[int] = set()
    watch = DiscoveryWatch(base, 5.0, nvml=nvml, node="box", own_pgids=lambda: own)
    res = Resources.of(base, 0.0)
    assert watch.poll(100.0) is None  # nothing moved
    nvml.gpus[0].used_gib = 40.6  # the tenant's allocator breathing: noise
    assert watch.poll(101.0) is None
    # another tenant takes 30 GiB of gpu1: the same event a cluster file edit gives
    nvml.gpus[1].used_gib = 30.0
    change = watch.poll(102.0)
    assert change is not None
    cluster, events = change
    assert kinds(events) == [("occupied", "gpu1")]
    assert cluster.gpu("gpu1").used_bytes == 30 * GiB
    res, via_file = res.file_changed(cluster, 102.0)
    assert kinds(via_file) == [("occupied", "gpu1")]
    # our own engine starts on gpu2 and holds 50 GiB: not a tenant, no event
    own.add(os.getpgid(OURS))
    nvml.gpus[2].used_gib = 50.4
    nvml.procs[2] = [(OURS, 50 * GiB)]
    assert watch.poll(103.0) is None
    # a process of another group on the same GPU is a tenant
    nvml.procs[2].append((1, 10 * GiB))  # init's group: not ours
    nvml.gpus[2].used_gib = 60.4
    change = watch.poll(104.0)
    assert change is not None and kinds(change[1]) == [("occupied", "gpu2")]
    assert change[0].gpu("gpu2").used_bytes == pytest.approx(10.4 * GiB)
    # the first tenant leaves gpu0 (the seed's gpu1 story): freed
    nvml.gpus[0].used_gib = 0.4
    change = watch.poll(105.0)
    assert change is not None and kinds(change[1]) == [("freed", "gpu0")]
    assert change[0].gpu("gpu0").used_bytes == 0.0 and change[0].gpu("gpu0").owner is None
    # the L4 falls off the bus: lost without notice, held whole
    nvml.gpus.pop()
    change = watch.poll(106.0)
    assert change is not None and kinds(change[1]) == [("occupied", "gpu3")]
    gpu3 = change[0].gpu("gpu3")
    assert gpu3.free_bytes == 0.0 and gpu3.owner == LOST_OWNER
    assert watch.poll(107.0) is None  # and stays so


def test_an_nvml_failure_keeps_the_last_cluster_and_is_reported_once() -> None:
    nvml = box()
    watch = DiscoveryWatch(discovered(nvml), 5.0, nvml=nvml, node="box")
    nvml.init_error = RuntimeError("NVML: driver not loaded")
    assert watch.poll(1.0) is None and watch.poll(2.0) is None
    assert watch.error is not None and "driver not loaded" in watch.error
    nvml.init_error = None
    nvml.gpus[1].used_gib = 20.0
    change = watch.poll(3.0)
    assert change is not None and kinds(change[1]) == [("occupied", "gpu1")]
    assert watch.error is None


def test_changes_polls_every_interval_with_an_injected_sleep() -> None:
    nvml = box()
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)
        if len(slept) == 3:
            nvml.gpus[1].used_gib = 70.0

    watch = DiscoveryWatch(discovered(nvml), 7.5, nvml=nvml, node="box", sleep=sleep,
                           clock=lambda: 50.0)  # fmt: skip

    async def first() -> tuple[Cluster, list[Any]]:
        async for change in watch.changes():
            return change
        raise AssertionError("no change")

    cluster, events = asyncio.run(first())
    assert cluster.gpu("gpu1").used_bytes == 70 * GiB
    assert slept == [7.5, 7.5, 7.5] and watch.num_polls == 3
    assert kinds(events) == [("occupied", "gpu1")] and events[0].at_s == 50.0


def test_the_controller_watches_a_discovered_cluster_and_feeds_its_events(
    tmp_path: Path,
) -> None:
    nvml = box()
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster_doc(read_inventory(nvml, node="box"))))
    demand = ModelDemand("m", "llama-2-7b", 1.0, 512, 64, Slo(2.0, 0.1), ("bf16",))
    said: list[str] = []

    def controller(**cfg: Any) -> Controller:
        config = ControllerConfig(path, (demand,), **cfg)
        return Controller(config, LocalLauncher(), GatewayClient("http://127.0.0.1:9", None),
                          lambda p, c: None,  # type: ignore[arg-type,return-value]
                          clock=lambda: 500.0, wall=lambda: 1000.0, say=said.append,
                          nvml=nvml)  # fmt: skip

    assert controller(discover_interval_s=0).discovery is None  # off when asked
    ctl = controller()  # on by itself: the file says `flexpipe discover` wrote it
    assert ctl.discovery is not None and ctl.discovery.interval_s == 30.0
    nvml.gpus[0].used_gib = 0.4  # the tenant on gpu0 leaves
    change = ctl.discovery.poll(1000.0)
    assert change is not None
    events = ctl.discovered(change[0])
    assert kinds(events) == [("freed", "gpu0")]
    assert ctl.cluster.gpu("gpu0").used_bytes == 0.0
    assert ctl.resources_changed_s == 500.0  # the resource trigger's clock starts
    # a cluster written by hand is not discovered unless asked
    path.write_text(path.read_text().replace(DISCOVERED_MARK, "written by hand"))
    assert controller().discovery is None
    assert controller(discover_interval_s=5).discovery is not None
