"""The planner: which instances (model, gear, concrete GPUs) to run on the free GPUs now.

Objective: maximise priority-weighted goodput, `sum over models of priority x min(request
rate, SLO-meeting capacity)` in requests/s, with every model at its `min_instances` where the
GPUs allow (highest priority first); then the fewest GPUs. With a running plan, instances of
it that still fit are kept unless replacing them gains more than `replace_margin`
(`sticky.py`).

Method (lazy greedy over candidates generated per node; see docs/planner.md):

1. Usable GPUs: some memory free, and free for at least `min_lease_s` more.
2. Per node, per model and precision, candidates: for each TP size, the best TP group of every
   fast-link domain (TP never crosses a slow link); when no single group fits, pipeline chains
   of the node's best groups (layers balanced by the partitioner), the smallest `pp` that fits
   and one more. Each is evaluated once (`Evaluator`): memory plan, batch ladder, SLOs.
3. Minimums first (highest priority first): each model below `min_instances` takes its best
   candidate. Then repeatedly take the candidate with the highest *marginal* value per GPU,
   `priority x min(capacity, unmet rate) / num_gpus`, re-generating the candidates of the node
   it used. Values only fall as demand gets covered, so stale heap entries are re-scored lazily.

The search state and the greedy live in `greedy`, the baselines in `baselines`.

Pure: no I/O, no clock (`now` is an argument), no randomness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from flexpipe.cluster import Cluster
from flexpipe.perf import Efficiency
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner.baselines import baselines
from flexpipe.policies.planner.candidates import Candidate, Evaluator
from flexpipe.policies.planner.greedy import GreedyPlanner, usable_gpus
from flexpipe.policies.planner.memo import EvaluationMemo
from flexpipe.policies.planner.performance import GearPerformance
from flexpipe.policies.planner.relaxation import Relaxation, solve_relaxation
from flexpipe.policies.planner.sharing import share_gpus
from flexpipe.policies.planner.sticky import keep_running, switch_where_it_pays
from flexpipe.policies.planner.types import (
    Alternative,
    Baseline,
    InstanceChange,
    ModelDemand,
    ModelOutcome,
    Plan,
    PlannedInstance,
    PlannerConfig,
    UnusedGpu,
)

__all__ = ["plan", "plan_score", "usable_gpus"]


def _why(
    c: Candidate, demand: ModelDemand, remaining_before: float, fixed: str | None = None
) -> str:
    est = c.estimate
    slo = demand.slo
    per_gpu = c.capacity_requests_per_s / c.num_gpus
    weight = f" (priority {demand.priority:g})" if demand.priority != 1 else ""
    if fixed is not None:
        head = f"{per_gpu:.3g} SLO-meeting req/s per GPU{weight}; {fixed}"
    elif c.capacity_requests_per_s <= remaining_before:
        head = f"{per_gpu:.3g} SLO-meeting req/s per GPU{weight}, the best left for {demand.name}"
    else:
        head = f"covers the last {remaining_before:.3g} req/s of {demand.name} with the fewest GPUs"
    return (
        f"{head}: batch {est.batch}, TPOT p99 {est.tpot_s * 1e3:.1f} ms (SLO "
        f"{slo.tpot_p99_s * 1e3:.0f}), TTFT p99 {est.ttft_s * 1e3:.0f} ms (SLO "
        f"{slo.ttft_p99_s * 1e3:.0f}), {est.basis}"
    )


_Chosen = list[tuple[Candidate, list[Alternative]]]


def plan_score(
    demands: Sequence[ModelDemand], instances: Sequence[Candidate]
) -> tuple[float, float, int]:
    """What plans are compared by, in this order: minimums met (each instance up to a model's
    minimum counts its priority), priority-weighted goodput (requests/s), fewest GPUs."""
    counts = [0] * len(demands)
    capacity = [0.0] * len(demands)
    for c in instances:
        counts[c.model_index] += 1
        capacity[c.model_index] += c.capacity_requests_per_s
    met = sum(d.priority * min(n, d.min_instances) for d, n in zip(demands, counts, strict=True))
    goodput = sum(
        d.priority * min(d.request_rate_per_s, cap)
        for d, cap in zip(demands, capacity, strict=True)
    )
    return round(met, 9), round(goodput, 9), -sum(c.num_gpus for c in instances)


def plan(
    cluster: Cluster,
    demands: Sequence[ModelDemand],
    performance: GearPerformance | None = None,
    running: Plan | Sequence[PlannedInstance] | None = None,
    config: PlannerConfig | None = None,
    now_s: float = 0.0,
    efficiency: Efficiency | None = None,
    memo: EvaluationMemo | None = None,
) -> Plan:
    """Plan instances for `demands` on `cluster`'s free GPUs at time `now_s`. With `running`
    (the plan the cluster runs now, or its instances; `cluster` shows its GPUs as free to
    us), instances of it that still fit are kept unless replacing them gains more than
    `config.replace_margin`, and the plan's `changes` say per instance whether it is kept, new
    or stopped. `memo`: candidate evaluations kept across the plans of one caller (memo.py;
    the same plan either way, made faster when the hardware repeats)."""
    config = config or PlannerConfig()
    demands = tuple(demands)
    names = [d.name for d in demands]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be unique; got {names}")
    performance = performance or GearLookup(efficiency=efficiency)
    planner, chosen, notes = _fresh(cluster, demands, performance, config, now_s, efficiency, memo)
    if running is None:
        result = _assemble(planner, chosen, notes, {}, {}, [])
    else:
        if not isinstance(running, Plan):
            running = Plan(tuple(running), ())
        result = _sticky(
            cluster,
            demands,
            performance,
            config,
            now_s,
            efficiency,
            planner,
            chosen,
            notes,
            running,
        )
    return share_gpus(planner.evaluator, result) if config.share_gpus else result


def _fresh(
    cluster: Cluster,
    demands: tuple[ModelDemand, ...],
    performance: GearPerformance,
    config: PlannerConfig,
    now_s: float,
    efficiency: Efficiency | None,
    memo: EvaluationMemo | None = None,
) -> tuple[GreedyPlanner, _Chosen, list[str]]:
    """The best plan from scratch: price rounds of the greedy, then the LP round when demand
    is short."""
    # Price rounds (docs/planner.md): the greedy ranks candidates by value per GPU, which lets
    # a model that is easy to cover take GPUs another model cannot do without. After each
    # round, the models it covered get a lower price (their requests count less in the
    # greedy's order, never in the score), so the short models choose first in the next
    # round. The best round wins (plan_score). Rounds share one evaluation cache.
    prices = [1.0] * len(demands)
    evaluator: Evaluator | None = None
    best: tuple[tuple[float, float, int], GreedyPlanner, _Chosen] | None = None
    rounds: list[str] = []
    for r in range(config.price_rounds):
        planner = GreedyPlanner(
            cluster, demands, performance, config, now_s, efficiency, evaluator, prices, memo
        )
        evaluator = planner.evaluator
        chosen = planner.run()
        score = plan_score(demands, [c for c, _ in chosen])
        label = ", ".join(
            f"{d.name} {p:g}" for d, p in zip(demands, prices, strict=True) if p != 1.0
        )
        rounds.append(
            f"greedy{f' price round {r} ({label})' if r else ''}: weighted goodput "
            f"{score[1]:.4g} req/s on {-score[2]} GPUs"
        )
        if best is None or score > best[0]:
            best = (score, planner, chosen)
        short = [m for m, rem in enumerate(planner.remaining) if rem > 1e-9]
        covered = [m for m in range(len(demands)) if m not in short]
        if not short or not covered:
            break
        for m in covered:
            prices[m] *= config.price_step
    assert best is not None
    demand_total = sum(d.priority * d.request_rate_per_s for d in demands)
    if best[0][1] < demand_total * (1 - 1e-9):
        # Demand is short: solve the LP relaxation over a richer pool and round it, asking
        # for the minimums the greedy met (those it could not meet cannot be met).
        counts = [0] * len(demands)
        for c, _ in best[2]:
            counts[c.model_index] += 1
        min_counts = [min(d.min_instances, n) for d, n in zip(demands, counts, strict=True)]
        lp = _relaxation_round(
            cluster, demands, performance, config, now_s, efficiency, evaluator, best[2], min_counts
        )
        if lp is None:
            rounds.append("LP relaxation skipped: highspy is not installed or found no optimum")
        else:
            score, planner, chosen, note = lp
            won = score > best[0]
            rounds.append(note + ("; chosen" if won else "; the greedy's plan kept"))
            if won:
                best = (score, planner, chosen)
    else:
        rounds[-1] += "; every demand covered (no LP round)"
    _, planner, chosen = best
    return planner, chosen, [*planner.notes, *rounds]


def _relaxation_round(
    cluster: Cluster,
    demands: tuple[ModelDemand, ...],
    performance: GearPerformance,
    config: PlannerConfig,
    now_s: float,
    efficiency: Efficiency | None,
    evaluator: Evaluator | None,
    greedy: _Chosen,
    min_counts: list[int],
) -> tuple[tuple[float, float, int], GreedyPlanner, _Chosen, str] | None:
    """Round the LP relaxation (relaxation.py) over the node pool plus the greedy's candidates:
    take its whole columns, then fractional ones by LP value while their GPUs are free and
    their model is short; the minimums, the greedy and the local search fill the rest."""
    planner = GreedyPlanner(cluster, demands, performance, config, now_s, efficiency, evaluator)
    pool: dict[tuple[object, ...], Candidate] = {}
    for c in [*planner.pool(), *(c for c, _ in greedy)]:
        pool.setdefault((c.model_index, c.stages, c.gear.dtype), c)
    candidates = list(pool.values())
    # Small clusters: the pool is small (hundreds of columns), so solve it as the ILP itself.
    integral = len(planner.usable) <= config.max_cross_node_gpus
    what = "ILP" if integral else "LP relaxation"
    relaxation = solve_relaxation(candidates, demands, integral=integral, min_counts=min_counts)
    if relaxation is None:
        return None
    # Two rules for the fractional column to fix next (largest x; largest value it adds):
    # each wins on some clusters, and rounding is cheap next to the fill, so keep the better.
    roundings = [
        _round(candidates, demands, min_counts, relaxation, what, by_value)
        for by_value in (False, True)
    ]
    fixed = max(roundings, key=lambda f: plan_score(demands, [c for c, _ in f]))
    by_node: dict[str, list[Candidate]] = {}
    for c in candidates:
        by_node.setdefault(cluster.gpu(c.gpu_ids[0]).node, []).append(c)
    chosen = planner.run(fixed, by_node)
    score = plan_score(demands, [c for c, _ in chosen])
    note = (
        f"{what} over {len(candidates)} candidates: bound {relaxation.objective:.4g} weighted "
        f"req/s; rounded ({len(fixed)} instances) and filled by the greedy: weighted goodput "
        f"{score[1]:.4g} req/s on {-score[2]} GPUs"
    )
    return score, planner, chosen, note


def _round(
    candidates: list[Candidate],
    demands: tuple[ModelDemand, ...],
    min_counts: list[int],
    relaxation: Relaxation,
    what: str,
    by_value: bool,
    max_solves: int = 4,
) -> list[tuple[Candidate, str]]:
    """Iterative rounding: fix the solution's whole columns and one fractional column (while
    its GPUs are free and its model short): the largest x, or (`by_value`) the one that adds
    the most priority-weighted goodput; re-solve the LP over the candidates left for the
    demand left, and repeat; after `max_solves`, fix every fractional column in that order.
    Fixing every fractional column by x at once can strand a model (128 GPUs, seed 1: four
    single-H100 8B columns at x=0.28 lose to a Mixtral column at 0.72 over the same GPUs, and
    the 8B stays 26.5 req/s short, 4.5% below the bound)."""
    fixed: list[tuple[Candidate, str]] = []
    taken: set[str] = set()
    remaining = [d.request_rate_per_s for d in demands]
    counts = [0] * len(demands)
    pool = list(range(len(candidates)))
    lp: Relaxation | None = relaxation
    for solve in range(max_solves):
        if lp is None:
            break
        x = dict(zip(pool, lp.x, strict=True))
        whole = [j for j in pool if x[j] >= 1 - 1e-6]

        def adds(j: int) -> float:
            c = candidates[j]
            m = c.model_index
            return demands[m].priority * min(c.capacity_requests_per_s, remaining[m])

        fractional = sorted(
            (j for j in pool if 1e-6 < x[j] < 1 - 1e-6),
            key=lambda j: (
                (-adds(j), -x[j], j)
                if by_value
                else (-x[j], -candidates[j].capacity_requests_per_s, j)
            ),
        )
        last = solve == max_solves - 1 or not fractional
        for j in [*whole, *(fractional if last else fractional[:1])]:
            c = candidates[j]
            m = c.model_index
            short = remaining[m] > 1e-9 or counts[m] < min_counts[m]
            if not short or not taken.isdisjoint(c.gpu_ids):
                continue
            label = f"the {what} over {len(candidates)} candidates chose this (x={x[j]:.2f}"
            fixed.append((c, label + (f", solve {solve + 1})" if solve else ")")))
            taken.update(c.gpu_ids)
            remaining[m] -= min(remaining[m], c.capacity_requests_per_s)
            counts[m] += 1
        if last:
            break
        pool = [j for j in pool if taken.isdisjoint(candidates[j].gpu_ids)]
        residual = tuple(
            replace(d, request_rate_per_s=remaining[m], min_instances=0)
            for m, d in enumerate(demands)
        )
        lp = solve_relaxation(
            [candidates[j] for j in pool],
            residual,
            min_counts=[max(0, n - k) for n, k in zip(min_counts, counts, strict=True)],
        )
    return fixed


def _sticky(
    cluster: Cluster,
    demands: tuple[ModelDemand, ...],
    performance: GearPerformance,
    config: PlannerConfig,
    now_s: float,
    efficiency: Efficiency | None,
    fresh_planner: GreedyPlanner,
    fresh: _Chosen,
    notes: list[str],
    running: Plan,
) -> Plan:
    """Start from the running plan: keep every instance of it that still fits (sticky.py),
    fill the GPUs it leaves free, then switch to the fresh plan's instances one group of
    overlapping instances at a time, where the switch pays more than the margin."""
    planner = GreedyPlanner(
        cluster, demands, performance, config, now_s, efficiency, fresh_planner.evaluator
    )
    kept, stopped = keep_running(planner.evaluator, running, demands, set(planner.usable))
    running_of = {id(c): inst for c, inst in kept}
    planner.pinned = set(running_of)
    chosen = planner.run([(c, f"kept: the running {inst.name} still fits") for c, inst in kept])
    alternatives = {id(c): alts for c, alts in [*chosen, *fresh]}
    final, switches = switch_where_it_pays(
        demands,
        [c for c, _ in chosen],
        [c for c, _ in fresh],
        set(running_of),
        config.replace_margin,
        plan_score,
    )
    planner.fixed.update(fresh_planner.fixed)
    kept_ids = {id(c) for c in final if id(c) in running_of}
    for c, inst in kept:
        if id(c) not in kept_ids:
            stopped.append((inst, switches.get(id(c), "replaced")))
    reasons = {i: switches.get(i, "") for i in map(id, final)}
    result = [(c, alternatives.get(id(c), [])) for c in final]
    kept_map = {i: running_of[i] for i in kept_ids}
    order = {id(c): k for k, (c, _) in enumerate(kept)}
    result.sort(key=lambda item: order.get(id(item[0]), len(order)))
    stick_note = (
        f"running plan: {len(kept_ids)} instance(s) kept, "
        f"{len(final) - len(kept_ids)} new, {len(stopped)} stopped "
        f"(replace_margin {config.replace_margin:g})"
    )
    return _assemble(planner, result, [*notes, stick_note], kept_map, reasons, stopped)


def _assemble(
    planner: GreedyPlanner,
    chosen: _Chosen,
    notes: Sequence[str],
    kept: dict[int, PlannedInstance],
    reasons: dict[int, str],
    stopped: Sequence[tuple[PlannedInstance, str]],
) -> Plan:
    """The Plan: instances named (kept ones keep their running name, new ones take the first
    free `<model>-<n>`), demand shared by capacity, outcomes, unused GPUs, baselines, and the
    diff from the running plan (`kept`: id(candidate) -> the running instance it is)."""
    demands = planner.demands
    capacity = [0.0] * len(demands)
    capacity_tokens = [0.0] * len(demands)
    for c, _ in chosen:
        capacity[c.model_index] += c.capacity_requests_per_s
        capacity_tokens[c.model_index] += c.capacity_tokens_per_s
    served = [min(d.request_rate_per_s, cap) for d, cap in zip(demands, capacity, strict=True)]
    remaining = [d.request_rate_per_s for d in demands]
    taken_names = {i.name for i, _ in stopped} | {i.name for i in kept.values()}
    instances: list[PlannedInstance] = []
    changes: list[InstanceChange] = []
    counts = [0] * len(demands)
    for c, alternatives in chosen:
        m = c.model_index
        d = demands[m]
        share = c.capacity_requests_per_s / capacity[m] if capacity[m] else 0.0
        assigned = served[m] * share
        previous = kept.get(id(c))
        if previous is not None:
            inst = replace(
                previous,
                estimate=c.estimate,
                capacity_tokens_per_s=c.capacity_tokens_per_s,
                capacity_requests_per_s=c.capacity_requests_per_s,
                assigned_requests_per_s=assigned,
                kv_capacity_tokens=c.kv_capacity_tokens,
                max_concurrency=c.max_concurrency,
            )
            reason = "still fits its GPUs; nothing pays more than the margin to replace it"
            changes.append(InstanceChange(inst.name, "kept", reason))
        else:
            name = f"{d.name}-{counts[m]}"
            while name in taken_names:
                counts[m] += 1
                name = f"{d.name}-{counts[m]}"
            why = _why(c, d, remaining[m], planner.fixed.get(id(c)))
            inst = PlannedInstance(
                name=name,
                model=d.name,
                model_id=planner.specs[m].name,
                gear=c.gear,
                stages=c.stages,
                layers_per_stage=c.layers_per_stage,
                estimate=c.estimate,
                capacity_tokens_per_s=c.capacity_tokens_per_s,
                capacity_requests_per_s=c.capacity_requests_per_s,
                assigned_requests_per_s=assigned,
                kv_capacity_tokens=c.kv_capacity_tokens,
                max_concurrency=c.max_concurrency,
                why=why,
                alternatives=tuple(alternatives),
            )
            reason = reasons.get(id(c)) or ("no running plan" if not kept and not stopped else "")
            changes.append(InstanceChange(name, "new", reason or "on GPUs the running plan left"))
        taken_names.add(inst.name)
        remaining[m] -= min(remaining[m], c.capacity_requests_per_s)
        instances.append(inst)
        counts[m] += 1
    changes.extend(InstanceChange(i.name, "stopped", why) for i, why in stopped)
    used = {g for i in instances for g in i.gpu_ids}
    unused = list(planner.unused)
    covered = all(r <= 1e-9 for r in remaining)
    for gid in planner.usable:
        if gid not in used:
            reason = (
                "not needed: every demand is covered"
                if covered
                else "no model's gear fits it within the SLOs"
            )
            unused.append(UnusedGpu(gid, reason))
    outcomes = tuple(
        ModelOutcome(
            name=d.name,
            demand_tokens_per_s=d.demand_tokens_per_s,
            served_tokens_per_s=served[m] * d.output_tokens,
            capacity_tokens_per_s=capacity_tokens[m],
            num_instances=sum(1 for i in instances if i.model == d.name),
            num_gpus=sum(i.num_gpus for i in instances if i.model == d.name),
            priority=d.priority,
            min_instances=d.min_instances,
            demand_requests_per_s=d.request_rate_per_s,
            served_requests_per_s=served[m],
            capacity_requests_per_s=capacity[m],
        )
        for m, d in enumerate(demands)
    )
    compared: list[Baseline] = []
    if len(planner.usable) <= planner.config.max_baseline_gpus and demands and used:
        compared = baselines(planner, sorted(used, key=planner.usable.index))
    return Plan(
        tuple(instances),
        outcomes,
        tuple(unused),
        tuple(compared),
        tuple(notes),
        tuple(changes),
        tuple(i for i, _ in stopped),
    )
