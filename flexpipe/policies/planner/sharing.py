"""Memory sharing: models that need far less than one GPU packed onto one GPU
(`PlannerConfig.share_gpus`; docs/gpu-sharing.md).

A pass over the plan the greedy made. Eligible: a model's only instance, on one GPU (tp=1,
pp=1), not sharing already. An instance sharing a GPU already (one the plan kept running)
stays as it runs, its batch and fraction fixed; its GPU is a group the others may join. Taken
in plan order, each eligible instance moves onto the first GPU of a running shared instance or
of an earlier eligible instance where the group still fits (first fit); its own GPU is freed.
Then each model the plan left without an instance (no GPU was left for it) and that has
demand joins the first group it fits in. A group fits (share_fit.py) when, with `k`
engines on the GPU:

- latency: each engine meets its SLOs with every step stretched by `stretch(k)` (all busy at
  once, the worst case of time-slicing, flexpipe.perf.colocation);
- compute: the engines' busy shares (assigned load / throughput alone) fit the planner's
  target utilisation with the switch overhead (`fits_together`): each one's load is within
  the capacity the others' expected load leaves it;
- memory: each engine's fraction (weights, reserve, KV for its batch of full contexts, at
  least one `max_model_len` sequence) and the fractions sum to at most
  `gpu_memory_utilization`. Each engine starts at its SLO-meeting batch of highest
  throughput; while the fractions do not fit, the engine whose next smaller batch saves the
  most memory steps down, as long as the compute check still holds.

Pure: the evaluator's performance model and the plan in, a plan out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from flexpipe.cluster import Cluster
from flexpipe.model_spec import load_model_spec
from flexpipe.perf import Efficiency
from flexpipe.policies.planner.candidates import Evaluator
from flexpipe.policies.planner.performance import GearPerformance
from flexpipe.policies.planner.share_fit import Member, Option, fit, shared_capacities
from flexpipe.policies.planner.types import (
    InstanceChange,
    ModelDemand,
    ModelOutcome,
    Plan,
    PlannedInstance,
    PlannerConfig,
    UnusedGpu,
)

__all__ = ["pack", "pack_running", "share_gpus"]


def share_gpus(evaluator: Evaluator, the_plan: Plan) -> Plan:
    """`the_plan` with its small single-GPU instances packed, and the models it could not
    place added where they fit (see the module docstring); `the_plan` itself when nothing
    packs."""
    instances, moved = pack(evaluator, the_plan.instances)
    if not moved:
        return the_plan
    before = {i.name for i in the_plan.instances}
    freed = [
        UnusedGpu(inst.gpu_ids[0], f"freed: {inst.name} shares {moved[inst.name]}")
        for inst in the_plan.instances
        if inst.name in moved
    ]
    added = [i for i in instances if i.name not in before]
    changes = [
        InstanceChange(i.name, "new", f"no GPU of its own: shares {i.gpu_ids[0]}") for i in added
    ]
    outcomes = tuple(_outcome(o, instances) for o in the_plan.models)
    num_shared = len({i.gpu_ids[0] for i in instances if i.gpu_memory_fraction is not None})
    note = (
        f"share_gpus: {len(moved) - len(added)} instance(s) moved and {len(added)} added onto "
        f"{num_shared} shared GPU(s)"
    )
    return replace(
        the_plan,
        instances=instances,
        models=outcomes,
        unused=(*the_plan.unused, *freed),
        notes=(*the_plan.notes, note),
        changes=(*the_plan.changes, *changes),
    )


def pack(
    evaluator: Evaluator, instances: Sequence[PlannedInstance], spare: Sequence[str] = ()
) -> tuple[tuple[PlannedInstance, ...], dict[str, str]]:
    """`instances` with the eligible ones packed and the models without an instance added
    where they fit (first fit, see the module docstring), and which moved or were added where
    (instance name -> GPU id). Instances that already share a GPU stay as they are (re-packing
    them would restart them in place), but others may join their GPU where its memory and time
    have room. `spare`: free GPUs; a new group is placed on one of the same hardware when there
    is one (so that the engines it replaces serve until it is ready: no gap), else on its
    first member's GPU."""
    demands = evaluator.demands
    index = {d.name: m for m, d in enumerate(demands)}
    per_model = [0] * len(demands)
    for inst in instances:
        if inst.model in index:
            per_model[index[inst.model]] += 1
    cache: dict[tuple[object, ...], list[Option]] = {}
    # GPU -> the engines packed there: (member, its instance or None for a newcomer, its
    # option when it already shares that GPU)
    hosts: dict[str, list[tuple[Member, PlannedInstance | None, Option | None]]] = {}
    chosen: dict[str, list[Option]] = {}

    def join(member: Member, inst: PlannedInstance | None) -> bool:
        for gpu, group in hosts.items():
            members = [m for m, _, _ in group] + [member]
            options = fit(evaluator, members, gpu, cache, [o for _, _, o in group])
            if options is not None:
                group.append((member, inst, None))
                chosen[gpu] = options
                return True
        return False

    single = [(index[i.model], i) for i in instances if i.model in index and i.num_gpus == 1]
    for m, inst in single:  # the residents first: each GPU's whole group before any joins
        if inst.gpu_memory_fraction is not None:
            member = Member(m, inst.gear.dtype, inst.assigned_requests_per_s)
            hosts.setdefault(inst.gpu_ids[0], []).append((member, inst, _running(inst)))
    for m, inst in single:
        if inst.gpu_memory_fraction is None and per_model[m] == 1:
            member = Member(m, inst.gear.dtype, inst.assigned_requests_per_s)
            if not join(member, inst):
                hosts[inst.gpu_ids[0]] = [(member, inst, None)]
    for m, d in enumerate(demands):
        if per_model[m] == 0 and (d.request_rate_per_s > 0 or d.min_instances > 0):
            join(Member(m, d.dtypes[0], d.request_rate_per_s), None)
    free = list(spare)
    taken = {i.name for i in instances}
    replaced: dict[str, PlannedInstance] = {}
    added: list[PlannedInstance] = []
    moved: dict[str, str] = {}
    for gpu, group in hosts.items():
        if len(group) < 2 or gpu not in chosen:  # alone, or residents only: as they run
            continue
        residents = any(o is not None for _, _, o in group)
        same = [g for g in free if evaluator.hardware(((g,),)) == evaluator.hardware(((gpu,),))]
        target = same[0] if same and not residents else gpu
        if target in free:
            free.remove(target)
        caps = shared_capacities(
            evaluator, [m for m, _, _ in group], [o.estimate for o in chosen[gpu]]
        )
        names = [_name(demands[m.model_index].name, p, taken) for m, p, _ in group]
        for (member, planned, running), opt, cap, name in zip(
            group, chosen[gpu], caps, names, strict=True
        ):
            others = ", ".join(n for n in names if n != name)
            mine = _placed(evaluator, member, planned, opt, cap, target, name)
            if running is None:
                why = f"shares {target} with {others} ({opt.fraction:.2f} of its memory, batch "
                why += f"{opt.gear.max_num_seqs})"
                mine = replace(mine, why=f"{mine.why}; {why}" if mine.why else why)
            if planned is None:
                added.append(mine)
                moved[name] = target
            else:
                replaced[planned.name] = mine
                if planned.gpu_ids[0] != target:
                    moved[planned.name] = target
    return (*(replaced.get(i.name, i) for i in instances), *added), moved


def _running(inst: PlannedInstance) -> Option:
    """A resident's option: the batch and fraction it runs at."""
    assert inst.gpu_memory_fraction is not None
    return Option(
        inst.gear,
        inst.estimate,
        inst.gpu_memory_fraction,
        inst.kv_capacity_tokens,
        inst.max_concurrency,
    )


def _name(model: str, inst: PlannedInstance | None, taken: set[str]) -> str:
    """An instance's own name, or a newcomer's: the first free `<model>-<n>`."""
    if inst is not None:
        return inst.name
    n = 0
    while f"{model}-{n}" in taken:
        n += 1
    taken.add(f"{model}-{n}")
    return f"{model}-{n}"


def _placed(
    evaluator: Evaluator,
    member: Member,
    inst: PlannedInstance | None,
    opt: Option,
    capacity_per_s: float,
    gpu: str,
    name: str,
) -> PlannedInstance:
    """The planned instance of `member` on the shared `gpu` at option `opt`."""
    m = member.model_index
    tokens_per_s = capacity_per_s * opt.estimate.output_tokens_per_s / opt.estimate.requests_per_s
    fields = {
        "gear": opt.gear,
        "stages": ((gpu,),),
        "layers_per_stage": (evaluator.specs[m].num_layers,),
        "estimate": opt.estimate,
        "capacity_tokens_per_s": tokens_per_s,
        "capacity_requests_per_s": capacity_per_s,
        "kv_capacity_tokens": opt.kv_capacity_tokens,
        "max_concurrency": opt.max_concurrency,
        "gpu_memory_fraction": opt.fraction,
    }
    if inst is not None:
        return replace(inst, **fields)  # type: ignore[arg-type]
    return PlannedInstance(
        name=name,
        model=evaluator.demands[m].name,
        model_id=evaluator.specs[m].name,
        assigned_requests_per_s=min(member.load_per_s, capacity_per_s),
        why="no GPU of its own",
        **fields,  # type: ignore[arg-type]
    )


def pack_running(
    cluster: Cluster,
    demands: Sequence[ModelDemand],
    instances: Sequence[PlannedInstance],
    spare: Sequence[str],
    performance: GearPerformance,
    config: PlannerConfig,
    efficiency: Efficiency | None = None,
) -> tuple[PlannedInstance, ...] | None:
    """A running plan's instances packed at the load `demands` ask now (a model's only
    instance is assigned its whole rate), onto `spare` GPUs where it can; None when nothing
    packs. What the shift policy offers as a candidate (policies/shift/candidates.py)."""
    demands = tuple(demands)
    specs = tuple(load_model_spec(d.model) for d in demands)
    evaluator = Evaluator(cluster, demands, specs, performance, config, efficiency)
    rate = {d.name: d.request_rate_per_s for d in demands}
    asked = [
        replace(i, assigned_requests_per_s=rate[i.model]) if i.model in rate else i
        for i in instances
    ]
    packed, moved = pack(evaluator, asked, spare)
    if not moved:
        return None
    # (the instances left as they were come back as they run, their planned load unchanged;
    # the models added follow them)
    n = len(asked)
    kept = (p if p is not a else o for p, a, o in zip(packed[:n], asked, instances, strict=True))
    return (*kept, *packed[n:])


def _outcome(o: ModelOutcome, instances: Sequence[PlannedInstance]) -> ModelOutcome:
    """A model's outcome with its instances as packed."""
    mine = [i for i in instances if i.model == o.name]
    cap = sum(i.capacity_requests_per_s for i in mine)
    served = min(o.demand_requests_per_s, cap)
    per_request = o.demand_tokens_per_s / o.demand_requests_per_s if o.demand_requests_per_s else 0
    return replace(
        o,
        capacity_requests_per_s=cap,
        capacity_tokens_per_s=sum(i.capacity_tokens_per_s for i in mine),
        served_requests_per_s=served,
        served_tokens_per_s=served * per_request,
        num_instances=len(mine),
        num_gpus=sum(i.num_gpus for i in mine),
    )
