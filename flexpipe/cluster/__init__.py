"""Inventory: one home for what a cluster has, and every source of it.

- `model`: the description (`Cluster`, `Node`, `Gpu`, links), immutable, O(1) lookups;
- `topology`: which link two GPUs or nodes talk over; placements over concrete GPUs;
- `parse`: the YAML cluster file, with file-and-line errors (docs/cluster-file.md);
- `generate`: large fragmented clusters for the planner and the simulator;
- `nvml`: this machine's GPUs and topology through NVML (`flexpipe discover`);
- `ray_inventory`: the nodes and GPUs of a Ray cluster (`flexpipe discover --ray`).

Each source gives the same `Cluster`. The sources that do I/O are imported by their module
name (`from flexpipe.cluster.nvml import read_inventory`), not re-exported here.
"""

from flexpipe.cluster.errors import ClusterError
from flexpipe.cluster.model import Cluster, Gpu, GpuGroupLink, NetworkLink, Node, NodePairLink
from flexpipe.cluster.parse import load_cluster, parse_bytes, parse_cluster, parse_cluster_yaml
from flexpipe.cluster.topology import DEFAULT_INTRA_NODE_LINK, DEFAULT_NETWORK, placement_on

__all__ = [
    "DEFAULT_INTRA_NODE_LINK",
    "DEFAULT_NETWORK",
    "Cluster",
    "ClusterError",
    "Gpu",
    "GpuGroupLink",
    "NetworkLink",
    "Node",
    "NodePairLink",
    "load_cluster",
    "parse_bytes",
    "parse_cluster",
    "parse_cluster_yaml",
    "placement_on",
]
