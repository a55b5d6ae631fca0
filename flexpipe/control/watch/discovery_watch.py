"""GPU discovery while running (docs/controller.md, "GPU discovery while running"): when the cluster
came from `flexpipe discover`, the controller asks NVML again every `interval_s` and feeds what
changed into the same resource events as a change of the cluster file (`resources.diff` through
`Resources.file_changed`).

What NVML says is folded into the cluster as last known (`merge`), GPU by GPU, matched by
node-local index:

- memory others hold = NVML's used memory minus what the controller's own engines hold on
  that GPU (their processes, by process group), counted from `min_tenant_bytes` (1 GiB: the
  driver's own few hundred MiB is not a tenant, as `flexpipe discover` has it); a change
  smaller than `min_change_bytes` (1 GiB) is noise (a tenant's allocator breathing) and keeps
  the last value, so that a steady machine yields no event;
- a GPU that NVML no longer lists (fell off the bus, taken away) is held whole: the running
  instance on it is vacated at once, like a GPU lost without notice;
- links and names stay as they were (discovery does not measure bandwidth again).

`poll(now_s)` is the whole logic, synchronous, for exact tests with a fake NVML; `changes()`
runs it in a worker thread (NVML calls block) every `interval_s`, with `sleep` injected.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from typing import Any

from flexpipe.cluster import Cluster
from flexpipe.cluster.nvml import Inventory, read_inventory
from flexpipe.control.watch.poller import Change, changed, check_interval, poll_changes, report_once
from flexpipe.hardware import GiB

__all__ = ["DISCOVERED_MARK", "DiscoveryWatch", "merge", "own_usage_bytes"]

log = logging.getLogger("flexpipe.control.watch.discovery_watch")

# What `flexpipe discover` writes into a cluster's description: such a cluster is watched.
DISCOVERED_MARK = "discovered by `flexpipe discover`"
LOST_OWNER = "not seen by NVML any more"


def own_usage_bytes(nvml: Any, own_pgids: Collection[int]) -> dict[int, float]:
    """GPU index -> bytes the processes of `own_pgids` (our engines' process groups) hold,
    from NVML's compute processes. Processes NVML cannot name are not ours."""
    out: dict[int, float] = {}
    if not own_pgids:
        return out
    nvml.nvmlInit()
    try:
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            try:
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:
                continue
            for proc in procs:
                pid, used = getattr(proc, "pid", None), getattr(proc, "usedGpuMemory", None)
                if not isinstance(pid, int) or not isinstance(used, int | float):
                    continue
                try:
                    mine = os.getpgid(pid) in own_pgids
                except OSError:  # gone, or in another pid namespace
                    mine = False
                if mine:
                    out[index] = out.get(index, 0.0) + float(used)
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
    return out


def merge(
    base: Cluster,
    inv: Inventory,
    own_bytes: Mapping[int, float],
    *,
    min_tenant_bytes: float = 1 * GiB,
    min_change_bytes: float = 1 * GiB,
) -> Cluster:
    """`base` with each local GPU's memory held by others as NVML sees it now (see the
    module docstring). The local GPUs are those of the node named like the inventory, or
    every GPU when the cluster has a single node."""
    nodes = [n for n in base.nodes if n.name == inv.node] or (
        list(base.nodes) if len(base.nodes) == 1 else []
    )
    seen = {g.index: g for g in inv.gpus}
    out = base
    for node in nodes:
        for gpu in node.gpus:
            found = seen.get(gpu.index)
            if found is None:
                if gpu.used_bytes < gpu.capacity_bytes or gpu.owner != LOST_OWNER:
                    out = out.with_used(gpu.id, gpu.capacity_bytes, owner=LOST_OWNER)
                continue
            others = max(0.0, found.used_bytes - own_bytes.get(gpu.index, 0.0))
            if others < min_tenant_bytes:
                others = 0.0
            if (
                gpu.owner == LOST_OWNER
                or abs(others - gpu.used_bytes) >= min_change_bytes
                or (others == 0.0 and gpu.used_bytes > 0.0)
            ):  # back on the bus
                out = out.with_used(gpu.id, others, owner=_owner(others))
    return out


def _owner(used_bytes: float) -> str | None:
    return "other processes (NVML)" if used_bytes > 0 else None


class DiscoveryWatch:
    """The cluster as NVML last showed it, and the changes since."""

    def __init__(
        self,
        base: Cluster,
        interval_s: float = 30.0,
        *,
        nvml: Any = None,
        own_pgids: Callable[[], Collection[int]] = frozenset,
        node: str | None = None,
        read: Callable[[], Inventory] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cluster = base
        self.interval_s = check_interval(interval_s)
        self._nvml = nvml
        self._own_pgids = own_pgids
        self._read = read or (lambda: read_inventory(self._nvml, node or _node_of(base)))
        self._sleep = sleep
        self._clock = clock
        self.num_polls = 0
        self.error: str | None = None  # the last poll's problem (reported once)

    def rebase(self, cluster: Cluster) -> None:
        """The cluster file changed too: discovery folds into that from now on."""
        self.cluster = cluster

    def poll(self, now_s: float) -> Change | None:
        """Ask NVML once. The new cluster and `diff(last, new, now_s)` when it differs;
        None when nothing changed or NVML could not be read (the last cluster stands)."""
        self.num_polls += 1
        try:
            inv = self._read()
            own = own_usage_bytes(self._nvml_module(), self._own_pgids())
        except Exception as exc:  # DiscoverError, or an NVML error (not one class)
            line = f"GPU discovery failed (keeping the last cluster): {exc}"
            self.error = report_once(self.error, line, log.warning)
            return None
        self.error = None
        new = merge(self.cluster, inv, own)
        change = changed(self.cluster, new, now_s)
        self.cluster = new
        return change

    def _nvml_module(self) -> Any:
        if self._nvml is None:
            self._nvml = importlib.import_module("pynvml")
        return self._nvml

    def changes(self) -> AsyncIterator[Change]:
        """`poll` every `interval_s`; each change (cancel the consuming task to stop)."""
        return poll_changes(self.poll, self.interval_s, self._sleep, self._clock)


def _node_of(cluster: Cluster) -> str | None:
    return cluster.nodes[0].name if len(cluster.nodes) == 1 else None
