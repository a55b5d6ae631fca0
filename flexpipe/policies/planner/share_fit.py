"""What fits on one GPU shared in memory: each engine's batch, memory fraction and capacity
(the rules are in sharing.py's module docstring; the model in flexpipe.perf.colocation), and
whether engines sharing one as they run still fit it (`misfit`, for stickiness)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flexpipe.cluster import placement_on
from flexpipe.gears.gear import Gear
from flexpipe.perf import InfeasibleGear, memory_plan
from flexpipe.perf.colocation import (
    busy_share,
    fits_together,
    memory_fraction,
    shared_capacity_per_s,
    stretch,
)
from flexpipe.perf.gear_lookup import GearEstimate, GearQuery
from flexpipe.policies.planner.candidates import Evaluator

__all__ = ["Member", "Option", "fit", "memory_cap", "misfit", "shared_capacities"]


@dataclass(frozen=True, slots=True)
class Member:
    """An engine asking for a place on a shared GPU: its model, precision and load."""

    model_index: int
    dtype: str
    load_per_s: float  # requests/s it is to serve there


@dataclass(frozen=True, slots=True)
class Option:
    """One batch an engine could run at on a shared GPU."""

    gear: Gear
    estimate: GearEstimate
    fraction: float  # its --gpu-memory-utilization
    kv_capacity_tokens: int  # at that fraction
    max_concurrency: int


def shared_capacities(
    evaluator: Evaluator, members: Sequence[Member], estimates: Sequence[GearEstimate]
) -> list[float]:
    """Each member's capacity (requests/s) on the shared GPU at its figures alone
    (`estimates`): what the others' expected load leaves it (sized by throughput,
    flexpipe.perf.colocation)."""
    busy = [
        busy_share(i.load_per_s, e.requests_per_s) for i, e in zip(members, estimates, strict=True)
    ]
    caps: list[float] = []
    for k, (inst, est) in enumerate(zip(members, estimates, strict=True)):
        alone = evaluator.capacity_per_s(inst.model_index, est, None)
        others = sum(busy) - busy[k]
        caps.append(shared_capacity_per_s(alone, est.requests_per_s, others, len(members)))
    return caps


def memory_cap(evaluator: Evaluator, gpu: str) -> float:
    """The most the fractions of `gpu`'s engines may sum to: what the planner allows itself,
    and no more than other tenants left."""
    slot = evaluator.cluster.slot(gpu)
    return min(evaluator.config.gpu_memory_utilization, slot.free_bytes / slot.spec.memory_bytes)


def misfit(
    evaluator: Evaluator,
    members: Sequence[Member],
    estimates: Sequence[GearEstimate],
    fractions: Sequence[float],
    gpu: str,
) -> str | None:
    """Why engines running at fixed batches and fractions (each one's figures alone:
    `estimates`) no longer fit `gpu` together, or None when they do: the fractions within
    `memory_cap`, each one's SLOs at `stretch(k)`, the busy shares within the target
    utilisation (the rules of `fit`, for a group as it runs)."""
    k = len(members)
    total = sum(fractions)
    if total > memory_cap(evaluator, gpu) + 1e-9:
        return f"the memory fractions on {gpu} sum to {total:.2f}, more than is free"
    for inst, est in zip(members, estimates, strict=True):
        if not _meets_slos(evaluator, inst.model_index, est, stretch(k)):
            name = evaluator.demands[inst.model_index].name
            return f"{name} misses its SLOs with {k} engines busy on {gpu}"
    busy = [
        busy_share(i.load_per_s, e.requests_per_s) for i, e in zip(members, estimates, strict=True)
    ]
    if not fits_together(busy, evaluator.config.target_utilization):
        return f"the load of the {k} engines on {gpu} is more than its time"
    return None


def fit(
    evaluator: Evaluator,
    members: Sequence[Member],
    gpu: str,
    cache: dict[tuple[object, ...], list[Option]],
    fixed: Sequence[Option | None] = (),
) -> list[Option] | None:
    """Each member's option on `gpu` shared by all of them, or None when they do not fit
    (sharing.py's module docstring gives the rules). `cache`: options by model, precision,
    hardware and number of engines, kept across the fits of one pass. `fixed`: per member,
    the option it runs at when it already shares `gpu` (kept as it is: changing it would
    restart it), else None."""
    k = len(members)
    lists: list[list[Option]] = []
    for n, inst in enumerate(members):
        m = inst.model_index
        mine = fixed[n] if n < len(fixed) else None
        if mine is not None:
            if not _meets_slos(evaluator, m, mine.estimate, stretch(k)):
                return None
            lists.append([mine])
            continue
        key = (m, inst.dtype, evaluator.hardware(((gpu,),)), k)
        opts = cache.get(key)
        if opts is None:
            opts = cache[key] = _options(evaluator, m, inst.dtype, gpu, stretch(k))
        if not opts:
            return None
        lists.append(opts)
    config = evaluator.config
    cap = memory_cap(evaluator, gpu)
    picks = [len(o) - 1 for o in lists]  # highest throughput first

    def busy(p: list[int]) -> list[float]:
        return [
            busy_share(i.load_per_s, o[j].estimate.requests_per_s)
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


def _options(evaluator: Evaluator, m: int, dtype: str, gpu: str, factor: float) -> list[Option]:
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
    out: list[Option] = []
    for batch in sorted(set(evaluator.config.batch_ladder)):
        g = Gear(tp=1, pp=1, dtype=dtype, max_num_seqs=batch)
        try:
            whole = memory_plan(spec, g, placement, eff, 1.0, model_len)
            if not whole.feasible or whole.max_batch(context) < batch:
                break
            est = evaluator.performance.estimate(GearQuery.of(spec, g, placement), demand.workload)
        except InfeasibleGear:
            break
        if not _meets_slos(evaluator, m, est, factor):
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
        out.append(Option(g, est, fraction, mine.kv_capacity_tokens, mine.max_batch(context)))
    return out


def _meets_slos(evaluator: Evaluator, m: int, est: GearEstimate, factor: float) -> bool:
    """Whether model `m` at figures `est` (alone) meets its TTFT and TPOT SLOs with every step
    stretched by `factor` (its neighbours on the GPU busy at once)."""
    slo = evaluator.demands[m].slo
    return est.tpot_s * factor <= slo.tpot_p99_s and est.ttft_s * factor <= slo.ttft_p99_s
