"""The one catalog of GPUs and links.

Every number here is a public datasheet figure; each entry cites its source. Nothing else in
flexpipe may hard-code a GPU or link spec: the performance model, the planner, the sim engine
and the cluster loader all look things up here.

Units: bytes, bytes per second, FLOP per second (dense, no sparsity), seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GiB = float(2**30)
TFLOPS = 1e12


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """A GPU model as its datasheet describes it (dense tensor-core throughput)."""

    name: str
    memory_bytes: float
    hbm_bandwidth_bytes_per_s: float
    fp16_flops_per_s: float
    bf16_flops_per_s: float | None  # None: the chip has no bf16 (V100)
    fp8_flops_per_s: float | None = None  # None: no fp8 tensor cores
    int8_ops_per_s: float | None = None
    nvlink_bandwidth_bytes_per_s: float | None = None  # per GPU, one direction; None: no NVLink
    nvlink_generation: str | None = None  # link catalog name, e.g. "nvlink3"
    compute_capability: str = ""
    # Host link (PCIe x16 to the CPU), per direction: what copying weights between host RAM
    # and the GPU runs over (vLLM's sleep level 1 and its wake-up). The datasheets quote the
    # bidirectional sum (gen3 32 GB/s, gen4 64 GB/s, gen5 128 GB/s); half of it here.
    host_link_bandwidth_bytes_per_s: float = 32 * GB
    host_link_generation: str = "pcie4"


# PCIe x16 per direction by generation, as the GPU datasheets quote it (bidirectional / 2).
PCIE_X16_GB_PER_S = {"pcie3": 16.0, "pcie4": 32.0, "pcie5": 64.0}


def _gpu(
    name: str,
    memory_gib: float,
    hbm_gb_per_s: float,
    fp16_tflops: float,
    bf16_tflops: float | None,
    fp8_tflops: float | None = None,
    int8_tops: float | None = None,
    nvlink_gb_per_s: float | None = None,
    nvlink_generation: str | None = None,
    compute_capability: str = "",
    pcie: str = "pcie4",
) -> GpuSpec:
    return GpuSpec(
        name=name,
        memory_bytes=memory_gib * GiB,
        hbm_bandwidth_bytes_per_s=hbm_gb_per_s * GB,
        fp16_flops_per_s=fp16_tflops * TFLOPS,
        bf16_flops_per_s=None if bf16_tflops is None else bf16_tflops * TFLOPS,
        fp8_flops_per_s=None if fp8_tflops is None else fp8_tflops * TFLOPS,
        int8_ops_per_s=None if int8_tops is None else int8_tops * TFLOPS,
        nvlink_bandwidth_bytes_per_s=None if nvlink_gb_per_s is None else nvlink_gb_per_s * GB,
        nvlink_generation=nvlink_generation,
        compute_capability=compute_capability,
        host_link_bandwidth_bytes_per_s=PCIE_X16_GB_PER_S[pcie] * GB,
        host_link_generation=pcie,
    )


# NVLink figures below are per GPU per direction (the datasheets quote the bidirectional sum).
# Host links (the last argument, PCIe generation, x16; gen4 unless given) from the same
# datasheets: A100 "PCIe Gen4 64 GB/s"; H100 SXM/PCIe, H200, H20 "PCIe Gen5 128 GB/s"; L40S,
# L4, A10(G), A40, L20 and RTX 4090 PCIe Gen4 x16 (64 GB/s); V100 "PCIe Gen3 32 GB/s"; HGX/DGX
# B200 PCIe Gen5; MI300X "PCIe Gen5 x16 128 GB/s".
GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        # NVIDIA A100 datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
        # nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): 40GB SXM 1,555 GB/s;
        # BF16/FP16 tensor 312 TF dense; INT8 624 TOPS; NVLink 600 GB/s bidirectional.
        _gpu("A100-40G-SXM", 40, 1555, 312, 312, None, 624, 300, "nvlink3", "8.0"),
        # Same datasheet: 80GB SXM 2,039 GB/s.
        _gpu("A100-80G-SXM", 80, 2039, 312, 312, None, 624, 300, "nvlink3", "8.0"),
        # Same datasheet: 80GB PCIe 1,935 GB/s; NVLink only through an optional 2-GPU bridge,
        # which a cluster file declares as a link, so none here.
        _gpu("A100-80G-PCIe", 80, 1935, 312, 312, None, 624, None, None, "8.0"),
        # NVIDIA H100 datasheet (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-
        # datasheet): SXM 3.35 TB/s, BF16 989 TF, FP8 1,979 TF, INT8 1,979 TOPS (dense = half
        # the sparse figures quoted), NVLink 900 GB/s bidirectional.
        _gpu("H100-80G-SXM", 80, 3350, 989, 989, 1979, 1979, 450, "nvlink4", "9.0", "pcie5"),
        # Same datasheet: H100 PCIe 2.0 TB/s, BF16 756 TF, FP8 1,513 TF, INT8 1,513 TOPS.
        _gpu("H100-80G-PCIe", 80, 2000, 756, 756, 1513, 1513, None, None, "9.0", "pcie5"),
        # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): 141 GB HBM3e at 4.8 TB/s;
        # tensor throughput as H100 SXM; NVLink 900 GB/s bidirectional.
        _gpu("H200-141G", 141, 4800, 989, 989, 1979, 1979, 450, "nvlink4", "9.0", "pcie5"),
        # NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s): 48 GB GDDR6 864 GB/s;
        # BF16 362 TF, FP8 733 TF, INT8 733 TOPS dense; no NVLink.
        _gpu("L40S", 48, 864, 362, 362, 733, 733, None, None, "8.9"),
        # NVIDIA L4 datasheet (nvidia.com/en-us/data-center/l4): 24 GB 300 GB/s; BF16 121 TF,
        # FP8 242 TF, INT8 242 TOPS dense.
        _gpu("L4", 24, 300, 121, 121, 242, 242, None, None, "8.9"),
        # AWS EC2 G5 (A10G): 24 GB GDDR6 600 GB/s; NVIDIA A10 datasheet gives 125 TF BF16 dense
        # at A10 clocks, the A10G runs lower clocks: ~70 TF dense as measured in public
        # benchmarks (e.g. Baseten "A10 vs A10G"). INT8 twice that.
        _gpu("A10G", 24, 600, 70, 70, None, 140, None, None, "8.6"),
        # NVIDIA V100 datasheet (images.nvidia.com/content/technologies/volta/pdf/volta-v100-
        # datasheet-update-us-1165301-r5.pdf): SXM2 32 GB 900 GB/s, FP16 tensor 125 TF; no
        # BF16, no INT8 tensor cores (DP4A only); NVLink 300 GB/s bidirectional.
        _gpu("V100-32G", 32, 900, 125, None, None, None, 150, "nvlink2", "7.0", "pcie3"),
        # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): 24 GB GDDR6X 1,008 GB/s;
        # FP16/BF16 tensor with FP32 accumulate 165 TF dense, FP8 330 TF, INT8 661 TOPS.
        _gpu("RTX-4090", 24, 1008, 165, 165, 330, 661, None, None, "8.9"),
        # NVIDIA A40 datasheet (images.nvidia.com/content/Solutions/data-center/a40/nvidia-a40-
        # datasheet.pdf): 48 GB GDDR6 696 GB/s; BF16/FP16 tensor 149.7 TF dense (299.4 sparse),
        # INT8 299.3 TOPS dense; NVLink bridge 112.5 GB/s bidirectional between two cards.
        _gpu("A40", 48, 696, 149.7, 149.7, None, 299.3, 56.25, "nvlink3-bridge", "8.6"),
        # NVIDIA L20 datasheet (nvidia.com/en-us/data-center/l20, PCIe, Ada): 48 GB GDDR6
        # 864 GB/s; FP16/BF16 tensor 119.5 TF dense (239 sparse), FP8 239 TF, INT8 239 TOPS
        # dense; no NVLink.
        _gpu("L20", 48, 864, 119.5, 119.5, 239, 239, None, None, "8.9"),
        # NVIDIA HGX H20 product brief (2024; Hopper for the China market): 96 GB HBM3 at
        # 4.0 TB/s; FP16/BF16 tensor 148 TF dense, FP8 296 TF, INT8 296 TOPS dense; NVLink
        # 900 GB/s bidirectional. The tensor rate is capped: decode-friendly, prefill-poor.
        _gpu("H20-96G", 96, 4000, 148, 148, 296, 296, 450, "nvlink4", "9.0", "pcie5"),
        # NVIDIA DGX B200 datasheet (nvidia.com/en-us/data-center/dgx-b200): 8 GPUs, 1,440 GB
        # HBM3e = 180 GB per GPU at 8 TB/s, 72 PF FP8 training (sparse) = 4.5 PF dense FP8 per
        # GPU, BF16/FP16 half that (2.25 PF dense), INT8 4.5 POPS dense; NVLink 5 at 1.8 TB/s
        # bidirectional per GPU.
        _gpu("B200-180G", 180, 8000, 2250, 2250, 4500, 4500, 900, "nvlink5", "10.0", "pcie5"),
        # AMD Instinct MI300X data sheet (amd.com/.../instinct-mi300x-data-sheet.pdf): 192 GB
        # HBM3 at 5.3 TB/s; FP16/BF16 matrix 1,307.4 TF dense, FP8 2,614.9 TF, INT8 2,614.9
        # TOPS dense; 7 Infinity Fabric links, 896 GB/s aggregate bidirectional (448 per
        # direction). ROCm, so vLLM's ROCm build; compute capability is NVIDIA's notion: "".
        _gpu(
            "MI300X", 192, 5300, 1307.4, 1307.4, 2614.9, 2614.9, 448, "infinity-fabric", "", "pcie5"
        ),
    )
}


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """An interconnect class: bandwidth per GPU per direction, and one-way latency per hop.

    `intra_node` says whether the link can join GPUs in one node (NVLink, PCIe) or joins nodes
    (network). `fast` links are where tensor parallelism is allowed by default.
    """

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    intra_node: bool
    description: str
    # True where a cluster file measured this very link (the figure above is then the
    # measurement, and wins over a calibrated link class; see flexpipe/perf/step_time.py).
    bandwidth_measured: bool = False
    latency_measured: bool = False


def _link(
    name: str, gb_per_s: float, latency_us: float, intra_node: bool, description: str
) -> LinkSpec:
    return LinkSpec(name, gb_per_s * GB, latency_us * 1e-6, intra_node, description)


# Latencies are per collective step as NCCL reports for small messages (nccl-tests busbw at
# 8 B), rounded: ~3 us on NVLink, ~8 us over PCIe, ~6 us over InfiniBand (RDMA), ~12 us over
# RoCE, ~30-50 us over TCP Ethernet.
LINKS: dict[str, LinkSpec] = {
    lk.name: lk
    for lk in (
        # NVLink 2.0 (V100): 6 links x 25 GB/s per direction = 150 GB/s (V100 datasheet).
        _link("nvlink2", 150, 3, True, "NVLink 2.0 (Volta)"),
        # NVLink 3.0 (A100): 12 links x 25 GB/s = 300 GB/s per direction (A100 datasheet).
        _link("nvlink3", 300, 3, True, "NVLink 3.0 (Ampere)"),
        # NVLink 3.0 bridge between two PCIe cards (A40, RTX A6000): 4 links, 112.5 GB/s
        # bidirectional (A40 datasheet) = 56.25 GB/s per direction.
        _link("nvlink3-bridge", 56.25, 3, True, "NVLink 3.0 bridge (A40 pairs)"),
        # NVLink 4.0 (H100/H200): 18 links x 25 GB/s = 450 GB/s per direction (H100 datasheet).
        _link("nvlink4", 450, 3, True, "NVLink 4.0 (Hopper)"),
        # NVLink 5.0 (B200): 18 links x 50 GB/s = 900 GB/s per direction (DGX B200 datasheet).
        _link("nvlink5", 900, 3, True, "NVLink 5.0 (Blackwell)"),
        # AMD Infinity Fabric (MI300X platform): every GPU of the 8-GPU board reaches each other
        # over one of its 7 links (64 GB/s per direction each); a ring or all-to-all over all
        # seven reaches 448 GB/s per direction (MI300X data sheet). RCCL small-message
        # latency is reported at ~5 us.
        _link("infinity-fabric", 448, 5, True, "AMD Infinity Fabric (MI300X 8-GPU mesh)"),
        # NVSwitch (HGX A100 / HGX H100): every GPU reaches every other at its full NVLink rate
        # (NVIDIA HGX platform brief); a switch hop adds ~1 us.
        _link("nvswitch-a100", 300, 4, True, "NVSwitch gen 2 (HGX A100)"),
        _link("nvswitch-h100", 450, 4, True, "NVSwitch gen 3 (HGX H100/H200)"),
        _link("nvswitch-b200", 900, 4, True, "NVSwitch gen 4 (HGX B200)"),
        # PCI-SIG: gen4 x16 = 31.5 GB/s per direction raw, ~25 GB/s achieved by NCCL p2p;
        # gen5 x16 = 63 GB/s raw, ~50 GB/s achieved.
        _link("pcie4", 25, 8, True, "PCIe gen4 x16 under one switch"),
        _link("pcie5", 50, 8, True, "PCIe gen5 x16 under one switch"),
        # "Through the CPU" (nvidia-smi topo SYS/NODE): P2P disabled or crossing the socket
        # interconnect; NCCL's SHM path typically reaches 10-12 GB/s.
        _link("cpu", 10, 15, True, "PCIe through the CPU / across sockets (SYS)"),
        # InfiniBand HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s (NVIDIA ConnectX datasheets).
        _link("ib200", 25, 6, False, "InfiniBand HDR 200 Gb/s"),
        _link("ib400", 50, 6, False, "InfiniBand NDR 400 Gb/s"),
        # RoCE v2 at 100 / 200 Gb/s = 12.5 / 25 GB/s (ConnectX-6 datasheet).
        _link("roce100", 12.5, 12, False, "RoCE v2 100 Gb/s"),
        _link("roce200", 25, 12, False, "RoCE v2 200 Gb/s"),
        # Ethernet with TCP sockets (NCCL socket transport): 25 GbE = 3.125 GB/s,
        # 100 GbE = 12.5 GB/s line rate.
        _link("eth25", 3.125, 50, False, "25 GbE (TCP)"),
        _link("eth100", 12.5, 30, False, "100 GbE (TCP)"),
    )
}

# Short names users type: `--link nvlink`, `--link 25gbe`.
LINK_ALIASES: dict[str, str] = {
    "nvlink": "nvlink3",
    "xgmi": "infinity-fabric",
    "nvswitch": "nvswitch-a100",
    "pcie": "pcie4",
    "pcie-gen4": "pcie4",
    "pcie-gen5": "pcie5",
    "sys": "cpu",
    "through-cpu": "cpu",
    "hdr": "ib200",
    "ndr": "ib400",
    "25gbe": "eth25",
    "100gbe": "eth100",
    "ethernet": "eth25",
}

# Storage a node reads weights from, where the cluster file says nothing (docs/cluster-file.md):
# a PCIe gen4 x4 NVMe SSD reads ~7 GB/s sequentially (Samsung 990 PRO datasheet: 7,450 MB/s;
# Samsung PM9A3 U.2 datasheet: 6,900 MB/s); network storage is read at the line rate of a
# 25 GbE NIC (3.125 GB/s).
DEFAULT_LOCAL_NVME_BYTES_PER_S = 7.0 * GB
DEFAULT_NETWORK_STORAGE_BYTES_PER_S = 3.125 * GB
# Host RAM, where the cluster file says nothing: twice the node's GPU memory. GPU servers
# carry more (NVIDIA DGX H100 datasheet: 2 TB for 8 x 80 GB; DGX A100: 1 TB for 8 x 40 GB or
# 2 TB for 8 x 80 GB); twice is the low end of what such servers ship with.
DEFAULT_HOST_RAM_PER_GPU_MEMORY = 2.0

# Links at or above this bandwidth count as "fast": tensor parallelism may span them.
DEFAULT_FAST_LINK_BYTES_PER_S = 100 * GB


class CatalogError(ValueError):
    """An unknown GPU or link name; the message lists what is known."""


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-")


_GPU_BY_KEY = {_normalise(n): g for n, g in GPUS.items()}


def gpu_spec(name: str) -> GpuSpec:
    """Look up a GPU by catalog name, case-insensitively (`a100-80g-sxm`)."""
    try:
        return _GPU_BY_KEY[_normalise(name)]
    except KeyError:
        raise CatalogError(f"unknown GPU type {name!r}; known: {', '.join(sorted(GPUS))}") from None


def link_spec(name: str) -> LinkSpec:
    """Look up a link class by catalog name or alias (`nvlink3`, `25gbe`, `ib400`)."""
    key = _normalise(name)
    key = LINK_ALIASES.get(key, key)
    try:
        return LINKS[key]
    except KeyError:
        known = sorted([*LINKS, *LINK_ALIASES])
        raise CatalogError(f"unknown link {name!r}; known: {', '.join(known)}") from None
