"""GPUs that come and go: what changed between two views of the cluster, and the admin's
overrides (`flexpipe cluster occupy|release`) laid over the cluster file.

Pure: every function takes `now_s` (on the clock of the cluster's `free_until_s`; the live
controller uses unix seconds) and returns new values; nothing reads a clock or does I/O.

- `diff(old, new, now_s)` lists what the controller must react to, one `ResourceEvent` per GPU
  and change, most urgent first: `lost` (gone from the file, with its node or alone) and
  `occupied` (others hold more of its memory) must be vacated now; `reclaim` (a `free_until_s`
  set or moved earlier) before `deadline_s`; `extended` (a lease lifted or moved later),
  `freed` (others released memory) and `joined` (a new GPU or node) are capacity to re-plan on.
- `Overrides` (GPU -> `Occupation`: owner, since, until) and `apply(cluster, overrides, now_s)`:
  an occupied GPU looks fully used by its owner until its `until_s`, then free again.
- `Resources`: the cluster file, the overrides and the cluster as free for us now (`effective`,
  what the planner and the shift policy read). Every change returns the new `Resources` and
  the events of `diff(old effective, new effective)`, so the file, the admin API and the
  passing of time report through one path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from flexpipe.cluster import Cluster, Gpu
from flexpipe.hardware import GiB

__all__ = [
    "DEFAULT_OWNER",
    "EventKind",
    "Occupation",
    "Overrides",
    "ResourceError",
    "ResourceEvent",
    "Resources",
    "UnknownGpuError",
    "apply",
    "diff",
]

DEFAULT_OWNER = "admin"  # who holds a GPU occupied through the admin API without an owner


class ResourceError(ValueError):
    """A change the admin API refuses (bad until, GPU not occupied, ...): HTTP 400."""


class UnknownGpuError(ResourceError):
    """A GPU id the cluster does not have: HTTP 404."""


class EventKind(StrEnum):
    """What happened to a GPU, most urgent first (the order `diff` sorts by)."""

    LOST = "lost"  # gone from the cluster (alone or with its node): vacate now
    OCCUPIED = "occupied"  # others hold more of its memory: what no longer fits moves now
    RECLAIM = "reclaim"  # free_until_s set or moved earlier: vacate before deadline_s
    EXTENDED = "extended"  # free_until_s lifted or moved later: a planned vacate may stop
    FREED = "freed"  # others released memory: room for a larger KV cache or gear
    JOINED = "joined"  # a new GPU (or node): room for more instances


_URGENCY = {kind: i for i, kind in enumerate(EventKind)}


@dataclass(frozen=True, slots=True)
class ResourceEvent:
    """One change to one GPU, with the bytes it concerns and a one-line why.

    `num_bytes`: lost -> the free bytes we had on it; occupied -> bytes others took;
    freed -> bytes others released; joined, reclaim, extended -> the GPU's free bytes now.
    `deadline_s`: by when our work must fit what is left of the GPU (lost, occupied: `at_s`,
    an emergency; reclaim: the new `free_until_s`, a planned vacate); None: nothing must move.
    """

    gpu: str
    node: str
    kind: EventKind
    at_s: float
    num_bytes: float
    deadline_s: float | None
    why: str

    @property
    def grace_s(self) -> float | None:
        """Time left to vacate (0 for an emergency or an overdue reclaim); None: none needed."""
        return None if self.deadline_s is None else max(0.0, self.deadline_s - self.at_s)

    @property
    def has_deadline(self) -> bool:
        """Our work on the GPU must fit what is left of it by `deadline_s` (nothing, for lost
        and reclaim; its new free memory, for occupied)."""
        return self.deadline_s is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "node": self.node,
            "kind": self.kind.value,
            "at_s": self.at_s,
            "num_bytes": self.num_bytes,
            "deadline_s": self.deadline_s,
            "why": self.why,
        }

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> ResourceEvent:
        deadline = doc.get("deadline_s")
        return ResourceEvent(
            str(doc["gpu"]),
            str(doc["node"]),
            EventKind(doc["kind"]),
            float(doc["at_s"]),
            float(doc["num_bytes"]),
            None if deadline is None else float(deadline),
            str(doc["why"]),
        )


# --------------------------------------------------------------------------------------------
# diff


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.1f} GiB"


def _who(owner: str | None) -> str:
    return owner if owner else "another tenant"


def _same_device(a: Gpu, b: Gpu) -> bool:
    """Same id, node, CUDA index and type: the same physical GPU (else: lost + joined)."""
    return a.node == b.node and a.index == b.index and a.type == b.type


def _event(
    gpu: Gpu, kind: EventKind, now_s: float, num_bytes: float, deadline_s: float | None, why: str
) -> ResourceEvent:
    return ResourceEvent(gpu.id, gpu.node, kind, now_s, num_bytes, deadline_s, f"{gpu.id}: {why}")


def _time(t_s: float) -> str:
    """A `free_until_s` as written, plus the UTC time when it looks like unix seconds."""
    if t_s >= 1e9:
        utc = datetime.fromtimestamp(t_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return f"{t_s:.0f} ({utc})"
    return f"{t_s:g}"


def _lease_events(old: Gpu, new: Gpu, now_s: float) -> list[ResourceEvent]:
    before, after = old.free_until_s, new.free_until_s
    if after is not None and (before is None or after < before):
        left_s = after - now_s
        when = f"within {left_s:.0f} s" if left_s > 0 else f"now (overdue by {-left_s:.0f} s)"
        was = "" if before is None else f", was {_time(before)}"
        why = f"reclaimed: free only until {_time(after)}{was}; vacate {when}"
        return [_event(new, EventKind.RECLAIM, now_s, new.free_bytes, after, why)]
    if before is not None and (after is None or after > before):
        until = "indefinitely" if after is None else f"until {_time(after)}"
        why = f"lease extended: free {until} (was until {_time(before)})"
        return [_event(new, EventKind.EXTENDED, now_s, new.free_bytes, None, why)]
    return []


def _changes(old: Gpu, new: Gpu, now_s: float) -> list[ResourceEvent]:
    events: list[ResourceEvent] = []
    if new.used_bytes > old.used_bytes:
        taken = new.used_bytes - old.used_bytes
        why = (
            f"{_who(new.owner)} took {_gib(taken)} (holds {_gib(new.used_bytes)}, "
            f"{_gib(new.free_bytes)} left free)"
        )
        events.append(_event(new, EventKind.OCCUPIED, now_s, taken, now_s, why))
    elif new.used_bytes < old.used_bytes:
        released = old.used_bytes - new.used_bytes
        why = f"{_who(old.owner)} released {_gib(released)} ({_gib(new.free_bytes)} free now)"
        events.append(_event(new, EventKind.FREED, now_s, released, None, why))
    return events + _lease_events(old, new, now_s)


def diff(old: Cluster, new: Cluster, now_s: float) -> list[ResourceEvent]:
    """What changed from `old` to `new` that the controller must act on, most urgent first
    (then in file order). Links and names are not compared: only GPUs, their memory and leases.
    A GPU whose node, index or type changed is reported lost and joined (another device)."""
    events: list[ResourceEvent] = []
    old_by_id = {g.id: g for g in old.gpus}
    new_ids = set(new.gpu_ids)
    new_nodes = {n.name for n in new.nodes}
    old_nodes = {n.name for n in old.nodes}
    for gpu in old.gpus:
        if gpu.id in new_ids:
            continue
        gone = (
            f"node {gpu.node} is gone from the cluster"
            if gpu.node not in new_nodes
            else "gone from the cluster"
        )
        events.append(_event(gpu, EventKind.LOST, now_s, gpu.free_bytes, now_s, gone))
    for gpu in new.gpus:
        before = old_by_id.get(gpu.id)
        if before is not None and _same_device(before, gpu):
            events.extend(_changes(before, gpu, now_s))
            continue
        if before is not None:
            why = (
                f"replaced: was {before.type} index {before.index} on {before.node}, now "
                f"{gpu.type} index {gpu.index} on {gpu.node}"
            )
            events.append(_event(before, EventKind.LOST, now_s, before.free_bytes, now_s, why))
        where = f"new node {gpu.node}" if gpu.node not in old_nodes else f"node {gpu.node}"
        why = f"joined ({gpu.type} on {where}, {_gib(gpu.free_bytes)} free)"
        events.append(_event(gpu, EventKind.JOINED, now_s, gpu.free_bytes, None, why))
    events.sort(key=lambda e: _URGENCY[e.kind])  # stable: file order within a kind
    return events


# --------------------------------------------------------------------------------------------
# Overrides


@dataclass(frozen=True, slots=True)
class Occupation:
    """A GPU taken through the admin API: by `owner`, from `since_s` until `until_s` (None:
    until released)."""

    owner: str
    since_s: float
    until_s: float | None = None

    def active(self, now_s: float) -> bool:
        return self.until_s is None or now_s < self.until_s

    def to_json(self) -> dict[str, Any]:
        return {"owner": self.owner, "since_s": self.since_s, "until_s": self.until_s}


def _check_until(until_s: float | None, now_s: float) -> None:
    if until_s is None:
        return
    if (
        isinstance(until_s, bool)
        or not isinstance(until_s, int | float)
        or not math.isfinite(until_s)
    ):
        raise ResourceError(f"until_s must be unix seconds or null, got {until_s!r}")
    if until_s <= now_s:
        raise ResourceError(f"until_s {until_s:g} is not in the future (now {now_s:g})")


@dataclass(frozen=True)
class Overrides:
    """The admin's occupations, by GPU id. Immutable: `occupy` / `release` return copies."""

    occupied: Mapping[str, Occupation] = field(default_factory=dict)  # gpu id -> occupation

    def active(self, now_s: float) -> dict[str, Occupation]:
        """The occupations still in force at `now_s`."""
        return {g: o for g, o in self.occupied.items() if o.active(now_s)}

    def occupy(
        self, gpus: Iterable[str], owner: str, until_s: float | None, now_s: float
    ) -> Overrides:
        """Occupy `gpus` (again: a new owner and until replace the old ones)."""
        _check_until(until_s, now_s)
        if not owner.strip():
            raise ResourceError("owner must not be empty")
        taken = dict(self.occupied)
        for gpu in gpus:
            taken[gpu] = Occupation(owner.strip(), now_s, until_s)
        return Overrides(taken)

    def release(self, gpus: Iterable[str]) -> Overrides:
        drop = set(gpus)
        return Overrides({g: o for g, o in self.occupied.items() if g not in drop})

    def expired(self, now_s: float) -> Overrides:
        """A copy without the occupations that ran out by `now_s`."""
        return Overrides(self.active(now_s))

    def to_json(self) -> dict[str, Any]:
        """For the store: a restarted controller keeps the admin's occupations."""
        return {gpu: o.to_json() for gpu, o in self.occupied.items()}

    @staticmethod
    def from_json(doc: Mapping[str, Mapping[str, Any]]) -> Overrides:
        return Overrides(
            {
                str(gpu): Occupation(
                    str(o["owner"]),
                    float(o["since_s"]),
                    None if o.get("until_s") is None else float(o["until_s"]),
                )
                for gpu, o in doc.items()
            }
        )

    def next_expiry_s(self, now_s: float) -> float | None:
        """The earliest `until_s` after `now_s`: when `apply` changes next by itself."""
        ends = [o.until_s for o in self.occupied.values() if o.until_s is not None]
        later = [t for t in ends if t > now_s]
        return min(later) if later else None


def apply(cluster: Cluster, overrides: Overrides, now_s: float) -> Cluster:
    """The cluster with every occupation active at `now_s` laid over it: the GPU fully used by
    the occupation's owner. Occupations of GPUs the cluster no longer has are ignored."""
    out = cluster
    known = set(cluster.gpu_ids)
    for gpu_id, occupation in overrides.active(now_s).items():
        if gpu_id in known:
            gpu = out.gpu(gpu_id)
            out = out.with_gpu(gpu_id, used_bytes=gpu.capacity_bytes, owner=occupation.owner)
    return out


# --------------------------------------------------------------------------------------------
# Resources: file + overrides -> effective


def _check_known(cluster: Cluster, gpus: Iterable[str]) -> list[str]:
    """The ids, de-duplicated in order; unknown ones are one UnknownGpuError naming them all."""
    ids = list(dict.fromkeys(gpus))
    if not ids:
        raise ResourceError("no GPUs given")
    known_ids = set(cluster.gpu_ids)
    unknown = [g for g in ids if g not in known_ids]
    if unknown:
        known = list(cluster.gpu_ids)
        shown = ", ".join(known[:16]) + (f", ... ({len(known)} in all)" if len(known) > 16 else "")
        names = ", ".join(repr(g) for g in unknown)
        raise UnknownGpuError(f"unknown GPU {names} in cluster {cluster.name}; known: {shown}")
    return ids


@dataclass(frozen=True)
class Resources:
    """The GPUs as free for us now. `file`: the cluster file as last read; `overrides`: the
    admin's occupations; `effective`: `apply(file, overrides, at_s)`, what the planner and the
    shift policy see. Every method returns the new Resources and the events between the two
    effective clusters."""

    file: Cluster
    overrides: Overrides
    at_s: float
    effective: Cluster = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "effective", apply(self.file, self.overrides, self.at_s))

    @staticmethod
    def of(cluster: Cluster, now_s: float, overrides: Overrides | None = None) -> Resources:
        return Resources(cluster, overrides or Overrides(), now_s)

    def _to(
        self, file: Cluster, overrides: Overrides, now_s: float
    ) -> tuple[Resources, list[ResourceEvent]]:
        new = Resources(file, overrides.expired(now_s), now_s)
        return new, diff(self.effective, new.effective, now_s)

    def file_changed(self, cluster: Cluster, now_s: float) -> tuple[Resources, list[ResourceEvent]]:
        """The cluster file was read again."""
        return self._to(cluster, self.overrides, now_s)

    def tick(self, now_s: float) -> tuple[Resources, list[ResourceEvent]]:
        """Time passed: occupations that ran out free their GPUs (`freed` events)."""
        return self._to(self.file, self.overrides, now_s)

    def occupy(
        self, gpus: Iterable[str], owner: str | None, until_s: float | None, now_s: float
    ) -> tuple[Resources, list[ResourceEvent]]:
        """`flexpipe cluster occupy`: the GPUs are fully used by `owner` until `until_s`."""
        ids = _check_known(self.file, gpus)
        overrides = self.overrides.occupy(ids, owner or DEFAULT_OWNER, until_s, now_s)
        return self._to(self.file, overrides, now_s)

    def release(self, gpus: Iterable[str], now_s: float) -> tuple[Resources, list[ResourceEvent]]:
        """`flexpipe cluster release`: end occupations made through the admin API. A GPU not
        occupied that way is an error (memory a tenant holds in the file is the file's)."""
        ids = _check_known(self.file, gpus)
        active = self.overrides.active(now_s)
        idle = [g for g in ids if g not in active]
        if idle:
            names = ", ".join(repr(g) for g in idle)
            occupied = ", ".join(active) or "none"
            raise ResourceError(
                f"GPU {names} is not occupied through the admin API (occupied: {occupied}); "
                "memory a tenant holds in the cluster file changes with the file"
            )
        return self._to(self.file, self.overrides.release(ids), now_s)

    def next_change_s(self) -> float | None:
        """When `tick` will next report something by itself (an occupation running out)."""
        return self.overrides.next_expiry_s(self.at_s)

    def to_json(self) -> dict[str, Any]:
        """The resources part of `GET /admin/status`: every GPU as free for us, with its
        occupation (if any)."""
        active = self.overrides.active(self.at_s)
        return {
            "cluster": self.file.name,
            "source": self.file.source,
            "at_s": self.at_s,
            "gpus": [
                {
                    "id": g.id,
                    "node": g.node,
                    "type": g.type,
                    "capacity_bytes": g.capacity_bytes,
                    "used_bytes": g.used_bytes,
                    "free_bytes": g.free_bytes,
                    "owner": g.owner,
                    "free_until_s": g.free_until_s,
                    "occupied": active[g.id].to_json() if g.id in active else None,
                }
                for g in self.effective.gpus
            ],
        }
