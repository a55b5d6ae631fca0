"""Stickiness: the running plan as the planner's starting point (docs/planner.md).

A re-plan that moves instances for a sliver of goodput costs a drain, a cold start and
migrated requests, which the planner does not price (the shift policy does). So:

1. `keep_running`: every running instance that still fits its GPUs as it runs (its gear,
   batch and layer split; memory plan, KV for its batch and the SLOs at it, on the GPUs as
   they are now) is kept; the others are stopped, each with why. Instances sharing a GPU in
   memory are kept together while they still fit it together (docs/gpu-sharing.md).
2. The planner fills the GPUs the kept instances leave (core.py).
3. `switch_where_it_pays`: the fresh plan (made from scratch) is compared group by group:
   a *group* is a connected set of instances, kept-or-filled and fresh, that share GPUs, so
   switching one group never touches another's GPUs. A group is switched, best first, when
   it meets more minimums, or raises the priority-weighted goodput by more than
   `replace_margin` times what the running instances it replaces serve now (no margin for
   instances not yet running). On an unchanged cluster the fresh plan is the running one,
   there is nothing to switch, and the running plan comes back exactly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

from flexpipe.policies.planner.candidates import Candidate, Evaluator, Rejection
from flexpipe.policies.planner.share_fit import Member, misfit, shared_capacities
from flexpipe.policies.planner.types import ModelDemand, Plan, PlannedInstance

__all__ = ["keep_running", "switch_where_it_pays"]

# (demands, instances) -> (minimums met, weighted goodput, -GPUs): core.plan_score
Score = Callable[[Sequence[ModelDemand], Sequence[Candidate]], tuple[float, float, int]]


def keep_running(
    evaluator: Evaluator,
    running: Plan,
    demands: Sequence[ModelDemand],
    usable: set[str],
) -> tuple[list[tuple[Candidate, PlannedInstance]], list[tuple[PlannedInstance, str]]]:
    """The running instances that still fit as they run (each re-evaluated now), and the ones
    that do not, with why. Instances that share a GPU in memory (`gpu_memory_fraction`,
    docs/gpu-sharing.md) are kept together while the group still fits it as it runs
    (share_fit.misfit), each at the capacity the others' load leaves it."""
    index = {d.name: m for m, d in enumerate(demands)}
    num_of = Counter(i.model for i in running.instances)
    kept: list[tuple[Candidate, PlannedInstance]] = []
    stopped: list[tuple[PlannedInstance, str]] = []
    used: set[str] = set()  # GPUs a kept instance holds whole
    # GPU -> the kept instances sharing it (their places in `kept`), and each one's load
    shared: dict[str, list[int]] = {}
    members: dict[int, Member] = {}
    for inst in running.instances:
        m = index.get(inst.model)
        lost = [g for g in inst.gpu_ids if g not in usable]
        sharing = inst.gpu_memory_fraction is not None and inst.num_gpus == 1
        taken = used | (set() if sharing else set(shared))
        if m is None:
            stopped.append((inst, f"{inst.model} is no longer among the models"))
        elif lost:
            stopped.append((inst, f"{', '.join(lost)} no longer usable"))
        elif not taken.isdisjoint(inst.gpu_ids):
            stopped.append((inst, "shares GPUs with another running instance"))
        elif inst.gear.dtype not in demands[m].dtypes:
            stopped.append((inst, f"{inst.gear.dtype} is no longer an accepted precision"))
        else:
            result = evaluator.evaluate_as_is(
                m, inst.stages, inst.gear, inst.layers_per_stage, inst.gpu_memory_fraction
            )
            if isinstance(result, Rejection):
                stopped.append((inst, f"no longer fits: {result.reason}"))
                continue
            kept.append((result, inst))
            if not sharing:
                used.update(inst.gpu_ids)
                continue
            # (a model's load split evenly over its running instances)
            load_per_s = demands[m].request_rate_per_s / num_of[inst.model]
            members[len(kept) - 1] = Member(m, inst.gear.dtype, load_per_s)
            gpu = inst.gpu_ids[0]
            trial = [*shared.get(gpu, []), len(kept) - 1]
            why = misfit(
                evaluator,
                [members[k] for k in trial],
                [kept[k][0].estimate for k in trial],
                [kept[k][1].gpu_memory_fraction or 0.0 for k in trial],
                gpu,
            )
            if why is None:
                shared[gpu] = trial
            else:
                kept.pop()
                stopped.append((inst, f"no longer fits: {why}"))
    for group in shared.values():  # each at its capacity beside the others
        estimates = [kept[k][0].estimate for k in group]
        caps = shared_capacities(evaluator, [members[k] for k in group], estimates)
        for k, cap in zip(group, caps, strict=True):
            c, inst = kept[k]
            tokens_per_s = cap * c.estimate.output_tokens_per_s / c.estimate.requests_per_s
            kept[k] = (
                replace(c, capacity_requests_per_s=cap, capacity_tokens_per_s=tokens_per_s),
                inst,
            )
    return kept, stopped


def _key(c: Candidate) -> tuple[object, ...]:
    return c.model_index, c.stages, c.gear


def _groups(base: Sequence[Candidate], new: Sequence[Candidate]) -> list[list[int]]:
    """Connected components (indexes into base + new) of 'shares a GPU', in first-seen order."""
    items = [*base, *new]
    parent = list(range(len(items)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, c in enumerate(items):
        for g in c.gpu_ids:
            j = owner.setdefault(g, i)
            if j != i:
                parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(items)):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


def _served_by(
    demands: Sequence[ModelDemand], plan: Sequence[Candidate], members: Sequence[Candidate]
) -> float:
    """Priority-weighted requests/s `members` serve in `plan` (demand shared by capacity)."""
    capacity = [0.0] * len(demands)
    for c in plan:
        capacity[c.model_index] += c.capacity_requests_per_s
    total = 0.0
    for c in members:
        m = c.model_index
        if capacity[m] > 0:
            served = min(demands[m].request_rate_per_s, capacity[m])
            total += demands[m].priority * served * c.capacity_requests_per_s / capacity[m]
    return total


def switch_where_it_pays(
    demands: Sequence[ModelDemand],
    base: Sequence[Candidate],
    fresh: Sequence[Candidate],
    running_ids: set[int],
    margin: float,
    score: Score,
) -> tuple[list[Candidate], dict[int, str]]:
    """`base` (kept running instances, id in `running_ids`, plus the fill) with the groups of
    `fresh` switched in where it pays (module docstring). Returns the instances and, per
    id(candidate) switched in or out, why."""
    have = {_key(c) for c in base}
    new = [c for c in fresh if _key(c) not in have]
    current = list(base)
    reasons: dict[int, str] = {}
    options: list[tuple[list[Candidate], list[Candidate]]] = []
    for group in _groups(base, new):
        out = [base[i] for i in group if i < len(base)]
        added = [new[i - len(base)] for i in group if i >= len(base)]
        if added:
            options.append((out, added))
    while options:
        now = score(demands, current)
        best: tuple[tuple[float, float, int], int, float, float] | None = None
        for k, (out, added) in enumerate(options):
            gone = {id(c) for c in out}
            trial = [*(c for c in current if id(c) not in gone), *added]
            after = score(demands, trial)
            if after[0] < now[0]:
                continue
            at_stake = _served_by(demands, current, [c for c in out if id(c) in running_ids])
            gain = after[1] - now[1]
            if after[0] == now[0]:
                if at_stake > 0 and not gain > max(margin * at_stake, 1e-9):
                    continue
                if after <= now:
                    continue
            if best is None or after > best[0]:
                best = (after, k, gain, at_stake)
        if best is None:
            break
        _, k, gain, at_stake = best
        out, added = options.pop(k)
        gone = {id(c) for c in out}
        current = [*(c for c in current if id(c) not in gone), *added]
        what = f"+{gain:.3g} weighted req/s" + (
            f" > margin {margin:g} x {at_stake:.3g} served" if at_stake > 0 else ""
        )
        replaced = [c for c in out if id(c) in running_ids]
        for c in out:
            reasons[id(c)] = f"replaced: {what}"
        for c in added:
            reasons[id(c)] = f"replaces running instances: {what}" if replaced else what
    return current, reasons
