"""Target plans a shift may move to. The planner proposes; this module only assembles.

- `replan`: the planner's plan for every model on the GPUs free now.
- `priority_first`: every model's minimum kept from the running plan, then the planner run
  tier by tier, highest priority first, each tier on the GPUs the tiers above left (seed
  004: when GPUs are short the customer-facing model gets them first); only offered when
  the models have more than one priority.
- `additive`: the running plan kept as it is, plus instances of the models named (a wake's
  models with no instance) planned by the planner on the GPUs no running instance holds:
  nothing running moves, so no step of it is in place.
- `woken`: the running plan kept, plus the sleeping instances (sleep mode) of the models
  named, on their own GPUs: woken rather than cold-started (priced at the wake time).
- `shrink`: the running plan minus instances of an idle model, down to its minimum, while
  the rest still carries its load: gives GPUs back without touching anything else.
- `protects_priority`: refuses a candidate that gives a running instance's GPUs of a model
  in or near its up zone to a model of lower priority (`TriggerParams.protect_priority`).
- `packed`: a candidate with its small models packed onto shared GPUs, on free GPUs where it
  can (the planner's `share_gpus`, docs/gpu-sharing.md): gives GPUs back in a trough.
- `keep_minimums`: repairs a candidate that would leave a model below `min_instances` by
  keeping running instances of it on GPUs the candidate does not use, or says why not.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from flexpipe.cluster import Cluster
from flexpipe.policies.planner import ModelDemand, Plan, PlannedInstance, num_gpus_held, plan
from flexpipe.policies.shift.pricing import Capacity
from flexpipe.policies.shift.snapshot import ModelState, instance_key

__all__ = [
    "Candidate",
    "Packer",
    "Planner",
    "additive",
    "default_planner",
    "keep_minimums",
    "keepable",
    "packed",
    "priority_first",
    "protects_priority",
    "replan",
    "shrink",
    "woken",
]

# (cluster with the GPUs free now, demands, now) -> plan; the planner by default
Planner = Callable[[Cluster, tuple[ModelDemand, ...], float], Plan]


@runtime_checkable
class Packer(Protocol):
    """A planner that can pack a plan's small models onto shared GPUs (the controller's,
    flexpipe.control.core.planner): `pack` returns None when it is off or nothing packs."""

    def pack(
        self,
        cluster: Cluster,
        demands: Sequence[ModelDemand],
        instances: Sequence[PlannedInstance],
        spare: Sequence[str],
    ) -> tuple[PlannedInstance, ...] | None: ...


def default_planner(cluster: Cluster, demands: tuple[ModelDemand, ...], now_s: float) -> Plan:
    return plan(cluster, demands, now_s=now_s)


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str  # "replan", "priority-first", "shrink llama-7b", "keep", ...
    instances: tuple[PlannedInstance, ...]
    note: str = ""


def replan(
    cluster: Cluster, demands: Sequence[ModelDemand], now_s: float, planner: Planner
) -> Candidate:
    p = planner(cluster, tuple(demands), now_s)
    return Candidate("replan", p.instances, "the planner's plan for the GPUs free now")


def free_of(cluster: Cluster, instances: Sequence[PlannedInstance]) -> Cluster:
    """`cluster` with every GPU of `instances` taken whole (the GPUs they leave free)."""
    left = cluster
    for g in {g for i in instances for g in i.gpu_ids}:
        left = left.with_used(g, left.gpu(g).capacity_bytes, owner="flexpipe")
    return left


def additive(
    cluster: Cluster,
    running: Sequence[PlannedInstance],
    demands: Sequence[ModelDemand],
    names: Collection[str],
    now_s: float,
    planner: Planner,
    capacity: Capacity,
) -> Candidate | None:
    """Every running instance kept; the planner places the models `names` on the GPUs none
    of them holds, each at the rate its running instances do not serve and with at least one
    instance (up to its minimum). None when the planner places none of them there."""
    by_name = {d.name: d for d in demands}
    asks: list[ModelDemand] = []
    for name in sorted(names):
        mine = [i for i in running if i.model == name]
        d = by_name[name]
        rest_per_s = max(0.0, d.request_rate_per_s - sum(capacity(i) for i in mine))
        num_more = max(1, d.min_instances - len(mine))
        asks.append(replace(d, request_rate_per_s=rest_per_s, min_instances=num_more))
    added = [
        i
        for i in planner(free_of(cluster, running), tuple(asks), now_s).instances
        if i.model in names
    ]
    if not added:
        return None
    where = ", ".join(f"{i.model} on {'+'.join(i.gpu_ids)}" for i in added)
    return Candidate(
        f"add {', '.join(sorted({i.model for i in added}))}",
        (*running, *added),
        f"the running plan kept, {where} added on GPUs free now",
    )


def packed(
    cluster: Cluster,
    base: Candidate,
    demands: Sequence[ModelDemand],
    packer: Packer,
    held: Collection[str],
) -> Candidate | None:
    """`base` with its small models packed onto shared GPUs, on GPUs free now that neither
    `base` nor `held` (running, asleep) holds where it can (make-before-break: no gap)."""
    taken = {g for i in base.instances for g in i.gpu_ids} | set(held)
    spare = [g for g in cluster.gpu_ids if g not in taken and cluster.gpu(g).free_bytes > 0]
    instances = packer.pack(cluster, demands, base.instances, spare)
    if instances is None:
        return None
    shared = sorted({i.gpu_ids[0] for i in instances if i.gpu_memory_fraction is not None})
    return Candidate(
        f"pack {base.name}",
        instances,
        f"{base.name}, its small models sharing {', '.join(shared)} in memory",
    )


def keepable(cluster: Cluster, gpu_ids: Collection[str]) -> bool:
    """Every GPU is still there and not held whole by another tenant (an occupation, a
    reclaim): an engine there may sleep on, or wake."""
    ids = set(cluster.gpu_ids)
    return all(g in ids and cluster.gpu(g).free_bytes > 0 for g in gpu_ids)


def woken(
    cluster: Cluster,
    running: Sequence[PlannedInstance],
    asleep: Sequence[PlannedInstance],
    names: Collection[str],
) -> Candidate | None:
    """Every running instance kept, and the sleeping instances of the models `names` woken
    (those on GPUs no running instance holds, still `keepable`). None when none sleeps."""
    held = {g for i in running for g in i.gpu_ids}
    wake = [
        i
        for i in asleep
        if i.model in names and not held & set(i.gpu_ids) and keepable(cluster, i.gpu_ids)
    ]
    if not wake:
        return None
    where = ", ".join(f"{i.model} on {'+'.join(i.gpu_ids)}" for i in wake)
    return Candidate(
        f"wake {', '.join(sorted({i.model for i in wake}))}",
        (*running, *wake),
        f"the running plan kept, {where} woken from sleep",
    )


def priority_first(
    cluster: Cluster,
    models: Sequence[ModelState],
    demands: Sequence[ModelDemand],
    now_s: float,
    planner: Planner,
    running: Sequence[PlannedInstance],
    capacity: Capacity,
) -> Candidate | None:
    """Minimums first (each model keeps its smallest running instances up to its minimum),
    then the planner tier by tier on the GPUs left, each model asking for what its kept
    instances do not already serve."""
    priorities = sorted({m.priority for m in models}, reverse=True)
    if len(priorities) < 2:
        return None
    kept: list[PlannedInstance] = []
    for m in models:
        mine = sorted(
            (i for i in running if i.model == m.name),
            key=lambda i: (i.num_gpus, -capacity(i), i.name),
        )
        kept.extend(mine[: m.min_instances])
    left = free_of(cluster, kept)
    served: dict[str, float] = {}
    for i in kept:
        served[i.model] = served.get(i.model, 0.0) + capacity(i)
    by_name = {d.name: d for d in demands}
    num_kept = {m.name: sum(1 for i in kept if i.model == m.name) for m in models}
    chosen: list[PlannedInstance] = list(kept)
    for p in priorities:
        # The planner honours a demand's own min_instances: count the kept ones against it.
        tier = tuple(
            replace(
                by_name[m.name],
                request_rate_per_s=max(
                    0.0, by_name[m.name].request_rate_per_s - served.get(m.name, 0.0)
                ),
                min_instances=max(0, by_name[m.name].min_instances - num_kept[m.name]),
            )
            for m in models
            if m.priority == p
        )
        instances = planner(left, tier, now_s).instances
        chosen.extend(instances)
        left = free_of(left, instances)
    note = "minimums kept, then the planner tier by tier, highest priority first"
    return Candidate("priority-first", tuple(chosen), note)


def shrink(
    running: Sequence[PlannedInstance],
    model: ModelState,
    need_per_s: float,
    capacity: Capacity,
) -> Candidate | None:
    """Drop instances of `model` (most GPUs first) while at least `min_instances` remain and
    the rest still serve `need_per_s` requests/s. None when nothing can be dropped."""
    mine = [i for i in running if i.model == model.name]
    kept = list(mine)
    for inst in sorted(mine, key=lambda i: (-i.num_gpus, capacity(i), i.name)):
        rest = [i for i in kept if i is not inst]
        if len(rest) < model.min_instances:
            continue
        if sum(capacity(i) for i in rest) >= need_per_s:
            kept = rest
    if len(kept) == len(mine):
        return None
    others = [i for i in running if i.model != model.name]
    # (a GPU shared in memory is given back only when none of its instances stays)
    freed = num_gpus_held(running) - num_gpus_held([*others, *kept])
    return Candidate(
        f"shrink {model.name}",
        (*others, *kept),
        f"{len(mine)} -> {len(kept)} instances of {model.name} (min {model.min_instances}), "
        f"{freed} GPU(s) given back, capacity kept for {need_per_s:.2f} req/s",
    )


def keep_minimums(
    candidate: Candidate,
    running: Sequence[PlannedInstance],
    models: Sequence[ModelState],
) -> Candidate | str:
    """The candidate with every model at or above its minimum, or why that is impossible."""
    instances = list(candidate.instances)
    keys = {instance_key(i) for i in instances}
    used = {g for i in instances for g in i.gpu_ids}
    added: list[str] = []
    for m in models:
        have = sum(1 for i in instances if i.model == m.name)
        spare = sorted(
            (i for i in running if i.model == m.name and instance_key(i) not in keys),
            key=lambda i: (i.num_gpus, -i.capacity_requests_per_s, i.name),
        )
        for inst in spare:
            if have >= m.min_instances:
                break
            if used.isdisjoint(inst.gpu_ids):
                instances.append(inst)
                used.update(inst.gpu_ids)
                added.append(inst.name)
                have += 1
        if have < m.min_instances:
            return (
                f"{candidate.name}: {m.name} would have {have} instance(s), "
                f"below its minimum of {m.min_instances}"
            )
    if not added:
        return candidate
    note = f"{candidate.note}; kept running {', '.join(added)} for minimums".lstrip("; ")
    return Candidate(candidate.name, tuple(instances), note)


def protects_priority(
    candidate: Candidate,
    running: Sequence[PlannedInstance],
    models: Sequence[ModelState],
    pressed: Collection[str],
) -> str | None:
    """Why `candidate` may not be taken: it drops a running instance of a model in `pressed`
    (in or near its up zone) and gives one of its GPUs to a model of lower priority. None:
    it robs no such model. Pricing weighs goodput by priority at the measured loads, which
    lag a burst: this rule holds while the higher model's own need is still rising."""
    if not pressed:
        return None
    priority = {m.name: m.priority for m in models}
    kept = {instance_key(i) for i in candidate.instances}
    owner = {g: i.model for i in candidate.instances for g in i.gpu_ids}
    for inst in running:
        if inst.model not in pressed or instance_key(inst) in kept:
            continue
        for g in inst.gpu_ids:
            taker = owner.get(g)
            if taker is not None and priority[taker] < priority[inst.model]:
                return (
                    f"takes {g} from {inst.name} ({inst.model}, priority "
                    f"{priority[inst.model]:g}, near its up zone) for {taker} "
                    f"(priority {priority[taker]:g})"
                )
    return None
