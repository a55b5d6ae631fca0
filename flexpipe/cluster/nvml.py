"""Cluster inventory of this machine through NVML (nvidia-ml-py): GPUs, the memory others
hold on them, and the NVLink / PCIe topology between them, written as a cluster file
(docs/cluster-file.md) for `flexpipe plan` / `flexpipe up`.

Links: a pair whose NVML peer-to-peer status over NVLink is OK gets the GPU's NVLink
generation from the catalog; a pair under one PCIe switch or host bridge (NVML topology
SINGLE / MULTIPLE / HOSTBRIDGE) gets PCIe of the older GPU's generation; anything further
(NODE / SYSTEM) is left to the cluster default, PCIe through the CPU.

The optional bandwidth probe (seed 000 §4.3: measure before trusting a link) copies a buffer
between every GPU pair with PyTorch and records `measured_gb_per_s`, which overrides the
catalog. Without GPUs, or without PyTorch with CUDA, it is skipped with a message.

`nvml` is injectable: tests pass a fake with the same functions.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flexpipe.cluster.model import Cluster
from flexpipe.cluster.parse import parse_cluster
from flexpipe.hardware import GPUS, GiB, gpu_spec

# NVML constants (pynvml names), repeated so a fake NVML needs only functions.
TOPOLOGY_HOSTBRIDGE = 30  # NVML_TOPOLOGY_HOSTBRIDGE: SINGLE=10, MULTIPLE=20 are closer
P2P_CAPS_INDEX_NVLINK = 2
P2P_STATUS_OK = 0


class DiscoverError(RuntimeError):
    """No GPUs to discover (or NVML failed); the message says what to do instead."""


# NVML device names -> catalog names. Matched in order, case-insensitively, on the name with
# "NVIDIA " removed; memory decides between variants sold under one name.
_NAME_RULES: tuple[tuple[str, Callable[[float], str]], ...] = (
    (r"A100.*SXM", lambda gib: "A100-80G-SXM" if gib > 50 else "A100-40G-SXM"),
    (r"A100.*PCIE", lambda gib: "A100-80G-PCIe"),
    (r"H100.*PCIE", lambda gib: "H100-80G-PCIe"),
    (r"H100", lambda gib: "H100-80G-SXM"),
    (r"H200", lambda gib: "H200-141G"),
    (r"H20\b", lambda gib: "H20-96G"),
    (r"B200", lambda gib: "B200-180G"),
    (r"L40S", lambda gib: "L40S"),
    (r"^L20$", lambda gib: "L20"),
    (r"^A40$", lambda gib: "A40"),
    (r"^L4$", lambda gib: "L4"),
    (r"A10G", lambda gib: "A10G"),
    (r"V100", lambda gib: "V100-32G"),
    (r"RTX 4090", lambda gib: "RTX-4090"),
)


def catalog_type(nvml_name: str, memory_bytes: float) -> str:
    """The catalog GPU type of an NVML device name (`NVIDIA A100-SXM4-80GB`)."""
    name = nvml_name.strip()
    name = re.sub(r"^(NVIDIA|Tesla)\s+", "", name, flags=re.IGNORECASE).strip().upper()
    for pattern, pick in _NAME_RULES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return gpu_spec(pick(memory_bytes / GiB)).name
    raise DiscoverError(
        f"GPU {nvml_name!r} is not in flexpipe's catalog ({', '.join(sorted(GPUS))}); add it "
        "to flexpipe/hardware.py or write the cluster file by hand (docs/cluster-file.md)"
    )


@dataclass
class DiscoveredGpu:
    index: int
    nvml_name: str
    type: str
    total_bytes: float
    used_bytes: float
    pcie_generation: int | None
    num_processes: int


@dataclass
class Inventory:
    node: str
    driver_version: str
    gpus: list[DiscoveredGpu] = field(default_factory=list)
    nvlink_pairs: set[tuple[int, int]] = field(default_factory=set)
    pcie_pairs: set[tuple[int, int]] = field(default_factory=set)  # one switch / host bridge
    measured_gb_per_s: dict[tuple[int, int], float] = field(default_factory=dict)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _load_nvml() -> Any:
    try:
        return importlib.import_module("pynvml")
    except ImportError:  # pragma: no cover - a declared dependency
        raise DiscoverError("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from None


def read_inventory(nvml: Any = None, node: str | None = None) -> Inventory:
    """Ask NVML for this machine's GPUs and their topology."""
    nvml = nvml or _load_nvml()
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        raise DiscoverError(
            f"no NVIDIA GPU found on this machine (NVML: {exc}); write a cluster file by hand "
            "(docs/cluster-file.md) or start from examples/clusters/, and run engines with "
            "--engine sim"
        ) from None
    try:
        count = int(nvml.nvmlDeviceGetCount())
        if count == 0:
            raise DiscoverError("NVML found no GPU on this machine; nothing to discover")
        inv = Inventory(
            node=node or socket.gethostname().split(".")[0] or "node0",
            driver_version=_text(nvml.nvmlSystemGetDriverVersion()),
        )
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        for i, h in enumerate(handles):
            name = _text(nvml.nvmlDeviceGetName(h))
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            try:
                gen: int | None = int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(h))
            except Exception:
                gen = None
            try:
                num_procs = len(nvml.nvmlDeviceGetComputeRunningProcesses(h))
            except Exception:
                num_procs = 0
            inv.gpus.append(
                DiscoveredGpu(
                    i,
                    name,
                    catalog_type(name, float(mem.total)),
                    float(mem.total),
                    float(mem.used),
                    gen,
                    num_procs,
                )
            )
        for a, b in itertools.combinations(range(count), 2):
            try:
                p2p = nvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], P2P_CAPS_INDEX_NVLINK)
            except Exception:
                p2p = None
            if p2p == P2P_STATUS_OK:
                inv.nvlink_pairs.add((a, b))
                continue
            try:
                level = int(nvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]))
            except Exception:
                continue
            if level <= TOPOLOGY_HOSTBRIDGE:
                inv.pcie_pairs.add((a, b))
        return inv
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _cliques(pairs: set[tuple[int, int]], n: int) -> list[list[int]]:
    """Greedy groups of GPUs joined pairwise (NVLink islands, NVSwitch boards)."""
    groups: list[list[int]] = []
    assigned: set[int] = set()
    for i in range(n):
        if i in assigned:
            continue
        group = [i]
        for j in range(i + 1, n):
            if j not in assigned and all((min(j, m), max(j, m)) in pairs for m in group):
                group.append(j)
        if len(group) > 1:
            assigned.update(group)
            groups.append(group)
    return groups


def cluster_doc(inv: Inventory, name: str | None = None) -> dict[str, Any]:
    """The inventory as a cluster-file document (validated by `to_cluster`)."""
    gpu_id = {g.index: f"gpu{g.index}" for g in inv.gpus}
    gpus: list[dict[str, Any]] = []
    for g in inv.gpus:
        doc: dict[str, Any] = {"id": gpu_id[g.index], "type": g.type, "index": g.index}
        if g.used_bytes >= 1 * GiB:  # the driver's own few hundred MiB is not a tenant
            doc["used_gib"] = round(g.used_bytes / GiB, 2)
            doc["owner"] = f"{g.num_processes} process(es) at discovery"
        doc["note"] = g.nvml_name
        gpus.append(doc)
    links: list[dict[str, Any]] = []
    measured = dict(inv.measured_gb_per_s)
    n = len(inv.gpus)
    for group in _cliques(inv.nvlink_pairs, n):
        spec = gpu_spec(inv.gpus[group[0]].type)
        link: dict[str, Any] = {
            "gpus": [gpu_id[i] for i in group],
            "link": spec.nvlink_generation or "nvlink3",
        }
        pair_values = [measured.pop(p) for p in itertools.combinations(group, 2) if p in measured]
        if pair_values:
            link["measured_gb_per_s"] = round(min(pair_values), 2)
        links.append(link)
    for a, b in sorted(inv.pcie_pairs):
        gens = [inv.gpus[i].pcie_generation or 4 for i in (a, b)]
        entry: dict[str, Any] = {
            "gpus": [gpu_id[a], gpu_id[b]],
            "link": "pcie5" if min(gens) >= 5 else "pcie4",
        }
        if (a, b) in measured:
            entry["measured_gb_per_s"] = round(measured.pop((a, b)), 2)
        links.append(entry)
    for (a, b), value in sorted(measured.items()):  # measured pairs through the CPU
        links.append(
            {"gpus": [gpu_id[a], gpu_id[b]], "link": "cpu", "measured_gb_per_s": round(value, 2)}
        )
    node: dict[str, Any] = {
        "name": inv.node,
        "note": f"discovered through NVML, driver {inv.driver_version}",
        "gpus": gpus,
    }
    if links:
        node["links"] = links
    return {
        "name": name or inv.node,
        "description": f"{inv.node}: {n} GPU(s), discovered by `flexpipe discover`",
        "nodes": [node],
    }


def to_cluster(doc: dict[str, Any]) -> Cluster:
    return parse_cluster(doc, "<discovered>")


# -- bandwidth probe -------------------------------------------------------------------------


def probe_bandwidth(
    inv: Inventory, size_bytes: int = 256 * 2**20, repeats: int = 5
) -> tuple[dict[tuple[int, int], float], str]:
    """Copy a buffer between every GPU pair (each direction) and time it; returns GB/s per pair
    (the slower direction) and a one-line message. Skipped (empty result) without PyTorch with
    CUDA or with fewer than two GPUs."""
    if len(inv.gpus) < 2:
        return {}, "bandwidth probe skipped: it needs at least two GPUs"
    try:
        torch: Any = importlib.import_module("torch")
    except ImportError:
        return {}, "bandwidth probe skipped: PyTorch is not installed (pip install torch)"
    if not torch.cuda.is_available():
        return {}, "bandwidth probe skipped: PyTorch sees no CUDA device"
    results: dict[tuple[int, int], float] = {}
    for a, b in itertools.combinations(range(len(inv.gpus)), 2):
        rates = []
        for src, dst in ((a, b), (b, a)):
            x = torch.empty(size_bytes, dtype=torch.uint8, device=f"cuda:{src}")
            y = torch.empty(size_bytes, dtype=torch.uint8, device=f"cuda:{dst}")
            y.copy_(x)  # warm-up (and P2P enablement)
            torch.cuda.synchronize(src)
            torch.cuda.synchronize(dst)
            start = time.perf_counter()
            for _ in range(repeats):
                y.copy_(x, non_blocking=True)
            torch.cuda.synchronize(src)
            torch.cuda.synchronize(dst)
            rates.append(size_bytes * repeats / (time.perf_counter() - start) / 1e9)
        results[(a, b)] = min(rates)
    return results, f"bandwidth probe: measured {len(results)} GPU pair(s)"
