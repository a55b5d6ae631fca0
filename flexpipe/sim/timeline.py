"""A scenario's resource timeline: what other tenants and the hardware do to the cluster.

```yaml
resources:
  - {at_s: 600, release: [gpu1]}                      # the other tenant leaves gpu1
  - {at_s: 900, occupy: [gpu3], owner: tenant-c}      # taken whole (or used_gib: 40)
  - {at_s: 1200, reclaim: [gpu0], notice_s: 300}      # free only until 1500: vacate before
  - {at_s: 1800, fail: [gpu2]}                        # lost without notice
  - {at_s: 1800, fail_node: node2}                    # a whole node lost
  - {at_s: 2400, join: {node: node1, gpus: [{id: gpu4, type: A100-80G-SXM, index: 2}],
                        links: [{gpus: [gpu1, gpu2, gpu4], link: nvlink3}]}}
```

Each event changes the cluster *file* (what `flexpipe controller` would read again), a pure
`apply_event(cluster, event)`. A reclaim sets `free_until_s` on its GPUs and, at that time,
the owner takes them whole (a follow-up `occupy` event). A failed GPU leaves the cluster:
instances on it die at once and their requests continue elsewhere by recompute. `join` adds
GPUs in the cluster file's syntax to a node (a new one when `node` is not in the cluster, then
with its `network`); its `links` replace the node's. The
simulator hands each new file to the controller's `Resources.file_changed`, the same path
the live controller's file watch takes, so the policy sees the same events.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from flexpipe.cluster import Cluster, ClusterError, parse_cluster
from flexpipe.cluster.errors import exceeds
from flexpipe.hardware import CatalogError, GiB, GpuSpec, gpu_spec

__all__ = ["EventKind", "TimelineError", "TimelineEvent", "apply_event", "parse_timeline"]

EventKind = Literal["occupy", "release", "reclaim", "fail", "join"]
_KINDS = ("occupy", "release", "reclaim", "fail", "fail_node", "join")
_KEYS = {"at_s", "owner", "used_gib", "notice_s", "note", *_KINDS}


class TimelineError(ValueError):
    """A timeline entry that cannot be applied; one readable line."""


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    at_s: float
    kind: EventKind
    gpus: tuple[str, ...]
    owner: str = "another tenant"
    used_bytes: float | None = None  # occupy: bytes the owner holds (None: the whole GPU)
    notice_s: float = 0.0  # reclaim: the GPUs are free for this long more
    note: str = ""
    join: dict[str, Any] | None = None  # join: {node, gpus, links?, network?} (file syntax)

    def describe(self) -> str:
        gpus = ",".join(self.gpus)
        if self.kind == "occupy":
            held = "whole" if self.used_bytes is None else f"{self.used_bytes / GiB:g} GiB"
            return f"{self.owner} takes {gpus} ({held})"
        if self.kind == "release":
            return f"the other tenant leaves {gpus}"
        if self.kind == "reclaim":
            return f"{self.owner} reclaims {gpus} in {self.notice_s:g} s"
        if self.kind == "join":
            return f"{gpus} join"
        return f"{gpus} lost without notice"

    def to_dict(self) -> dict[str, Any]:
        return {
            "at_s": self.at_s,
            "kind": self.kind,
            "gpus": list(self.gpus),
            "what": self.note or self.describe(),
        }


def parse_timeline(value: Any, cluster: Cluster, where: str) -> tuple[TimelineEvent, ...]:
    """The `resources:` list, checked against the cluster; reclaims get their follow-up
    `occupy` at the end of the notice. Sorted by time (stable)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise TimelineError(f"{where}: expected a list of events")
    out: list[TimelineEvent] = []
    known = set(cluster.gpu_ids)
    specs = {g.id: g.spec for g in cluster.gpus}  # and joined GPUs', as they join
    order = sorted(range(len(value)), key=lambda i: _at(value[i]))
    for i in order:
        doc = value[i]
        place = f"{where}[{i}]"
        if not isinstance(doc, dict):
            raise TimelineError(f"{place}: expected a mapping")
        unknown = sorted(set(doc) - _KEYS)
        if unknown:
            raise TimelineError(f"{place}: unknown key(s) {', '.join(unknown)}")
        kinds = [k for k in _KINDS if k in doc]
        if len(kinds) != 1:
            raise TimelineError(f"{place}: give exactly one of {', '.join(_KINDS)}")
        at = doc.get("at_s")
        if isinstance(at, bool) or not isinstance(at, int | float) or not 0 <= at < math.inf:
            raise TimelineError(f"{place}: at_s must be a finite number >= 0 (got {at!r})")
        kind = kinds[0]
        join: dict[str, Any] | None = None
        if kind == "join":
            join = doc[kind]
            if not isinstance(join, dict) or "node" not in join or not join.get("gpus"):
                raise TimelineError(f"{place}.join: give node and gpus (cluster-file syntax)")
            gpus = tuple(str(g.get("id")) for g in join["gpus"] if isinstance(g, dict))
            clash = sorted(set(gpus) & known)
            if clash:
                raise TimelineError(f"{place}.join: GPU(s) {clash} are already in the cluster")
            known.update(gpus)
            specs.update(_join_specs(join["gpus"]))
        elif kind == "fail_node":
            try:
                gpus = tuple(g.id for g in cluster.node(str(doc[kind])).gpus)
            except ClusterError as exc:
                raise TimelineError(f"{place}: {exc}") from None
            kind = "fail"
        else:
            raw = doc[kind]
            gpus = tuple(str(g) for g in (raw if isinstance(raw, list) else [raw]))
            bad = [g for g in gpus if g not in known]
            if bad or not gpus:
                raise TimelineError(f"{place}: unknown GPU(s) {bad or '(none)'}")
        owner = str(doc.get("owner", "another tenant"))
        used = _used_bytes(doc.get("used_gib"), gpus, specs, place)
        notice = doc.get("notice_s", 0.0)
        if (
            isinstance(notice, bool)
            or not isinstance(notice, int | float)
            or not (0 <= notice < math.inf)
        ):
            raise TimelineError(f"{place}: notice_s must be a finite number >= 0 (got {notice!r})")
        ev = TimelineEvent(
            float(at),
            cast(EventKind, kind),
            gpus,
            owner,
            used,
            float(notice),
            str(doc.get("note", "")),
            join,
        )
        out.append(ev)
        if kind == "reclaim":
            note = f"{owner} takes {','.join(gpus)} (reclaimed)"
            out.append(TimelineEvent(float(at) + notice, "occupy", gpus, owner, note=note))
    out.sort(key=lambda e: e.at_s)
    check = cluster
    for e in out:  # a join that does not make a valid cluster is an error now, not mid-run
        _check_applies(check, e, where)
        check = apply_event(check, e)
    return tuple(out)


def _check_applies(cluster: Cluster, event: TimelineEvent, where: str) -> None:
    """An event that would do nothing is a mistake in the file, not a no-op: an event on a GPU
    that failed before it, or a release of a GPU nobody holds then."""
    if event.kind == "join":
        return
    present = set(cluster.gpu_ids)
    gone = [g for g in event.gpus if g not in present]
    if gone:
        raise TimelineError(
            f"{where}: {event.describe()} at {event.at_s:g} s: GPU(s) {gone} failed before it"
        )
    if event.kind == "release":
        free = [g for g in event.gpus if cluster.gpu(g).used_bytes <= 0]
        if free:
            raise TimelineError(
                f"{where}: {event.describe()} at {event.at_s:g} s: GPU(s) {free} are not "
                "held by another tenant then (nothing to release)"
            )


def _used_bytes(
    used_gib: Any, gpus: tuple[str, ...], specs: dict[str, GpuSpec], place: str
) -> float | None:
    """An occupy's `used_gib` in bytes (None: the whole GPU), within every GPU's memory (the
    cluster file's own check, `flexpipe.cluster.errors.exceeds`)."""
    if used_gib is None:
        return None
    if (
        isinstance(used_gib, bool)
        or not isinstance(used_gib, int | float)
        or not (0 <= used_gib < math.inf)
    ):
        raise TimelineError(f"{place}: used_gib must be a finite number >= 0 (got {used_gib!r})")
    used = float(used_gib) * GiB
    for gid in gpus:
        spec = specs.get(gid)
        if spec is not None and used > spec.memory_bytes:
            raise TimelineError(f"{place}: used_gib on {gid}: {exceeds(used, spec)}")
    return used


def _join_specs(gpus: list[Any]) -> dict[str, GpuSpec]:
    """The joining GPUs' specs (an unknown type is the join's own error, reported later)."""
    out: dict[str, GpuSpec] = {}
    for g in gpus:
        if isinstance(g, dict):
            with contextlib.suppress(CatalogError):
                out[str(g.get("id"))] = gpu_spec(str(g.get("type")))
    return out


def _at(doc: Any) -> float:
    at = doc.get("at_s") if isinstance(doc, dict) else None
    return float(at) if isinstance(at, int | float) and not isinstance(at, bool) else 0.0


def _joined(cluster: Cluster, join: dict[str, Any]) -> Cluster:
    doc = cluster.to_doc()
    node = next((n for n in doc["nodes"] if n["name"] == join["node"]), None)
    if node is None:
        node = {"name": join["node"], "gpus": []}
        if "network" in join:
            node["network"] = join["network"]
        doc["nodes"].append(node)
    node["gpus"] = [*node["gpus"], *join["gpus"]]
    if "links" in join:
        node["links"] = join["links"]
    try:
        return parse_cluster(doc, cluster.source)
    except ClusterError as exc:
        raise TimelineError(f"join {join['node']}: {exc}") from None


def _without(cluster: Cluster, gpus: Sequence[str]) -> Cluster:
    """The cluster with `gpus` gone (a node left without GPUs is gone too)."""
    drop = set(gpus)
    doc = cluster.to_doc()
    nodes = []
    for node in doc["nodes"]:
        node["gpus"] = [g for g in node["gpus"] if g["id"] not in drop]
        if not node["gpus"]:
            continue
        links = []
        for lk in node.get("links", []):
            lk["gpus"] = [g for g in lk["gpus"] if g not in drop]
            if len(lk["gpus"]) >= 2:
                links.append(lk)
        if links:
            node["links"] = links
        else:
            node.pop("links", None)
        nodes.append(node)
    names = {n["name"] for n in nodes}
    doc["nodes"] = nodes
    if "node_links" in doc:
        doc["node_links"] = [p for p in doc["node_links"] if set(p["nodes"]) <= names]
        if not doc["node_links"]:
            doc.pop("node_links")
    return parse_cluster(doc, cluster.source)


def apply_event(cluster: Cluster, event: TimelineEvent) -> Cluster:
    """The cluster file after `event`. GPUs already gone are skipped."""
    if event.kind == "join":
        assert event.join is not None
        return _joined(cluster, event.join)
    present = [g for g in event.gpus if g in set(cluster.gpu_ids)]
    if event.kind == "fail":
        return _without(cluster, present) if present else cluster
    out = cluster
    for gid in present:
        gpu = out.gpu(gid)
        if event.kind == "occupy":
            held = gpu.capacity_bytes if event.used_bytes is None else event.used_bytes
            out = out.with_gpu(
                gid, used_bytes=min(held, gpu.capacity_bytes), owner=event.owner, free_until_s=None
            )
        elif event.kind == "release":
            out = out.with_gpu(gid, used_bytes=0.0, owner=None, free_until_s=None)
        else:  # reclaim
            out = out.with_gpu(gid, free_until_s=event.at_s + event.notice_s)
    return out
