"""Which leaving instances sleep instead of stopping, and how deep (pure).

A sleeping vLLM engine (sleep mode) keeps its process, allocator and CUDA graphs: waking it
costs only bringing its weights back (`PerfModel.wake_s`), against a cold start's process
start-up and full load. Level 1 keeps the weights in the node's host RAM (the fastest wake);
level 2 drops them (a wake reloads them from storage) and holds no host RAM. The shell (the
live controller, the simulator's) asks `sleep_levels` before each shift and hands the answer
to the shift procedure, which sleeps the leaving instances given a level whose GPUs the
target does not need (docs/controller.md, "Sleep instead of stop").

`sleep_mode`: `off` (every leaving instance stops, as before sleep mode existed), `level1`
(sleep only where the node's host RAM holds the weights; else stop), `auto` (level 1 where
the RAM holds them, else level 2). An engine kind without sleep levels never sleeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from flexpipe.cluster import Cluster
from flexpipe.control.core.shift_procedure import InPlaceChooser
from flexpipe.perf import PerfModel
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.candidates import keepable
from flexpipe.policies.shift.in_place import MAKE_BEFORE_BREAK, InPlaceChoice, choose_in_place
from flexpipe.policies.shift.params import SLEEP_MODES
from flexpipe.policies.shift.snapshot import instance_key

__all__ = [
    "SLEEP_MODES",
    "host_ram_by_node",
    "host_ram_free",
    "in_place_chooser",
    "leaving_of",
    "sleep_levels",
    "sleep_mode_on",
]


def sleep_mode_on(mode: str, kind_levels: Sequence[int]) -> bool:
    """Engines are launched able to sleep (`--enable-sleep-mode`): the mode is not off and
    the engine kind declares a level the mode uses."""
    if mode == "off":
        return False
    return 1 in kind_levels or (mode == "auto" and 2 in kind_levels)


def host_ram_by_node(cluster: Cluster, pm: PerfModel) -> dict[str, float]:
    """The host RAM a level-1 sleep of `pm`'s instance holds on each node (its weights)."""
    out: dict[str, float] = {}
    for g in pm.memory.per_gpu:
        node = cluster.gpu(g.name).node
        out[node] = out.get(node, 0.0) + g.weights_bytes
    return out


def host_ram_free(
    cluster: Cluster,
    asleep_at_level1: Iterable[PlannedInstance],
    perf_model: Callable[[PlannedInstance], PerfModel],
) -> dict[str, float]:
    """Node -> its host RAM less what the level-1 sleepers on GPUs still ours hold there."""
    free: dict[str, float] = {n.name: n.host_ram_capacity_bytes for n in cluster.nodes}
    for inst in asleep_at_level1:
        if not keepable(cluster, inst.gpu_ids):
            continue
        for node, held in host_ram_by_node(cluster, perf_model(inst)).items():
            free[node] = free.get(node, 0.0) - held
    return free


def in_place_chooser(
    mode: str,
    kind_levels: Sequence[int],
    cluster: Cluster,
    asleep_at_level1: Iterable[PlannedInstance],
    perf_model: Callable[[PlannedInstance], PerfModel],
) -> InPlaceChooser | None:
    """How the shift procedure's in-place steps re-gear (`shift.pricing.in_place`,
    policies/shift/in_place.py): None (rolling), or the choice bound to the cluster, the
    engine kind's sleep levels and the host RAM the level-1 sleepers leave."""
    if mode != MAKE_BEFORE_BREAK:
        return None
    free = host_ram_free(cluster, list(asleep_at_level1), perf_model)

    def choose(
        blockers: Sequence[PlannedInstance], adds: Sequence[PlannedInstance]
    ) -> InPlaceChoice:
        return choose_in_place(cluster, blockers, adds, perf_model, kind_levels, free)

    return choose


def sleep_levels(
    mode: str,
    kind_levels: Sequence[int],
    cluster: Cluster,
    leaving: Iterable[PlannedInstance],
    asleep_at_level1: Iterable[PlannedInstance],
    perf_model: Callable[[PlannedInstance], PerfModel],
) -> dict[str, int]:
    """Instance key -> the level each of `leaving` sleeps at (absent: it stops). Host RAM is
    each node's capacity less what level-1 sleepers hold already and what the earlier of
    `leaving` take (in order). An instance on a GPU that is gone, or that another tenant
    holds whole now (an occupation, a reclaim), stops: that GPU is not ours to keep."""
    if not sleep_mode_on(mode, kind_levels):
        return {}
    free = host_ram_free(cluster, asleep_at_level1, perf_model)
    out: dict[str, int] = {}
    for inst in leaving:
        if not keepable(cluster, inst.gpu_ids):
            continue
        need = host_ram_by_node(cluster, perf_model(inst))
        if 1 in kind_levels and all(b <= free.get(n, 0.0) for n, b in need.items()):
            for node, held in need.items():
                free[node] -= held
            out[instance_key(inst)] = 1
        elif mode == "auto" and 2 in kind_levels:
            out[instance_key(inst)] = 2
    return out


def leaving_of(
    running: Mapping[str, PlannedInstance], target: Sequence[PlannedInstance]
) -> list[PlannedInstance]:
    """The running instances a target lacks, in the running order."""
    wanted = {instance_key(t) for t in target}
    return [p for k, p in running.items() if k not in wanted]
