"""Standby engines asleep ahead of demand (pure): which to start, which to wake aside.

A burst for a model whose engine sleeps is answered in a wake (~0.5 s for a 7B at level 1);
one for a model with none waits a cold start (~28 s), longer than many bursts. So the
controller keeps, per model, engines asleep before the demand comes (docs/controller.md,
"Standby sleepers"):

- `standby_wanted`: the standby engines to start (each is launched, then put to sleep at
  the level `control/core/sleeping.py` gives it: level 1 where its node's host RAM holds the
  weights, else level 2). A model keeps `num_per_model` engines awake or asleep, or as many
  as it had awake at once so far (the gears its bursts needed: the next burst likely needs
  them again), at most `max_per_model`. They go on GPUs no awake engine, no loading one and
  no other sleeper holds; where none is left and `share_gpus` is on, on GPUs where another
  model's engine sleeps (time-sharing: only one of them can be awake at a time; the shift
  policy wakes a sleeper only on GPUs no running instance holds).
- `wakes_aside`: the sleepers woken at once for models with requests waiting, while a shift
  of other models runs, on GPUs that shift does not touch: a burst is not made to wait for
  a drain somewhere else.
- Time-sharing (`time_share`): flexpipe/policies/shift/time_share.py.
- `with_sleepers`: the cluster as the planner sees it, with the GPU memory each sleeping
  engine still holds (its reserve: CUDA context, NCCL buffers) counted as used.

The shell (the simulator's controller) calls these with plain data and carries the answer
out through the shift procedure, as every other change of instances.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from flexpipe.cluster import Cluster
from flexpipe.policies.planner import ModelDemand, PlannedInstance
from flexpipe.policies.shift.candidates import Planner, free_of, keepable
from flexpipe.policies.shift.snapshot import instance_key

__all__ = [
    "StandbyParams",
    "arrived",
    "idle_since",
    "most_awake",
    "peak_rates",
    "pressed",
    "recent_rates",
    "sleeps_aside",
    "standby_rate_per_s",
    "standby_wanted",
    "wakes_aside",
    "with_sleepers",
]


@dataclass(frozen=True, slots=True)
class StandbyParams:
    """`shift.standby` (off by default: nothing is started ahead of demand)."""

    enabled: bool = False
    num_per_model: int = 1  # engines per model, awake or asleep, kept at least
    max_per_model: int = 4  # never more standbys than this per model (awake + asleep)
    share_gpus: bool = False  # a standby may sleep where another model's engine sleeps
    wake_aside: bool = True  # wake a waiting model's sleepers at once, beside the shifts
    aside_tick_s: float = 0.0  # how often that is looked at (0: every controller tick)
    rate_factor: float = 1.0  # standbys are planned for the declared rate times this
    keep_for_wake: bool = False  # the planner places no new instance on a sleeper's GPUs
    busy_fraction: float = 0.0  # wake aside also when this share of the slots is taken
    wakes_per_tick: int = 0  # sleepers of a model woken aside at once (0: all)
    sleep_idle_s: float = 0.0  # a model idle this long sleeps aside (0: the down trigger)
    time_share: bool = False  # a standby may sleep beside another model's awake engine
    # standbys planned at the SLO (the planner's `sizing: slo`, built by the shell): a
    # standby covers the rate at which it meets the TTFT and TPOT p99 with queueing
    # (perf/slo_capacity.py), so a weak pipeline counts only for what it serves in the SLO
    slo_gears: bool = False
    # the peak rate a standby set is sized for is the arrivals' (finished + in flight +
    # waiting, `arrived`), not the finished requests' alone: those are capped by the
    # capacity that served the burst, so a set too small would never see it was
    arrival_peaks: bool = False
    # no standby is a pipeline (pp > 1): a prompt's prefill stalls every stage's decode, so
    # such a gear misses the TPOT SLO at rates its planned capacity claims (bursty-serverless:
    # qwen-14b and llama-13b on L40S pipelines, docs/shift-policy.md)
    single_stage: bool = False
    # the outlook drives the standby rate (standby_outlook.py): > 0, its horizon; a model
    # whose rate history shows bursts is sized for their mean peak times `burst_margin`
    # where one is at least `min_burst_likelihood` likely, in place of `rate_factor`
    outlook_horizon_s: float = 0.0
    burst_margin: float = 1.0
    min_burst_likelihood: float = 0.5
    # time-sharing: a standby goes beside other models' engines only on a GPU fewer than
    # this many other models hold (0: any): guests spread over the GPUs instead of piling
    # onto the first, where each burst of its owner finds a guest awake in its place
    max_models_per_gpu: int = 0
    # time-sharing: a standby goes beside the engines of the model busy the least share of
    # the time first (mean over peak rate): its own bursts seldom find the guest awake there
    quiet_hosts_first: bool = False
    # time-sharing: a model takes its own GPU back from another model's standby placed
    # beside its engine there (a guest, `guests`), even while the guest serves: else a burst
    # of the host found its best GPU held by a guest serving a burst of its own and waited
    # with what else it had (bursty-serverless seed 1: code-7b's H100, chat-8b's guest)
    hosts_take_back: bool = False

    def __post_init__(self) -> None:
        if self.num_per_model < 0 or self.max_per_model < 0:
            raise ValueError("num_per_model and max_per_model must be >= 0")
        if min(self.aside_tick_s, self.rate_factor, self.busy_fraction, self.sleep_idle_s) < 0:
            raise ValueError("aside_tick_s, rate_factor, busy_fraction, sleep_idle_s: >= 0")
        if self.wakes_per_tick < 0 or self.max_models_per_gpu < 0:
            raise ValueError("wakes_per_tick and max_models_per_gpu must be >= 0")
        if min(self.outlook_horizon_s, self.burst_margin, self.min_burst_likelihood) < 0:
            raise ValueError("outlook_horizon_s, burst_margin, min_burst_likelihood: >= 0")


def most_awake(before: Mapping[str, int], running: Iterable[PlannedInstance]) -> dict[str, int]:
    """Model -> the most instances it had awake at once: `before`, or now if more."""
    now: dict[str, int] = {}
    for inst in running:
        now[inst.model] = now.get(inst.model, 0) + 1
    return {m: max(before.get(m, 0), now.get(m, 0)) for m in {*before, *now}}


def peak_rates(before: Mapping[str, float], rates_per_s: Mapping[str, float]) -> dict[str, float]:
    """Model -> the highest rate measured so far: `before`, or now if more."""
    return {m: max(before.get(m, 0.0), rates_per_s.get(m, 0.0)) for m in {*before, *rates_per_s}}


def recent_rates(seen: Sequence[tuple[float, Mapping[str, float]]]) -> dict[str, float]:
    """Model -> requests finished per second between the first and the last of `seen`
    ((time s, cumulative finished requests by model), oldest first): a burst's rate over a
    few ticks, which the minute's rate the forecast reads would dilute."""
    if len(seen) < 2 or seen[-1][0] <= seen[0][0]:
        return {}
    (t0, first), (t1, last) = seen[0], seen[-1]
    return {m: max(0.0, n - first.get(m, 0.0)) / (t1 - t0) for m, n in sorted(last.items())}


def arrived(
    finished_by_model: Mapping[str, float],
    instances: Sequence[Mapping[str, Any]],
    queued_by_model: Mapping[str, int],
) -> dict[str, float]:
    """Model -> requests arrived so far: finished, in flight on an engine (its pool
    records, as `GET /admin/instances` lists them) or waiting in the gateway. Its rate over
    a few ticks (`recent_rates`) is the demand's, even where the engines fall behind."""
    out = {m: float(n) for m, n in finished_by_model.items()}
    for rec in instances:
        model = str(rec.get("model"))
        out[model] = out.get(model, 0.0) + float(rec.get("num_in_flight") or 0)
    for m, n in queued_by_model.items():
        out[m] = out.get(m, 0.0) + n
    return dict(sorted(out.items()))


def _count(instances: Iterable[PlannedInstance]) -> dict[str, int]:
    out: dict[str, int] = {}
    for inst in instances:
        out[inst.model] = out.get(inst.model, 0) + 1
    return out


def standby_rate_per_s(
    demand: ModelDemand, peak_rates_per_s: Mapping[str, float], params: StandbyParams
) -> float:
    """The rate a model's standby set is planned for: its declared rate times
    `rate_factor` (how far above its mean the operator expects it to burst), or the highest
    rate measured for it so far if that is more. With `outlook_horizon_s`,
    `peak_rates_per_s` holds the outlook's rates (standby_outlook.py) instead, and a model's
    there replaces the factor's: its bursts seen say more than one factor for all."""
    measured = peak_rates_per_s.get(demand.name)
    if params.outlook_horizon_s > 0 and measured is not None:
        return measured
    return max(demand.request_rate_per_s * params.rate_factor, measured or 0.0)


def _tally(instances: Sequence[PlannedInstance]) -> tuple[dict[str, int], dict[str, float]]:
    """Model -> (its engines, their planned capacity in requests/s)."""
    capacity: dict[str, float] = {}
    for inst in instances:
        capacity[inst.model] = capacity.get(inst.model, 0.0) + inst.capacity_requests_per_s
    return _count(instances), capacity


def _asks(
    demands: Sequence[ModelDemand],
    have: Mapping[str, int],
    capacity: Mapping[str, float],
    peak_counts: Mapping[str, int],
    peak_rates_per_s: Mapping[str, float],
    params: StandbyParams,
    skip: Collection[str],
) -> dict[str, ModelDemand]:
    """Model -> its demand at its standby rate, for the models short of standbys: fewer
    engines than `num_per_model` or than it had awake at once, or too little capacity for
    its standby rate, and below `max_per_model`."""
    asks: dict[str, ModelDemand] = {}
    for d in demands:
        rate_per_s = standby_rate_per_s(d, peak_rates_per_s, params)
        want = max(params.num_per_model, peak_counts.get(d.name, 0))
        if d.name in skip or have.get(d.name, 0) >= params.max_per_model:
            continue
        if capacity.get(d.name, 0.0) < rate_per_s or have.get(d.name, 0) < want:
            asks[d.name] = replace(d, request_rate_per_s=rate_per_s)
    return asks


def standby_wanted(
    cluster: Cluster,
    demands: Sequence[ModelDemand],
    awake: Sequence[PlannedInstance],
    asleep: Sequence[PlannedInstance],
    peak_counts: Mapping[str, int],
    peak_rates_per_s: Mapping[str, float],
    planner: Planner,
    now_s: float,
    params: StandbyParams,
    skip: Collection[str] = (),
) -> list[PlannedInstance]:
    """The standby engines to start now (see the module docstring), in demand order.
    `cluster`: the GPUs free to us (other tenants' memory used); `awake`: the running
    instances (and those starting); `asleep`: the sleeping ones; `peak_counts`:
    `most_awake` so far; `peak_rates_per_s`: the highest rate measured per model; `skip`:
    models not to start any for (say, those with requests waiting: their shift comes
    first).

    A model wants engines, awake or asleep, whose planned capacity covers its
    `standby_rate_per_s` (its burst), at least `num_per_model` of them and as many as it had
    awake at once, at most `max_per_model`. Those it lacks are placed one per model a round,
    each by the planner for the rate still uncovered, on the GPUs nothing of ours holds
    (where others sleep too, with `share_gpus`)."""
    if not params.enabled:
        return []
    have, capacity = _tally([*awake, *asleep])
    asks = _asks(demands, have, capacity, peak_counts, peak_rates_per_s, params, skip)
    chosen: list[PlannedInstance] = []
    # one standby per model a round, so that the first models do not take every GPU; a model
    # gets more until its engines' capacity covers its standby rate
    while asks:
        for name, ask in list(asks.items()):
            mine = [i for i in asleep if i.model == name]
            views = [asleep, mine] if params.share_gpus else [asleep]
            rest = _uncovered(ask, capacity)
            placed: list[PlannedInstance] = []
            for sleeping in views:
                taken = free_of(cluster, [*awake, *chosen, *sleeping])
                placed = _placed(taken, rest, 1, planner, now_s, params.single_stage)
                if placed:
                    break
            if not placed:
                del asks[name]
                continue
            chosen.extend(placed)
            _count_placed(asks, ask, placed[0], have, capacity, peak_counts, params)
    return chosen


def _uncovered(ask: ModelDemand, capacity: Mapping[str, float]) -> ModelDemand:
    """`ask` for the rate its model's engines do not cover yet."""
    covered = capacity.get(ask.name, 0.0)
    return replace(ask, request_rate_per_s=max(0.0, ask.request_rate_per_s - covered))


def _count_placed(
    asks: dict[str, ModelDemand],
    ask: ModelDemand,
    placed: PlannedInstance,
    have: dict[str, int],
    capacity: dict[str, float],
    peak_counts: Mapping[str, int],
    params: StandbyParams,
) -> None:
    """One more standby of `ask`'s model counted; its ask dropped once the model has the
    engines it wants and their capacity covers its rate, or has `max_per_model`."""
    name = ask.name
    have[name] = have.get(name, 0) + 1
    capacity[name] = capacity.get(name, 0.0) + placed.capacity_requests_per_s
    want = max(params.num_per_model, peak_counts.get(name, 0))
    if have[name] >= params.max_per_model or (
        capacity[name] >= ask.request_rate_per_s and have[name] >= want
    ):
        del asks[name]


def _placed(
    cluster: Cluster,
    demand: ModelDemand,
    num: int,
    planner: Planner,
    now_s: float,
    single_stage: bool = False,
) -> list[PlannedInstance]:
    """Up to `num` of the planner's instances of `demand` alone on `cluster` (at least one
    where it places any: `min_instances`); no pipeline with `single_stage`."""
    ask = replace(demand, min_instances=max(1, demand.min_instances))
    mine = [i for i in planner(cluster, (ask,), now_s).instances if i.model == demand.name]
    if single_stage:
        mine = [i for i in mine if len(i.stages) == 1]
    return mine[:num]


def pressed(
    instances: Sequence[Mapping[str, Any]],
    queued_by_model: Mapping[str, int],
    busy_fraction: float,
) -> dict[str, int]:
    """Model -> 1 where it needs more engines now, from what the gateway exposes (its pool
    records, as `GET /admin/instances` lists them, and its wait queue by model): requests
    wait in the gateway, or in an active engine's own queue, or its active engines hold at
    least `busy_fraction` of their slots (0: that test is off). Ahead of the TTFT samples,
    which come only once the first tokens are late."""
    out = {m: 1 for m, n in queued_by_model.items() if n > 0}
    in_flight: dict[str, float] = {}
    slots: dict[str, float] = {}
    for rec in instances:
        if rec.get("state") != "active":
            continue
        model = str(rec.get("model"))
        if float(rec.get("num_waiting") or 0) > 0:
            out[model] = 1
        in_flight[model] = in_flight.get(model, 0.0) + float(rec.get("num_in_flight") or 0)
        slots[model] = slots.get(model, 0.0) + float(rec.get("max_num_seqs") or 0)
    if busy_fraction > 0:
        for model, n in in_flight.items():
            if slots[model] > 0 and n >= busy_fraction * slots[model]:
                out[model] = 1
    return dict(sorted(out.items()))


def idle_since(
    before: Mapping[str, float],
    instances: Sequence[Mapping[str, Any]],
    queued_by_model: Mapping[str, int],
    now_s: float,
) -> dict[str, float]:
    """Model -> since when it has active engines that serve nothing and no request waits
    for it (`before`: the last answer); a model that serves something, or has no active
    engine, is left out."""
    in_flight: dict[str, float] = {}
    for rec in instances:
        if rec.get("state") == "active":
            model = str(rec.get("model"))
            in_flight[model] = in_flight.get(model, 0.0) + float(rec.get("num_in_flight") or 0)
    return {
        m: before.get(m, now_s)
        for m, n in sorted(in_flight.items())
        if n == 0 and queued_by_model.get(m, 0) == 0
    }


def sleeps_aside(
    running: Sequence[PlannedInstance],
    idle: Mapping[str, float],
    now_s: float,
    params: StandbyParams,
    busy_keys: Collection[str] = (),
) -> list[PlannedInstance]:
    """The running instances to put to sleep now, beside the shifts: every instance of a
    model idle (`idle_since`) for `sleep_idle_s` or longer (0: never), but those a shift in
    progress uses (`busy_keys`). A wake undoes it in about a second, far cheaper than the
    GPU time an idle engine holds until the down trigger fires."""
    if params.sleep_idle_s <= 0:
        return []
    return [
        i
        for i in running
        if i.model in idle
        and now_s - idle[i.model] >= params.sleep_idle_s
        and instance_key(i) not in busy_keys
    ]


def wakes_aside(
    cluster: Cluster,
    running: Sequence[PlannedInstance],
    asleep: Sequence[PlannedInstance],
    waiting_by_model: Mapping[str, int],
    busy_gpu_ids: Collection[str],
    busy_keys: Collection[str] = (),
    max_per_model: int = 0,
) -> list[PlannedInstance]:
    """The sleepers to wake now for the models that need more engines (`waiting_by_model`:
    `pressed`), beside a shift in progress: those on GPUs no running instance and nothing
    of that shift (`busy_gpu_ids`) holds, whose key the shift does not use itself
    (`busy_keys`), still `keepable`, and no two on one GPU; at most `max_per_model` of a
    model (0: all), those that serve the most requests per GPU first (ties: as `asleep`
    lists them). By model name."""
    taken = {g for i in running for g in i.gpu_ids} | set(busy_gpu_ids)
    out: list[PlannedInstance] = []
    best_first = sorted(asleep, key=lambda i: -i.capacity_requests_per_s / max(1, len(i.gpu_ids)))
    for model in sorted(m for m, n in waiting_by_model.items() if n > 0):
        num_woken = 0
        for inst in best_first:
            if max_per_model and num_woken >= max_per_model:
                break
            gpus = set(inst.gpu_ids)
            if (
                inst.model != model
                or instance_key(inst) in busy_keys
                or gpus & taken
                or not keepable(cluster, inst.gpu_ids)
            ):
                continue
            out.append(inst)
            taken |= gpus
            num_woken += 1
    return out


def with_sleepers(
    cluster: Cluster, held: Sequence[tuple[PlannedInstance, float]], keep_for_wake: bool = False
) -> Cluster:
    """`cluster` with the GPU memory sleeping engines still hold counted as used: each
    (instance, bytes it holds on all its GPUs together), spread evenly over its GPUs. GPUs
    that are gone are skipped. `keep_for_wake`: a sleeper's GPUs are kept for its wake: all
    but one byte used, so the planner places nothing new there while the sleeper may still
    wake (`keepable`)."""
    extra: dict[str, float] = {}
    for inst, num_bytes in held:
        share = num_bytes / max(1, len(inst.gpu_ids))
        for g in inst.gpu_ids:
            extra[g] = extra.get(g, 0.0) + share
    out = cluster
    ids = set(cluster.gpu_ids)
    for g, num_bytes in sorted(extra.items()):
        if g not in ids:
            continue
        gpu = out.gpu(g)
        used = min(gpu.capacity_bytes, gpu.used_bytes + num_bytes)
        if keep_for_wake:
            used = max(used, gpu.capacity_bytes - 1.0)
        out = out.with_used(g, used, owner=gpu.owner or "flexpipe-asleep")
    return out
