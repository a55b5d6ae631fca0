"""The price of a shift (seed 000 §3.3): gain in goodput minus migration cost minus risk.

Every term is in one unit, *priority-weighted SLO-meeting requests* over the pricing horizon:

    goodput(plan)  = sum over models of priority x [w x min(L_now, cap) + (1-w) x min(L_exp, cap)]
    gain           = (goodput(target) - goodput(running)
                      - gpu_value_per_s x (gpus(target) - gpus(running))) x (horizon_s - ready_s)
    gap_cost       = (goodput_now(running) - goodput_now(interim)) x max gap_s
    migration_cost = sum over removed instances of priority x rate x share_past_deadline x pause_s
    risk           = (1 - prod(1 - r_i)) x max(gain, 0)
    score          = gain - gap_cost - migration_cost - risk

`cap` is the SLO-meeting capacity of a model's instances (requests/s) from an injected
`Capacity` (default: the planner's own estimate); `horizon_s` is cut to the earliest lease end
of the target's GPUs, and the gain accrues only once the target is ready (`ready_s`: the
slowest cold start of a started instance, or the in-place gap). A started instance that wakes
a sleeping engine (sleep mode: the same model, gear and GPUs) is ready after its wake time
(`PerfModel.wake_s` at its sleep level), not a cold start. An instance whose GPUs the
target reuses (in place) must be drained and stopped before its successor starts: the
*interim* plan lacks it for `gap_s` = drain + cold start. A removed instance's requests still
running at the drain deadline (the share `max(0, 1 - deadline / e2e)` of them) pause for the
cheaper of a KV move and a recompute (migration.py); a paused slot loses `pause_s / e2e` of a
request per request, which is why the cost is `rate x share x pause_s`. Each started instance
carries a risk coefficient by how much its topology changes (seed: 0.2 for a new TP pair, 0.5
across nodes): the chance its predicted gain does not materialise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from flexpipe.cluster import Cluster, ClusterError
from flexpipe.perf import Efficiency
from flexpipe.perf.weights import HOST_RAM
from flexpipe.policies.planner import PlannedInstance, num_gpus_held
from flexpipe.policies.shift.in_place import (
    IN_PLACE_MODES,
    MAKE_BEFORE_BREAK,
    ROLLING,
    SIDE_BY_SIDE,
    WAKE,
    choose_in_place,
)
from flexpipe.policies.shift.migration import choose_migration, link_between, perf_model_of
from flexpipe.policies.shift.snapshot import ModelState, instance_key
from flexpipe.policies.shift.step_order import plan_shift

__all__ = [
    "Capacity",
    "Loads",
    "Price",
    "PricingParams",
    "goodput_per_s",
    "planned_capacity",
    "price",
]

# instance -> the SLO-meeting requests/s it serves at most (planner estimate, gear table,
# or what the controller measured)
Capacity = Callable[[PlannedInstance], float]
# model name -> (load now, load expected) in requests/s
Loads = Mapping[str, tuple[float, float]]


def planned_capacity(instance: PlannedInstance) -> float:
    """The planner's estimate: SLO-meeting requests/s at its target utilisation."""
    return instance.capacity_requests_per_s


@dataclass(frozen=True, slots=True)
class PricingParams:
    horizon_s: float = 1800.0  # how long a new plan is expected to serve
    current_load_weight: float = 0.5  # w: load now vs the expected load
    # In the up zone the measured rate understates the need (the queue is building): price
    # and plan for (1 + up_step) x the measured rate.
    up_step: float = 0.5
    # A down-shift keeps capacity for (1 + down_headroom) x max(load now, expected).
    down_headroom: float = 0.25
    drain_deadline_s: float = 30.0  # old instances drain this long before requests move
    # What a GPU given back is worth, in priority-weighted requests/s per GPU: a tie-breaker
    # that prefers fewer GPUs at equal goodput (a down-shift's whole gain).
    gpu_value_per_s: float = 0.05
    risk_restart: float = 0.05  # a one-GPU instance, or the same GPUs and shape re-launched
    risk_new_group: float = 0.2  # a new TP/PP group inside one node
    risk_cross_node: float = 0.5  # an instance spanning nodes
    # the engines can hand a request's KV over (flexpipe/engine_kinds.py); else moves recompute
    kv_moves: bool = True
    # How an in-place step re-gears (in_place.py): rolling (drain, release, cold start) or
    # make_before_break (side by side where memory allows, else a pre-started sleeper woken
    # after a drain of `in_place_drain_s`: the gap is that drain plus a wake).
    in_place: str = ROLLING
    in_place_drain_s: float = 2.0

    def __post_init__(self) -> None:
        if self.horizon_s <= 0 or not 0 <= self.current_load_weight <= 1:
            raise ValueError("horizon_s must be > 0 and current_load_weight in [0, 1]")
        if min(self.up_step, self.down_headroom, self.drain_deadline_s, self.gpu_value_per_s) < 0:
            raise ValueError("up_step, down_headroom, drain_deadline_s, gpu_value_per_s >= 0")
        for r in (self.risk_restart, self.risk_new_group, self.risk_cross_node):
            if not 0 <= r < 1:
                raise ValueError("risk coefficients must be in [0, 1)")
        if self.in_place not in IN_PLACE_MODES:
            raise ValueError(
                f"in_place must be one of {', '.join(IN_PLACE_MODES)}, got {self.in_place!r}"
            )
        if self.in_place_drain_s < 0:
            raise ValueError("in_place_drain_s must be >= 0")


@dataclass(frozen=True, slots=True)
class Price:
    goodput_running_per_s: float  # priority-weighted, blended over the two loads
    goodput_target_per_s: float
    num_gpus_running: int
    num_gpus_target: int
    horizon_s: float
    gain: float  # requests over the horizon (see the module docstring)
    gap_cost: float
    migration_cost: float
    risk_fraction: float
    risk: float
    added: tuple[str, ...]  # instance keys started
    removed: tuple[str, ...]  # instance keys stopped
    notes: tuple[str, ...]  # one line per gap, migration and risk term

    @property
    def score(self) -> float:
        return self.gain - self.gap_cost - self.migration_cost - self.risk

    @property
    def goodput_gain_per_s(self) -> float:
        return self.goodput_target_per_s - self.goodput_running_per_s

    def to_dict(self) -> dict[str, object]:
        return {
            "score": round(self.score, 3),
            "gain": round(self.gain, 3),
            "gap_cost": round(self.gap_cost, 3),
            "migration_cost": round(self.migration_cost, 3),
            "risk": round(self.risk, 3),
            "risk_fraction": round(self.risk_fraction, 4),
            "horizon_s": self.horizon_s,
            "goodput_running_per_s": round(self.goodput_running_per_s, 4),
            "goodput_target_per_s": round(self.goodput_target_per_s, 4),
            "num_gpus_running": self.num_gpus_running,
            "num_gpus_target": self.num_gpus_target,
            "added": list(self.added),
            "removed": list(self.removed),
            "notes": list(self.notes),
        }


def _model_capacity(instances: Sequence[PlannedInstance], capacity: Capacity) -> dict[str, float]:
    out: dict[str, float] = {}
    for inst in instances:
        out[inst.model] = out.get(inst.model, 0.0) + capacity(inst)
    return out


def goodput_per_s(
    instances: Sequence[PlannedInstance],
    models: Sequence[ModelState],
    loads: Loads,
    capacity: Capacity,
    current_load_weight: float,
) -> float:
    """Priority-weighted SLO-meeting requests/s, blended over the load now and expected."""
    caps = _model_capacity(instances, capacity)
    w = current_load_weight
    total = 0.0
    for m in models:
        now, expected = loads[m.name]
        cap = caps.get(m.name, 0.0)
        total += m.priority * (w * min(now, cap) + (1 - w) * min(expected, cap))
    return total


def _overlap(a: PlannedInstance, b: PlannedInstance) -> int:
    return len(set(a.gpu_ids) & set(b.gpu_ids))


def _predecessor(
    inst: PlannedInstance, removed: Sequence[PlannedInstance]
) -> PlannedInstance | None:
    """The removed instance of the same model sharing most GPUs with `inst` (None: none)."""
    same = [r for r in removed if r.model == inst.model and _overlap(r, inst) > 0]
    return max(same, key=lambda r: _overlap(r, inst)) if same else None


def _risk_of(
    cluster: Cluster, inst: PlannedInstance, pred: PlannedInstance | None, params: PricingParams
) -> tuple[float, str]:
    nodes = {cluster.gpu(g).node for g in inst.gpu_ids}
    if len(nodes) > 1:
        return params.risk_cross_node, f"spans nodes {', '.join(sorted(nodes))}"
    if inst.num_gpus == 1:
        return params.risk_restart, "one GPU"
    if (
        pred is not None
        and set(pred.gpu_ids) == set(inst.gpu_ids)
        and (pred.gear.tp, pred.gear.pp) == (inst.gear.tp, inst.gear.pp)
    ):
        return params.risk_restart, "same GPUs and shape re-launched"
    return params.risk_new_group, f"new tp={inst.gear.tp} pp={inst.gear.pp} group"


def _successor(
    removed: PlannedInstance, target: Sequence[PlannedInstance]
) -> PlannedInstance | None:
    """Where a removed instance's requests continue: the target instance of its model that
    shares most GPUs with it, else the one with the most capacity (None: the model has no
    instance left, its requests finish in place)."""
    same = [t for t in target if t.model == removed.model]
    if not same:
        return None
    return max(same, key=lambda t: (_overlap(t, removed), t.capacity_requests_per_s))


def price(
    cluster: Cluster,
    running: Sequence[PlannedInstance],
    target: Sequence[PlannedInstance],
    models: Sequence[ModelState],
    loads: Loads,
    now_s: float,
    params: PricingParams,
    capacity: Capacity = planned_capacity,
    efficiency: Efficiency | None = None,
    asleep_levels: Mapping[str, int] | None = None,
) -> Price:
    """Price moving from `running` to `target` (see the module docstring). `asleep_levels`:
    instance key -> sleep level of the engines asleep (a target instance among them wakes)."""
    asleep_levels = asleep_levels or {}
    by_name = {m.name: m for m in models}
    running_keys = {instance_key(i) for i in running}
    target_keys = {instance_key(i) for i in target}
    removed = [i for i in running if instance_key(i) not in target_keys]
    added = [i for i in target if instance_key(i) not in running_keys]
    notes: list[str] = []
    w = params.current_load_weight

    # Horizon: the target serves until the earliest lease on a GPU it starts on ends.
    horizon_s = params.horizon_s
    for inst in added:
        for g in inst.gpu_ids:
            until = cluster.gpu(g).free_until_s
            if until is not None and until - now_s < horizon_s:
                horizon_s = max(0.0, until - now_s)
                notes.append(f"horizon cut to {horizon_s:.0f} s: {g} is free only until then")

    g_run = goodput_per_s(running, models, loads, capacity, w)
    g_tgt = goodput_per_s(target, models, loads, capacity, w)
    gpus_run = num_gpus_held(running)  # (a GPU shared in memory counted once)
    gpus_tgt = num_gpus_held(target)

    # Gap: removed instances whose GPUs an added one reuses stop before it starts.
    cold: dict[str, float] = {}  # added key -> cold start (or wake), s
    for inst in added:
        key = instance_key(inst)
        pm = perf_model_of(cluster, inst, efficiency)
        level = asleep_levels.get(key)
        cold[key] = pm.cold_start_s() if level is None else pm.wake_s(level)
        if level is not None:
            notes.append(f"{key} wakes from sleep level {level} in {cold[key]:.2f} s")
    in_place = [r for r in removed if any(_overlap(r, a) for a in added)]
    gap_s = 0.0
    deadline_of: dict[str, float] = {}  # removed key -> its drain deadline, if not the usual
    if params.in_place == MAKE_BEFORE_BREAK and in_place:
        in_place, gap_s = _make_before_break(
            cluster, running, target, params, efficiency, cold, deadline_of, notes
        )
    for r in in_place if params.in_place == ROLLING else ():
        drain_s = min(params.drain_deadline_s, r.estimate.e2e_s)
        for a in added:
            if _overlap(r, a):
                gap_s = max(gap_s, drain_s + cold[instance_key(a)])
                notes.append(
                    f"in place: {instance_key(r)} drains {drain_s:.1f} s, then "
                    f"{instance_key(a)} cold-starts {cold[instance_key(a)]:.1f} s"
                )
    now_loads = {name: (cur, cur) for name, (cur, _) in loads.items()}
    in_place_keys = {instance_key(r) for r in in_place}
    interim = [i for i in running if instance_key(i) not in in_place_keys]
    lost_per_s = goodput_per_s(running, models, now_loads, capacity, 1.0) - goodput_per_s(
        interim, models, now_loads, capacity, 1.0
    )
    gap_cost = max(0.0, lost_per_s) * gap_s

    # The gain accrues once the target is ready: its slowest cold start, or the in-place gap.
    ready_s = max([gap_s, *cold.values()])
    gain_s = max(0.0, horizon_s - ready_s)
    if added:
        notes.append(f"gain accrues for {gain_s:.0f} s: the target is ready after {ready_s:.1f} s")
    gain = (g_tgt - g_run - params.gpu_value_per_s * (gpus_tgt - gpus_run)) * gain_s

    # Requests still running at the drain deadline pause while they move.
    caps_run = _model_capacity(running, capacity)
    migration_cost = 0.0
    for r in removed:
        model = by_name[r.model]
        cap = caps_run.get(r.model, 0.0)
        rate = loads[r.model][0] * capacity(r) / cap if cap > 0 else 0.0
        e2e_s = r.estimate.e2e_s
        deadline_s = deadline_of.get(instance_key(r), params.drain_deadline_s)
        share = max(0.0, 1.0 - deadline_s / e2e_s) if e2e_s > 0 else 0.0
        succ = _successor(r, target)
        if succ is None or share <= 0 or rate <= 0:
            continue
        context = model.demand.workload.mean_context_tokens
        link = None
        if params.kv_moves:
            with contextlib.suppress(ClusterError):
                link = link_between(cluster, r, succ)
        choice = choose_migration(perf_model_of(cluster, succ, efficiency), context, link)
        cost = model.priority * rate * share * choice.pause_s
        migration_cost += cost
        notes.append(
            f"{instance_key(r)}: {share:.0%} of {rate:.2f} req/s still running at the deadline, "
            f"{choice.method} to {instance_key(succ)} pauses {choice.pause_s:.3f} s"
        )

    keep = 1.0
    for a in added:
        r_i, why = _risk_of(cluster, a, _predecessor(a, removed), params)
        keep *= 1 - r_i
        notes.append(f"risk {r_i:g} for {instance_key(a)}: {why}")
    risk_fraction = 1 - keep
    risk = risk_fraction * max(gain, 0.0)
    return Price(
        goodput_running_per_s=g_run,
        goodput_target_per_s=g_tgt,
        num_gpus_running=gpus_run,
        num_gpus_target=gpus_tgt,
        horizon_s=horizon_s,
        gain=gain,
        gap_cost=gap_cost,
        migration_cost=migration_cost,
        risk_fraction=risk_fraction,
        risk=risk,
        added=tuple(instance_key(i) for i in added),
        removed=tuple(instance_key(i) for i in removed),
        notes=tuple(notes),
    )


def _make_before_break(
    cluster: Cluster,
    running: Sequence[PlannedInstance],
    target: Sequence[PlannedInstance],
    params: PricingParams,
    efficiency: Efficiency | None,
    cold: dict[str, float],
    deadline_of: dict[str, float],
    notes: list[str],
) -> tuple[list[PlannedInstance], float]:
    """The in-place steps as the procedure carries them out under `make_before_break`
    (in_place.py, the same choice): (the removed instances whose capacity is lost meanwhile,
    the longest gap). Side by side loses nothing; a pre-started sleeper loses its
    predecessors for the short drain plus its wake, and is ready after its cold start, its
    sleep and that gap (`cold` is updated so); `deadline_of` gets the short drain."""
    lost: list[PlannedInstance] = []
    gap_s = 0.0
    for blockers, adds in plan_shift(running, target, scale_to_zero=True).steps:
        choice = choose_in_place(
            cluster, blockers, adds, lambda p: perf_model_of(cluster, p, efficiency), (1, 2)
        )
        if choice.how == SIDE_BY_SIDE:
            notes.append(f"in place, side by side: {', '.join(map(instance_key, adds))}")
            continue
        lost.extend(blockers)
        if choice.how != WAKE:  # rolling, as without make_before_break
            drain_s = max(
                (min(params.drain_deadline_s, b.estimate.e2e_s) for b in blockers), default=0.0
            )
            step_s = drain_s + max((cold[instance_key(a)] for a in adds), default=0.0)
            gap_s = max(gap_s, step_s)
            notes.append(f"in place, cold: {choice.why}; gap {step_s:.1f} s")
            continue
        drain_s = max(
            (min(params.in_place_drain_s, b.estimate.e2e_s) for b in blockers), default=0.0
        )
        for b in blockers:
            deadline_of[instance_key(b)] = params.in_place_drain_s
        for a in adds:
            key = instance_key(a)
            pm = perf_model_of(cluster, a, efficiency)
            source = None if choice.source == HOST_RAM else pm.default_weight_source()
            wake_s = pm.wake_s(choice.level, source)
            step_s = drain_s + wake_s
            gap_s = max(gap_s, step_s)
            cold[key] = cold[key] + pm.sleep_s(choice.level) + step_s
            notes.append(
                f"in place: {key} pre-started asleep at level {choice.level}; the old drain "
                f"{drain_s:.1f} s, then it wakes from {choice.source} in {wake_s:.2f} s"
            )
    return lost, gap_s
