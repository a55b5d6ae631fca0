"""The cluster file: YAML in, a validated `Cluster` out, every mistake reported at once
with its file, place and line (`big.yaml: nodes[3].gpus[1].type: unknown GPU ... (line 40)`).

The format is documented in docs/cluster-file.md. In short:
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

The topology defaults (links not declared) are in `flexpipe.cluster.topology`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from flexpipe.cluster.errors import ClusterError, exceeds
from flexpipe.cluster.model import Cluster, Gpu, GpuGroupLink, NetworkLink, Node, NodePairLink
from flexpipe.cluster.topology import DEFAULT_INTRA_NODE_LINK, DEFAULT_NETWORK, pair
from flexpipe.hardware import CatalogError, GiB, GpuSpec, gpu_spec, link_spec

__all__ = ["load_cluster", "parse_bytes", "parse_cluster", "parse_cluster_yaml"]


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
_NODE_KEYS = (
    "name",
    "note",
    "network",
    "gpus",
    "links",
    "local_nvme_gb_per_s",
    "network_storage_gb_per_s",
    "host_ram_gib",
)
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
        errors.add(_join(place, used_key), exceeds(used, spec))
    free_until = _number(doc.get("free_until_s"), _join(place, "free_until_s"), errors)
    owner = _string(doc.get("owner"), _join(place, "owner"), errors, required=False)
    note = _string(doc.get("note"), _join(place, "note"), errors, required=False)
    if len(errors.items) > ok or spec is None or gpu_id is None:
        return None, gpu_id
    return Gpu(gpu_id, node, spec.name, index, used, free_until, owner, note), gpu_id


def _node_storage(
    doc: Mapping[str, Any], place: str, errors: _Errors
) -> tuple[float | None, float | None, float | None]:
    """(local NVMe GB/s, network storage GB/s, host RAM bytes), each None when not given."""
    out: list[float | None] = []
    for key in ("local_nvme_gb_per_s", "network_storage_gb_per_s", "host_ram_gib"):
        value = doc.get(key)
        out.append(None if value is None else _positive(value, _join(place, key), errors))
    nvme, network, ram_gib = out
    return nvme, network, None if ram_gib is None else ram_gib * GiB


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

        storage = _node_storage(node_doc, place, errors)
        node = Node(node_name, tuple(gpus), network, (), note, *storage)
        pending.append((place, node_doc, node))

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
            key = pair(ends[0], ends[1])
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
