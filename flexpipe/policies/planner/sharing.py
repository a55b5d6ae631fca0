"""Memory sharing: models that need far less than one GPU packed onto one GPU
(`PlannerConfig.share_gpus`; docs/gpu-sharing.md).

A pass over the plan the greedy made. Eligible: a model's only instance, on one GPU (tp=1,
pp=1). Taken in plan order, each eligible instance moves onto the first GPU of an earlier
eligible instance where the group still fits (first fit); its own GPU is freed. A group fits
(`_fit`) when, with `k` engines on the GPU:

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
from dataclasses import dataclass, replace

from flexpipe.cluster import Cluster, placement_on
from flexpipe.gears.gear import Gear
from flexpipe.model_spec import load_model_spec
from flexpipe.perf import Efficiency, InfeasibleGear, memory_plan
from flexpipe.perf.colocation import (
    busy_share,
    fits_together,
    memory_fraction,
    shared_capacity_per_s,
    stretch,
)
from flexpipe.perf.gear_lookup import GearEstimate, GearQuery
from flexpipe.policies.planner.candidates import Evaluator
from flexpipe.policies.planner.performance import GearPerformance
from flexpipe.policies.planner.types import (
    ModelDemand,
    ModelOutcome,
    Plan,
    PlannedInstance,
    PlannerConfig,
    UnusedGpu,
)

__all__ = ["pack", "pack_running", "share_gpus"]


@dataclass(frozen=True, slots=True)
class _Option:
    """One batch an engine could run at on a shared GPU."""

    gear: Gear
    estimate: GearEstimate
    fraction: float  # its --gpu-memory-utilization
    kv_capacity_tokens: int  # at that fraction
    max_concurrency: int


def share_gpus(evaluator: Evaluator, the_plan: Plan) -> Plan:
    """`the_plan` with its small single-GPU instances packed (see the module docstring);
    `the_plan` itself when nothing packs."""
    instances, moved = pack(evaluator, the_plan.instances)
    if not moved:
        return the_plan
    freed = [
        UnusedGpu(inst.gpu_ids[0], f"freed: {inst.name} shares {moved[inst.name]}")
        for inst in the_plan.instances
        if inst.name in moved
    ]
    capacity: dict[str, float] = {}
    capacity_tokens: dict[str, float] = {}
    for i in instances:
        capacity[i.model] = capacity.get(i.model, 0.0) + i.capacity_requests_per_s
        capacity_tokens[i.model] = capacity_tokens.get(i.model, 0.0) + i.capacity_tokens_per_s
    outcomes = tuple(_outcome(o, capacity, capacity_tokens) for o in the_plan.models)
    num_shared = len({i.gpu_ids[0] for i in instances if i.gpu_memory_fraction is not None})
    note = f"share_gpus: {len(moved)} instance(s) moved onto {num_shared} shared GPU(s)"
    return replace(
        the_plan,
        instances=instances,
        models=outcomes,
        unused=(*the_plan.unused, *freed),
        notes=(*the_plan.notes, note),
    )


def pack(
    evaluator: Evaluator, instances: Sequence[PlannedInstance], spare: Sequence[str] = ()
) -> tuple[tuple[PlannedInstance, ...], dict[str, str]]:
    """`instances` with the eligible ones packed (first fit, see the module docstring), and
    which moved where (instance name -> GPU id). Instances that already share a GPU stay as
    they are (re-packing them would restart them in place). `spare`: free GPUs; a group is
    placed on one of the same hardware when there is one (so that the engines it replaces
    serve until it is ready: no gap), else on its first member's GPU."""
    per_model: dict[str, int] = {}
    for inst in instances:
        per_model[inst.model] = per_model.get(inst.model, 0) + 1
    index = {d.name: m for m, d in enumerate(evaluator.demands)}
    options: dict[tuple[object, ...], list[_Option]] = {}
    hosts: dict[str, list[PlannedInstance]] = {}  # GPU -> the instances packed there
    chosen: dict[str, list[_Option]] = {}
    for inst in instances:
        if (
            inst.num_gpus != 1
            or per_model[inst.model] != 1
            or inst.model not in index
            or inst.gpu_memory_fraction is not None
        ):
            continue
        for gpu, members in hosts.items():
            fit = _fit(evaluator, index, [*members, inst], gpu, options)
            if fit is not None:
                members.append(inst)
                chosen[gpu] = fit
                break
        else:
            hosts[inst.gpu_ids[0]] = [inst]
    free = list(spare)
    replaced: dict[str, PlannedInstance] = {}
    moved: dict[str, str] = {}
    for gpu, members in hosts.items():
        if len(members) < 2:
            continue
        same = [g for g in free if evaluator.hardware(((g,),)) == evaluator.hardware(((gpu,),))]
        target = same[0] if same else gpu
        if same:
            free.remove(target)
        names = [m.name for m in members]
        group = _shares(evaluator, index, members, chosen[gpu])
        for inst, opt, cap in zip(members, chosen[gpu], group, strict=True):
            others = ", ".join(n for n in names if n != inst.name)
            if inst.gpu_ids[0] != target:
                moved[inst.name] = target
            replaced[inst.name] = replace(
                inst,
                gear=opt.gear,
                stages=((target,),),
                layers_per_stage=(sum(inst.layers_per_stage),),
                estimate=opt.estimate,
                capacity_requests_per_s=cap,
                capacity_tokens_per_s=cap
                * opt.estimate.output_tokens_per_s
                / opt.estimate.requests_per_s,
                kv_capacity_tokens=opt.kv_capacity_tokens,
                max_concurrency=opt.max_concurrency,
                gpu_memory_fraction=opt.fraction,
                why=f"{inst.why}; shares {target} with {others} ({opt.fraction:.2f} of its "
                f"memory, batch {opt.gear.max_num_seqs})",
            )
    return tuple(replaced.get(i.name, i) for i in instances), moved


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
    # (the instances left as they were come back as they run, their planned load unchanged)
    return tuple(p if p is not a else o for p, a, o in zip(packed, asked, instances, strict=True))


def _outcome(o: ModelOutcome, capacity: dict[str, float], tokens: dict[str, float]) -> ModelOutcome:
    cap = capacity.get(o.name, 0.0)
    served = min(o.demand_requests_per_s, cap)
    per_request = o.served_tokens_per_s / o.served_requests_per_s if o.served_requests_per_s else 0
    return replace(
        o,
        capacity_requests_per_s=cap,
        capacity_tokens_per_s=tokens.get(o.name, 0.0),
        served_requests_per_s=served,
        served_tokens_per_s=served * per_request,
    )


def _shares(
    evaluator: Evaluator,
    index: dict[str, int],
    members: list[PlannedInstance],
    opts: list[_Option],
) -> list[float]:
    """Each member's capacity on the shared GPU: what the others' expected load leaves it."""
    busy = [
        busy_share(i.assigned_requests_per_s, o.estimate.requests_per_s)
        for i, o in zip(members, opts, strict=True)
    ]
    caps: list[float] = []
    for k, (inst, opt) in enumerate(zip(members, opts, strict=True)):
        alone = evaluator.capacity_per_s(index[inst.model], opt.estimate, None)
        others = sum(busy) - busy[k]
        caps.append(shared_capacity_per_s(alone, opt.estimate.requests_per_s, others, len(members)))
    return caps


def _fit(
    evaluator: Evaluator,
    index: dict[str, int],
    members: list[PlannedInstance],
    gpu: str,
    cache: dict[tuple[object, ...], list[_Option]],
) -> list[_Option] | None:
    """Each member's option on `gpu` shared by all of them, or None when they do not fit."""
    k = len(members)
    lists: list[list[_Option]] = []
    for inst in members:
        m = index[inst.model]
        key = (m, inst.gear.dtype, evaluator.hardware(((gpu,),)), k)
        opts = cache.get(key)
        if opts is None:
            opts = cache[key] = _options(evaluator, m, inst.gear, gpu, stretch(k))
        if not opts:
            return None
        lists.append(opts)
    config = evaluator.config
    slot = evaluator.cluster.slot(gpu)
    # (what the planner allows itself, and no more than other tenants left)
    cap = min(config.gpu_memory_utilization, slot.free_bytes / slot.spec.memory_bytes)
    picks = [len(o) - 1 for o in lists]  # highest throughput first

    def busy(p: list[int]) -> list[float]:
        return [
            busy_share(i.assigned_requests_per_s, o[j].estimate.requests_per_s)
            for i, o, j in zip(members, lists, p, strict=True)
        ]

    if not fits_together(busy(picks), config.target_utilization):
        return None
    while sum(o[j].fraction for o, j in zip(lists, picks, strict=True)) > cap + 1e-9:
        best: tuple[float, int] | None = None
        for n, (o, j) in enumerate(zip(lists, picks, strict=True)):
            if j == 0:
                continue
            trial = [*picks[:n], j - 1, *picks[n + 1 :]]
            if fits_together(busy(trial), config.target_utilization):
                saved = o[j].fraction - o[j - 1].fraction
                if best is None or saved > best[0]:
                    best = (saved, n)
        if best is None:
            return None
        picks[best[1]] -= 1
    return [o[j] for o, j in zip(lists, picks, strict=True)]


def _options(evaluator: Evaluator, m: int, gear: Gear, gpu: str, factor: float) -> list[_Option]:
    """The batches of the ladder at which model `m` alone on `gpu` meets its SLOs with its
    steps stretched by `factor`, with the memory fraction each needs; throughput rises
    along the list (batches past the best throughput are left out)."""
    spec = evaluator.specs[m]
    demand = evaluator.demands[m]
    eff = evaluator.efficiency
    model_len = demand.max_model_len or min(spec.max_position_embeddings, eff.default_max_model_len)
    context = demand.input_tokens + demand.output_tokens
    placement = placement_on(evaluator.cluster, ((gpu,),), spec.num_layers)
    memory_bytes = evaluator.cluster.gpu(gpu).spec.memory_bytes
    slo = demand.slo
    out: list[_Option] = []
    for batch in sorted(set(evaluator.config.batch_ladder)):
        g = replace(gear, tp=1, pp=1, max_num_seqs=batch)
        try:
            whole = memory_plan(spec, g, placement, eff, 1.0, model_len)
            if not whole.feasible or whole.max_batch(context) < batch:
                break
            est = evaluator.performance.estimate(GearQuery.of(spec, g, placement), demand.workload)
        except InfeasibleGear:
            break
        if est.tpot_s * factor > slo.tpot_p99_s or est.ttft_s * factor > slo.ttft_p99_s:
            break
        if out and est.requests_per_s <= out[-1].estimate.requests_per_s:
            break
        per = whole.per_gpu[0]
        tokens = max(model_len, batch * context)
        fraction = memory_fraction(
            per.weights_bytes, per.reserve_bytes, per.kv_bytes_per_token, tokens, memory_bytes
        )
        if fraction > evaluator.config.gpu_memory_utilization:
            break
        mine = memory_plan(spec, g, placement, eff, fraction, model_len)
        if not mine.feasible or mine.max_batch(context) < batch:
            break
        out.append(_Option(g, est, fraction, mine.kv_capacity_tokens, mine.max_batch(context)))
    return out
