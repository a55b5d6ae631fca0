"""Cluster descriptions: nodes, their GPUs as they really are (partly used by other tenants,
free only for a while) and the links between them, read from YAML and validated.

The file format is documented in docs/cluster-file.md. In short:

```yaml
name: fragmented-4gpu
defaults: {network: eth25, intra_node_link: cpu}
nodes:
  - name: node1
    network: eth25
    gpus:
      - {id: gpu1, type: A100-80G-SXM, used_gib: 40, owner: tenant-b}
      - {id: gpu2, type: A100-80G-SXM}
    links:
      - {gpus: [gpu1, gpu2], link: nvlink3, measured_gb_per_s: 240}
node_links:
  - {nodes: [node1, node2], link: eth25}
```

Effective links (what the performance model sees) are catalog `LinkSpec`s from
flexpipe.hardware with any measured bandwidth applied: this module never invents a link
speed. Defaults: two GPUs of one node with no declared group between them talk "through the
CPU" (`cpu`); two nodes with no declared `node_links` entry talk over the slower of their two
`network`s; a node without `network` uses the cluster's default network (`eth25`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from flexpipe.gears.gear import GearError, GpuSlot, Placement, Stage, even_layer_split
from flexpipe.hardware import (
    DEFAULT_FAST_LINK_BYTES_PER_S,
    GB,
    CatalogError,
    GiB,
    GpuSpec,
    LinkSpec,
    gpu_spec,
    link_spec,
)

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

# GPUs of one node with no declared group link between them: PCIe through the CPU (the
# safe assumption: `nvidia-smi topo -m` shows SYS/NODE unless a switch or NVLink is present).
DEFAULT_INTRA_NODE_LINK = "cpu"
# Nodes without a declared network: plain 25 GbE, the slowest common data-center NIC.
DEFAULT_NETWORK = "eth25"


class ClusterError(ValueError):
    """A cluster file (or a change to a cluster) that does not make sense.

    `errors` holds one line per problem: `file: place: reason`; the message is those lines.
    """

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


# --------------------------------------------------------------------------------------------
# Types


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


def _effective(
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
        return _effective(self.link, self.measured_gb_per_s, self.measured_latency_us)


@dataclass(frozen=True, slots=True)
class NetworkLink:
    """A node's network (its NIC class), optionally with a measured bandwidth."""

    link: str  # canonical catalog link name
    measured_gb_per_s: float | None = None
    measured_latency_us: float | None = None  # one-way, per hop (e.g. nccl-tests at 8 B)

    @property
    def spec(self) -> LinkSpec:
        return _effective(self.link, self.measured_gb_per_s, self.measured_latency_us)


@dataclass(frozen=True, slots=True)
class NodePairLink:
    """The network between two particular nodes, overriding their `network`s."""

    nodes: tuple[str, str]
    link: str
    measured_gb_per_s: float | None = None
    measured_latency_us: float | None = None  # one-way, per hop (e.g. nccl-tests at 8 B)

    @property
    def spec(self) -> LinkSpec:
        return _effective(self.link, self.measured_gb_per_s, self.measured_latency_us)


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    gpus: tuple[Gpu, ...]
    network: NetworkLink
    links: tuple[GpuGroupLink, ...] = ()
    note: str | None = None


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
        gpu_pairs: dict[tuple[str, str], LinkSpec] = {}
        for node in self.nodes:
            for group in node.links:
                spec = group.spec
                for i, a in enumerate(group.gpus):
                    for b in group.gpus[i + 1 :]:
                        key = _pair(a, b)
                        old = gpu_pairs.get(key)
                        # A pair in several groups (an NVLink bridge under a PCIe switch)
                        # uses the fastest of them.
                        if old is None or spec.bandwidth_bytes_per_s > old.bandwidth_bytes_per_s:
                            gpu_pairs[key] = spec
        node_pairs = {_pair(*p.nodes): p.spec for p in self.node_links}
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
            raise ClusterError([f"{self.source}: {_unknown('GPU', gpu_id, self._gpus)}"]) from None

    def node(self, name: str) -> Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise ClusterError([f"{self.source}: {_unknown('node', name, self._nodes)}"]) from None

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
        declared = self._node_pairs.get(_pair(node_a, node_b))
        if declared is not None:
            return declared
        a, b = self.node(node_a).network.spec, self.node(node_b).network.spec
        return a if a.bandwidth_bytes_per_s <= b.bandwidth_bytes_per_s else b

    def link_between(self, gpu_a: str, gpu_b: str) -> LinkSpec:
        """The effective link between two different GPUs (measured bandwidth applied)."""
        a, b = self.gpu(gpu_a), self.gpu(gpu_b)
        if a.id == b.id:
            raise ClusterError([f"{self.source}: no link between {gpu_a!r} and itself"])
        if a.node != b.node:
            return self.network_between(a.node, b.node)
        return self._gpu_pairs.get(_pair(a.id, b.id), self._intra_default)

    def slowest_link(self, gpu_ids: Iterable[str]) -> LinkSpec:
        """The slowest effective link between any two of `gpu_ids` (at least two GPUs): what
        a ring all-reduce over them is paced by."""
        ids = list(gpu_ids)
        if len(ids) < 2:
            raise ClusterError([f"{self.source}: a link needs two GPUs; got {ids}"])
        slowest: LinkSpec | None = None
        for i, a in enumerate(ids):
            for b in ids[i + 1 :]:
                spec = self.link_between(a, b)
                if slowest is None or spec.bandwidth_bytes_per_s < slowest.bandwidth_bytes_per_s:
                    slowest = spec
        assert slowest is not None
        return slowest

    def fast_domains(
        self, min_bandwidth_bytes_per_s: float = DEFAULT_FAST_LINK_BYTES_PER_S
    ) -> list[tuple[str, ...]]:
        """Split the GPUs into groups joined pairwise by links at least this fast: where
        tensor parallelism may go.

        Every GPU is in exactly one group (a GPU with no fast peer is a group of one). Groups
        are built greedily in file order (a GPU joins the first group whose members it all
        reaches fast), which finds the NVLink islands / NVSwitch nodes exactly; with partial
        meshes it is a good, not an optimal, partition. Largest groups first, then file order.
        Topology only: fully used GPUs are in their groups too (filter on `free_bytes`).
        """
        threshold = min_bandwidth_bytes_per_s
        node_names = [n.name for n in self.nodes]
        # node -> later nodes reached at least this fast (usually none: networks are slow)
        fast_peers = {
            a: [
                b
                for b in node_names[i + 1 :]
                if self.network_between(a, b).bandwidth_bytes_per_s >= threshold
            ]
            for i, a in enumerate(node_names)
        }
        assigned: set[str] = set()
        groups: list[list[str]] = []
        for node in self.nodes:
            for gpu in node.gpus:
                if gpu.id in assigned:
                    continue
                group = [gpu.id]
                assigned.add(gpu.id)
                candidates = [g.id for g in node.gpus] + [
                    g.id for peer in fast_peers[node.name] for g in self._nodes[peer].gpus
                ]
                for cand in candidates:
                    if cand in assigned:
                        continue
                    if all(
                        self.link_between(cand, m).bandwidth_bytes_per_s >= threshold for m in group
                    ):
                        group.append(cand)
                        assigned.add(cand)
                groups.append(group)
        order = {gid: i for i, gid in enumerate(self._gpus)}
        groups.sort(key=lambda g: (-len(g), order[g[0]]))
        return [tuple(g) for g in groups]

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


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def _unknown(kind: str, name: str, known: Mapping[str, object]) -> str:
    names = list(known)
    shown = ", ".join(names[:16]) + (f", ... ({len(names)} in all)" if len(names) > 16 else "")
    return f"unknown {kind} {name!r}; known: {shown}"


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
        raise ClusterError([f"{place}: {_exceeds(gpu.used_bytes, gpu.spec)}"])
    if gpu.free_until_s is not None and gpu.free_until_s < 0:
        raise ClusterError([f"{place}: free_until_s must be >= 0 (got {gpu.free_until_s:g})"])


def _exceeds(used_bytes: float, spec: GpuSpec) -> str:
    return (
        f"{used_bytes / GiB:.1f} GiB used exceeds the {spec.name}'s "
        f"{spec.memory_bytes / GiB:.1f} GiB"
    )


# --------------------------------------------------------------------------------------------
# Parsing and validation

_BYTE_UNITS = {
    "": 1.0,
    "b": 1.0,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2.0**10,
    "mib": 2.0**20,
    "gib": 2.0**30,
    "tib": 2.0**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: str | float) -> float:
    """`"40GiB"`, `"40 GB"`, `"512MiB"` or a number of bytes -> bytes (GB = 1e9, GiB = 2^30)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '40GiB', got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    match = _BYTES_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        units = ", ".join(u for u in _BYTE_UNITS if u)
        raise ValueError(f"expected a size like '40GiB' (units: {units}), got {value!r}")
    return float(match.group(1)) * _BYTE_UNITS[unit]


_TOP_KEYS = ("name", "description", "defaults", "nodes", "node_links")
_DEFAULT_KEYS = ("network", "intra_node_link")
_NODE_KEYS = ("name", "note", "network", "gpus", "links")
_GPU_KEYS = (
    "id",
    "type",
    "index",
    "used",
    "used_gib",
    "used_bytes",
    "free_until_s",
    "owner",
    "note",
)
_GPU_LINK_KEYS = ("gpus", "link", "measured_gb_per_s", "measured_latency_us")
_NODE_LINK_KEYS = ("nodes", "link", "measured_gb_per_s", "measured_latency_us")
_NETWORK_KEYS = ("link", "measured_gb_per_s", "measured_latency_us")


class _Errors:
    """Collects `place: reason` lines so that one pass reports every mistake."""

    def __init__(self, source: str, lines: Mapping[str, int] | None) -> None:
        self.source = source
        self.lines = lines or {}
        self.items: list[str] = []
        self._order: list[tuple[int, int]] = []  # (line or a big number, arrival)

    def add(self, place: str, reason: str) -> None:
        line = self.lines.get(place)
        where = f" (line {line})" if line is not None else ""
        self._order.append((line if line is not None else 1 << 30, len(self.items)))
        self.items.append(f"{self.source}: {place}: {reason}{where}")

    def raise_if_any(self) -> None:
        """Raise one ClusterError with every problem, in file order where lines are known."""
        if self.items:
            raise ClusterError([self.items[i] for _, i in sorted(self._order)])


def _join(place: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{place}[{key}]"
    return f"{place}.{key}" if place else key


def _mapping(
    value: object, place: str, keys: Sequence[str], errors: _Errors
) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        errors.add(place or "document", f"expected a mapping, got {_kind(value)}")
        return None
    for key in value:
        if key not in keys:
            hint = _closest(str(key), keys)
            errors.add(
                _join(place, str(key)),
                f"unknown key{hint}; allowed here: {', '.join(keys)}",
            )
    return value


def _closest(key: str, keys: Sequence[str]) -> str:
    import difflib

    match = difflib.get_close_matches(key, keys, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _kind(value: object) -> str:
    if value is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), f"a {type(value).__name__}"
    )


def _string(value: object, place: str, errors: _Errors, required: bool = True) -> str | None:
    if value is None:
        if required:
            errors.add(place, "missing")
        return None
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        errors.add(place, f"expected a string, got {_kind(value)}")
        return None
    text = str(value).strip()
    if not text:
        errors.add(place, "must not be empty")
        return None
    return text


def _number(value: object, place: str, errors: _Errors) -> float | None:
    """A number >= 0, or None (absent or bad; bad ones are reported)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        errors.add(place, f"expected a number, got {_kind(value)}")
        return None
    if value < 0:
        errors.add(place, f"must be >= 0 (got {value:g})")
        return None
    return float(value)


def _positive(value: object, place: str, errors: _Errors) -> float | None:
    number = _number(value, place, errors)
    if number is not None and number == 0:
        errors.add(place, "must be > 0")
        return None
    return number


def _list(value: object, place: str, errors: _Errors, required: bool = False) -> list[Any]:
    if value is None:
        if required:
            errors.add(place, "missing")
        return []
    if not isinstance(value, list):
        errors.add(place, f"expected a list, got {_kind(value)}")
        return []
    return value


def _link_name(value: object, place: str, errors: _Errors, intra_node: bool) -> str | None:
    name = _string(value, place, errors)
    if name is None:
        return None
    try:
        spec = link_spec(name)
    except CatalogError as exc:
        errors.add(place, str(exc))
        return None
    if spec.intra_node != intra_node:
        want = "an intra-node link (NVLink, NVSwitch, PCIe, cpu)" if intra_node else "a network"
        errors.add(place, f"{spec.name!r} is not {want}")
        return None
    return spec.name


def _network(value: object, place: str, errors: _Errors) -> NetworkLink | None:
    """`eth25` or `{link: eth25, measured_gb_per_s: 2.8, measured_latency_us: 40}`."""
    if isinstance(value, dict):
        doc = _mapping(value, place, _NETWORK_KEYS, errors)
        assert doc is not None
        link = _link_name(doc.get("link"), _join(place, "link"), errors, intra_node=False)
        measured = _positive(
            doc.get("measured_gb_per_s"), _join(place, "measured_gb_per_s"), errors
        )
        latency = _positive(
            doc.get("measured_latency_us"), _join(place, "measured_latency_us"), errors
        )
        return None if link is None else NetworkLink(link, measured, latency)
    link = _link_name(value, place, errors, intra_node=False)
    return None if link is None else NetworkLink(link)


def _used_bytes(doc: Mapping[str, Any], place: str, errors: _Errors) -> float:
    given = [k for k in ("used", "used_gib", "used_bytes") if doc.get(k) is not None]
    if len(given) > 1:
        errors.add(_join(place, given[1]), f"give only one of {', '.join(given)}")
        return 0.0
    if not given:
        return 0.0
    key = given[0]
    value = doc[key]
    if key == "used_gib":
        gib = _number(value, _join(place, key), errors)
        return 0.0 if gib is None else gib * GiB
    if isinstance(value, str):
        try:
            return parse_bytes(value)
        except ValueError as exc:
            errors.add(_join(place, key), str(exc))
            return 0.0
    number = _number(value, _join(place, key), errors)
    return 0.0 if number is None else number


def _gpu(
    value: object, place: str, node: str, position: int, errors: _Errors
) -> tuple[Gpu | None, str | None]:
    """A GPU (None if it has errors) and its id (if it has one, for reference checks)."""
    doc = _mapping(value, place, _GPU_KEYS, errors)
    if doc is None:
        return None, None
    ok = len(errors.items)
    index_value = doc.get("index", position)
    index = position
    if isinstance(index_value, bool) or not isinstance(index_value, int):
        errors.add(_join(place, "index"), f"expected an integer, got {_kind(index_value)}")
    elif index_value < 0:
        errors.add(_join(place, "index"), f"must be >= 0 (got {index_value})")
    else:
        index = index_value
    gpu_id = _string(doc["id"], _join(place, "id"), errors) if "id" in doc else f"{node}/gpu{index}"
    spec: GpuSpec | None = None
    type_name = _string(doc.get("type"), _join(place, "type"), errors)
    if type_name is not None:
        try:
            spec = gpu_spec(type_name)
        except CatalogError as exc:
            errors.add(_join(place, "type"), str(exc))
    used = _used_bytes(doc, place, errors)
    used_key = next((k for k in ("used", "used_gib", "used_bytes") if k in doc), "used_gib")
    if spec is not None and used > spec.memory_bytes:
        errors.add(_join(place, used_key), _exceeds(used, spec))
    free_until = _number(doc.get("free_until_s"), _join(place, "free_until_s"), errors)
    owner = _string(doc.get("owner"), _join(place, "owner"), errors, required=False)
    note = _string(doc.get("note"), _join(place, "note"), errors, required=False)
    if len(errors.items) > ok or spec is None or gpu_id is None:
        return None, gpu_id
    return Gpu(gpu_id, node, spec.name, index, used, free_until, owner, note), gpu_id


def _group_links(
    node_doc: Mapping[str, Any],
    place: str,
    node: Node,
    gpu_node: Mapping[str, str],
    errors: _Errors,
) -> tuple[GpuGroupLink, ...]:
    """A node's `links`. Members are GPU ids, indexes within the node, or `all`."""
    by_index = {g.index: g.id for g in node.gpus}
    links: list[GpuGroupLink] = []
    for k, link_value in enumerate(_list(node_doc.get("links"), _join(place, "links"), errors)):
        link_place = f"{place}.links[{k}]"
        link_doc = _mapping(link_value, link_place, _GPU_LINK_KEYS, errors)
        if link_doc is None:
            continue
        ok = len(errors.items)
        members: list[str] = []
        raw_members = link_doc.get("gpus")
        if raw_members == "all":
            raw_members = [g.id for g in node.gpus]
        member_docs = _list(raw_members, _join(link_place, "gpus"), errors, True)
        for m, member in enumerate(member_docs):
            member_place = f"{link_place}.gpus[{m}]"
            if isinstance(member, int) and not isinstance(member, bool):
                if member not in by_index:
                    errors.add(member_place, f"no GPU with index {member} in node {node.name!r}")
                    continue
                member = by_index[member]
            member_id = _string(member, member_place, errors)
            if member_id is None:
                continue
            if member_id not in gpu_node:
                errors.add(member_place, f"no GPU {member_id!r} in the cluster")
            elif gpu_node[member_id] != node.name:
                errors.add(
                    member_place,
                    f"GPU {member_id!r} is in node {gpu_node[member_id]!r}, not "
                    f"{node.name!r}; links between nodes go in node_links",
                )
            elif member_id in members:
                errors.add(member_place, f"GPU {member_id!r} is listed twice")
            else:
                members.append(member_id)
        if isinstance(raw_members, list) and len(member_docs) < 2:
            errors.add(_join(link_place, "gpus"), "a link joins at least two GPUs")
        link = _link_name(link_doc.get("link"), _join(link_place, "link"), errors, True)
        measured = _positive(
            link_doc.get("measured_gb_per_s"), _join(link_place, "measured_gb_per_s"), errors
        )
        latency = _positive(
            link_doc.get("measured_latency_us"), _join(link_place, "measured_latency_us"), errors
        )
        if len(errors.items) == ok and link is not None:
            links.append(GpuGroupLink(tuple(members), link, measured, latency))
    return tuple(links)


def parse_cluster(
    doc: object, source: str = "<cluster>", lines: Mapping[str, int] | None = None
) -> Cluster:
    """Validate a cluster document (a dict as YAML gives it) and build the Cluster.

    Every mistake is collected and reported at once in one ClusterError, one line each:
    `source: place: reason`. `lines` maps places to YAML line numbers (load_cluster fills it).
    """
    errors = _Errors(source, lines)
    top = _mapping(doc, "", _TOP_KEYS, errors)
    if top is None:
        errors.raise_if_any()
        raise AssertionError("unreachable")
    name = _string(top.get("name"), "name", errors, required=False) or Path(source).stem
    description = _string(top.get("description"), "description", errors, required=False)
    defaults = _mapping(top.get("defaults") or {}, "defaults", _DEFAULT_KEYS, errors) or {}
    default_network = NetworkLink(DEFAULT_NETWORK)
    if defaults.get("network") is not None:
        default_network = (
            _network(defaults["network"], "defaults.network", errors) or default_network
        )
    intra_default = DEFAULT_INTRA_NODE_LINK
    if defaults.get("intra_node_link") is not None:
        intra_default = (
            _link_name(
                defaults["intra_node_link"], "defaults.intra_node_link", errors, intra_node=True
            )
            or intra_default
        )

    nodes: list[Node] = []
    node_places: dict[str, str] = {}  # node name -> its place, for duplicate messages
    gpu_places: dict[str, str] = {}  # gpu id -> its place
    gpu_node: dict[str, str] = {}  # gpu id -> node name
    # (place, doc, node without links): links are read once every GPU id is known
    pending: list[tuple[str, dict[str, Any], Node]] = []
    node_docs = _list(top.get("nodes"), "nodes", errors, required=True)
    if "nodes" in top and not node_docs and isinstance(top.get("nodes"), list):
        errors.add("nodes", "a cluster needs at least one node")
    for i, node_value in enumerate(node_docs):
        place = f"nodes[{i}]"
        node_doc = _mapping(node_value, place, _NODE_KEYS, errors)
        if node_doc is None:
            continue
        node_name = _string(node_doc.get("name", f"node{i}"), _join(place, "name"), errors)
        if node_name is None:
            continue
        if node_name in node_places:
            errors.add(
                _join(place, "name"),
                f"duplicate node name {node_name!r} (also {node_places[node_name]})",
            )
        else:
            node_places[node_name] = place
        network = default_network
        if node_doc.get("network") is not None:
            network = _network(node_doc["network"], _join(place, "network"), errors) or network
        note = _string(node_doc.get("note"), _join(place, "note"), errors, required=False)

        gpus: list[Gpu] = []
        indexes: dict[int, str] = {}
        gpu_docs = _list(node_doc.get("gpus"), _join(place, "gpus"), errors, required=True)
        for j, gpu_value in enumerate(gpu_docs):
            gpu_place = f"{place}.gpus[{j}]"
            gpu, gpu_id = _gpu(gpu_value, gpu_place, node_name, j, errors)
            if gpu_id is not None:
                if gpu_id in gpu_places:
                    errors.add(
                        _join(gpu_place, "id"),
                        f"duplicate GPU id {gpu_id!r} (also {gpu_places[gpu_id]})",
                    )
                else:
                    gpu_places[gpu_id] = gpu_place
                    gpu_node[gpu_id] = node_name
            if gpu is not None:
                if gpu.index in indexes:
                    errors.add(
                        _join(gpu_place, "index"),
                        f"index {gpu.index} is already used by {indexes[gpu.index]!r} "
                        f"in node {node_name!r}",
                    )
                indexes[gpu.index] = gpu.id
                gpus.append(gpu)

        pending.append((place, node_doc, Node(node_name, tuple(gpus), network, (), note)))

    for place, node_doc, node in pending:
        links = _group_links(node_doc, place, node, gpu_node, errors)
        nodes.append(replace(node, links=links))

    node_links: list[NodePairLink] = []
    seen_pairs: dict[tuple[str, str], str] = {}
    for k, pair_value in enumerate(_list(top.get("node_links"), "node_links", errors)):
        place = f"node_links[{k}]"
        pair_doc = _mapping(pair_value, place, _NODE_LINK_KEYS, errors)
        if pair_doc is None:
            continue
        ok = len(errors.items)
        ends: list[str] = []
        end_docs = _list(pair_doc.get("nodes"), _join(place, "nodes"), errors, True)
        if isinstance(pair_doc.get("nodes"), list) and len(end_docs) != 2:
            errors.add(_join(place, "nodes"), f"expected two node names, got {len(end_docs)}")
        for m, end in enumerate(end_docs[:2]):
            end_name = _string(end, f"{place}.nodes[{m}]", errors)
            if end_name is not None and end_name not in node_places:
                errors.add(f"{place}.nodes[{m}]", f"no node {end_name!r} in the cluster")
            elif end_name is not None:
                ends.append(end_name)
        if len(ends) == 2 and ends[0] == ends[1]:
            errors.add(_join(place, "nodes"), "a node link joins two different nodes")
        elif len(ends) == 2:
            key = _pair(ends[0], ends[1])
            if key in seen_pairs:
                errors.add(
                    _join(place, "nodes"), f"nodes {key} already linked in {seen_pairs[key]}"
                )
            seen_pairs[key] = place
        link = _link_name(pair_doc.get("link"), _join(place, "link"), errors, intra_node=False)
        measured = _positive(
            pair_doc.get("measured_gb_per_s"), _join(place, "measured_gb_per_s"), errors
        )
        latency = _positive(
            pair_doc.get("measured_latency_us"), _join(place, "measured_latency_us"), errors
        )
        if len(errors.items) == ok and link is not None and len(ends) == 2:
            node_links.append(NodePairLink((ends[0], ends[1]), link, measured, latency))

    errors.raise_if_any()
    return Cluster(name, tuple(nodes), tuple(node_links), intra_default, description, source)


# --------------------------------------------------------------------------------------------
# YAML


class _Loader(yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader):  # type: ignore[misc]
    """Safe YAML that refuses duplicate keys (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)  # type: ignore[no-any-return]


def _line_map(node: yaml.Node | None, place: str, out: dict[str, int]) -> None:
    """Place (`nodes[0].gpus[1].type`) -> 1-based line of its value in the YAML text."""
    if node is None:
        return
    if place:
        out[place] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                child = _join(place, str(key_node.value))
                _line_map(value_node, child, out)
                out[child] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _line_map(item, _join(place, i), out)


def parse_cluster_yaml(text: str, source: str = "<cluster>") -> Cluster:
    """Parse YAML text; syntax errors become ClusterError with their line and column."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        doc = None if root is None else loader.construct_document(root)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "document"
        reason = "; ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise ClusterError([f"{source}: {where}: YAML syntax error: {reason}"]) from None
    except yaml.YAMLError as exc:
        raise ClusterError([f"{source}: YAML syntax error: {exc}"]) from None
    finally:
        loader.dispose()
    lines: dict[str, int] = {}
    _line_map(root, "", lines)
    if doc is None:
        raise ClusterError([f"{source}: the file is empty; expected a cluster with nodes"])
    return parse_cluster(doc, source, lines)


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster file; every problem is reported in one ClusterError."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ClusterError([f"{source}: cannot read the file: {reason}"]) from None
    return parse_cluster_yaml(text, source)


# --------------------------------------------------------------------------------------------
# Placements on a cluster


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
    unknown = [g for g in flat if g not in known]
    if unknown:
        ids = {g: None for g in cluster.gpu_ids}
        raise ClusterError([f"{cluster.source}: {_unknown('GPU', g, ids)}" for g in unknown])
    pp = len(stages_ids)
    layers = tuple(layers_per_stage) if layers_per_stage else even_layer_split(num_layers, pp)
    if len(layers) != pp or sum(layers) != num_layers:
        raise GearError(f"layers_per_stage {layers} must give {pp} stages summing to {num_layers}")
    stages = tuple(
        Stage(
            tuple(cluster.slot(g) for g in ids),
            cluster.slowest_link(ids) if len(ids) > 1 else None,
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
