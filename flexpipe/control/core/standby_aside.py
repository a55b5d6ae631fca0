"""What both controllers' shells need to drive standby sleepers beside the shifts (pure;
`policies/shift/standby_sleepers.py` decides which to start, wake and put to sleep,
docs/controller.md, "Standby sleepers"):

- `standby_view`: the GPUs as the planner and the shift policy see them beside standby
  sleepers: the memory each sleeper still holds is used (`with_sleepers`), and a standby
  loading beside the shifts holds its GPUs whole (the policy does not see it until it
  sleeps, so nothing else may be planned there meanwhile);
- `asleep_gpu_bytes`: what a sleeping engine still holds on its GPUs (all together): the
  reserve (CUDA context, NCCL buffers, activations), which vLLM's sleep pool does not free at
  either level; the live controller counts it from the performance model, the simulator
  reads its sim engine's `SleepState.gpu_memory_bytes` (the same sum);
- time-sharing (`standby.time_share`, docs/shift-policy.md, "Time-sharing"):
  `time_shared_gpus` (where sleepers may sleep beside a running engine), `standbys_to_start`
  (the standbys both shells start: `standby_wanted`, then `standby_time_shared`),
  `footprint_bytes` (what an engine holds awake or asleep), `evicts_asleep` (whether a
  change beside may stop the sleepers on its new instances' GPUs), `swap_procedure`
  (a swap's steps, as both shells drive them: `swap_steps`, then `woken_back`, the holders
  woken again when its sleeper did not come up), `holders_to_yield` (the running instances
  put to sleep while standbys load beside them, where the engine kind cannot load beside an
  awake engine) and `holds_to_lift` (the models served again once they loaded);
- the first plan with standbys: `first_plan` (each model's standby set in place of the
  planner's instances), `launched_first` (the standbys it may launch where the engine kind
  cannot load beside another engine) and `first_asleep` (which of them sleep once it is up);
- what the standby sets are sized by: `rates_observed` (the rates kept from each reading,
  `StandbyRates`: peaks, or the outlook's) and `standby_planner` (the planner, SLO-sized
  with `slo_gears`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flexpipe.cluster import Cluster
from flexpipe.control.core.planner import ControllerPlanner
from flexpipe.perf import PerfModel
from flexpipe.policies.planner import ModelDemand, PlannedInstance, PlannerConfig
from flexpipe.policies.shift.candidates import Planner
from flexpipe.policies.shift.forecast import ForecastParams, RateSample
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.policies.shift.standby_outlook import outlook_rates
from flexpipe.policies.shift.standby_sleepers import (
    StandbyParams,
    arrived,
    peak_rates,
    recent_rates,
    standby_wanted,
    with_sleepers,
)
from flexpipe.policies.shift.time_share import (
    Footprint,
    Swap,
    standby_time_shared,
    yields_to,
)

__all__ = [
    "ASIDE_REASONS",
    "AsideStep",
    "StandbyRates",
    "SwapState",
    "asleep_gpu_bytes",
    "evicts_asleep",
    "first_asleep",
    "first_plan",
    "footprint_bytes",
    "holders_to_yield",
    "holds_to_lift",
    "launch_waves",
    "launched_first",
    "rates_observed",
    "standby_planner",
    "standby_view",
    "standbys_to_start",
    "swap_procedure",
    "swap_steps",
    "time_shared_gpus",
    "woken_back",
]

# each change beside the policy's shifts, as both controllers log it (trigger -> reason)
ASIDE_REASONS = {
    "standby": "standby engines asleep ahead of demand (shift.standby)",
    "wake-aside": "requests wait: sleepers woken beside the shift in progress",
    "sleep-aside": "idle: its engines put to sleep beside the shift in progress",
    "swap-sleep": "time-sharing: a running instance put to sleep for another model's wake",
    "swap-wake": "time-sharing: a sleeper woken on the GPUs a swap freed",
    "swap-back": "time-sharing: the swapped-in sleeper did not come up; the holder woken again",
    "standby-yield": "time-sharing: a running instance put to sleep while a standby loads on its "
    "GPUs (the engine checks free GPU memory at start-up)",
    "standby-return": "time-sharing: the standby loaded and sleeps; the instance it yielded to "
    "woken again",
}


def standby_view(
    cluster: Cluster,
    held: Sequence[tuple[PlannedInstance, float]],
    keep_for_wake: bool,
    loading_gpu_ids: Collection[str],
    beside_gpu_ids: Collection[str] = (),
) -> Cluster:
    """`cluster` with each sleeper's held bytes used (`held`: (instance, bytes on all its
    GPUs together); `keep_for_wake`: its GPUs kept for its wake) and the GPUs of standbys
    loading beside the shifts (`loading_gpu_ids`) held whole; GPUs that are gone are
    skipped. `beside_gpu_ids` (`time_shared_gpus`): GPUs a running engine holds, where a
    sleeper fits in what that engine leaves (`standby_time_shared`): such a sleeper is not
    counted again and a standby loading there holds nothing more (the running engine's GPUs
    are ours already; counting them would hand its memory to another tenant's view)."""
    beside = set(beside_gpu_ids)
    view = with_sleepers(
        cluster, [(p, b) for p, b in held if not set(p.gpu_ids) & beside], keep_for_wake
    )
    return _held_whole(view, set(loading_gpu_ids) - beside)


def _held_whole(cluster: Cluster, gpu_ids: Collection[str]) -> Cluster:
    """`cluster` with `gpu_ids` (those not gone) held whole by us."""
    for g in sorted(set(gpu_ids) & set(cluster.gpu_ids)):
        cluster = cluster.with_used(g, cluster.gpu(g).capacity_bytes, owner="flexpipe")
    return cluster


def time_shared_gpus(running: Sequence[PlannedInstance], time_share: bool) -> set[str]:
    """With `time_share`, the GPUs running instances hold (sleepers of other models may
    sleep beside them); else none."""
    return {g for i in running for g in i.gpu_ids} if time_share else set()


def standbys_to_start(
    view: Cluster,
    cluster: Cluster,
    loading_gpu_ids: Collection[str],
    demands: Sequence[ModelDemand],
    awake: Sequence[PlannedInstance],
    asleep: Sequence[PlannedInstance],
    peak_counts: Mapping[str, int],
    peak_rates_per_s: Mapping[str, float],
    planner: Planner,
    now_s: float,
    params: StandbyParams,
    footprint: Footprint,
    skip: Collection[str] = (),
) -> list[PlannedInstance]:
    """The standbys both shells start now: `standby_wanted` on `view` (`standby_view`), then,
    with `time_share`, `standby_time_shared` on `cluster` (free to us, other tenants' memory
    used, nothing of ours) with the GPUs of standbys loading beside held whole, for what the
    first left short. `awake`: running and busy instances; `asleep`: every sleeper."""
    chosen = standby_wanted(
        view,
        demands,
        awake,
        asleep,
        peak_counts,
        peak_rates_per_s,
        planner,
        now_s,
        params,
        skip=skip,
    )
    if not params.time_share:
        return chosen
    shared = standby_time_shared(
        _held_whole(cluster, loading_gpu_ids),
        demands,
        awake,
        [*asleep, *chosen],
        peak_counts,
        peak_rates_per_s,
        planner,
        now_s,
        params,
        footprint,
        skip=skip,
    )
    return [*chosen, *shared]


def footprint_bytes(pm: PerfModel, awake: bool) -> float:
    """The GPU memory an engine holds, all its GPUs together, as the performance model
    prices it: awake, weights, reserve and KV cache; asleep, its reserve
    (`asleep_gpu_bytes`). The `Footprint` time-sharing fits sleepers with."""
    if not awake:
        return asleep_gpu_bytes(pm)
    return sum(g.weights_bytes + g.reserve_bytes + max(g.kv_bytes, 0.0) for g in pm.memory.per_gpu)


def evicts_asleep(
    trigger: str,
    running: Collection[str],
    target: Sequence[PlannedInstance],
    time_share: bool,
) -> bool:
    """Whether a change beside the shifts from `running` (keys) to `target` may stop the
    sleepers on its new instances' GPUs (the shift procedure does, as it must for an engine
    that needs them whole): not the launch of standbys with `time_share` (nothing running,
    standbys in the target), which fit asleep beside what sleeps there
    (`standby_time_shared`) and wake only by a swap."""
    return not (time_share and trigger == "standby" and bool(target) and not running)


def first_plan(
    standbys: Sequence[PlannedInstance], planned: Sequence[PlannedInstance]
) -> list[PlannedInstance]:
    """The first plan with standbys on (`flexpipe up`, the simulator's start): each model's
    standby set (`standbys_to_start` with nothing running yet) instead of the planner's
    instances of it; the planner's instances of the models with none."""
    with_standby = {s.model for s in standbys}
    return [*standbys, *(i for i in planned if i.model not in with_standby)]


def launched_first(
    standbys: Sequence[PlannedInstance],
    planned: Sequence[PlannedInstance],
    loads_beside_awake: bool,
) -> list[PlannedInstance]:
    """The standbys the first plan (`first_plan` of them and `planned`) launches: all where
    the engine kind loads beside another engine (`EngineKind.loads_beside_awake`); else only
    those on GPUs no other instance of that plan uses, as engines launched together on one GPU
    would each find the other's memory taken at start-up. The others are left to the standby
    looks, which load them once the plan serves, its engines asleep meanwhile
    (`holders_to_yield`). A model left with none runs the planner's instances again, which
    may share a GPU with a standby kept: so until nothing changes."""
    kept = list(standbys)
    while not loads_beside_awake:
        alone = alone_on_gpus(kept, first_plan(kept, planned))
        if alone == kept:
            break
        kept = alone
    return kept


def alone_on_gpus(
    instances: Sequence[PlannedInstance], launched: Sequence[PlannedInstance]
) -> list[PlannedInstance]:
    """Those of `instances` on GPUs no other instance of `launched` (which holds them) uses:
    what an engine kind that cannot load beside another engine may launch together."""
    num_on: dict[str, int] = {}
    for inst in launched:
        for g in set(inst.gpu_ids):
            num_on[g] = num_on.get(g, 0) + 1
    return [i for i in instances if all(num_on[g] == 1 for g in i.gpu_ids)]


def launch_waves(
    planned: Sequence[PlannedInstance], loads_beside_awake: bool
) -> list[list[PlannedInstance]]:
    """`planned` in the waves a shift launches it in, each once the one before has loaded:
    one wave where the engine kind loads beside another engine (`loads_beside_awake`, the
    sim engine); else (GPUs shared in memory, `planner.share_gpus`) by the rule
    `launched_first` keeps a first plan by (`alone_on_gpus`): in order, each instance joins
    the first wave none of whose instances uses one of its GPUs, as vLLM's start-up memory
    profiling charges a neighbour's loading to itself."""
    if loads_beside_awake or not planned:
        return [list(planned)]
    waves: list[list[PlannedInstance]] = []
    for inst in planned:
        wave = next((w for w in waves if alone_on_gpus([inst], [*w, inst])), None)
        if wave is None:
            waves.append([inst])
        else:
            wave.append(inst)
    return waves


def first_asleep(
    standby_keys: Collection[str],
    running: Mapping[str, PlannedInstance],
    instances: Sequence[Mapping[str, Any]],
    queued_by_model: Mapping[str, int],
) -> set[str]:
    """The first plan's standbys (`standby_keys`) that go to sleep once it is done: those
    running (`running`: key -> instance) of models no request waits for (`queued_by_model`)
    and none is served on (`instances`: the gateway's pool records). The others serve their
    burst first; the idle sleep or the down trigger puts them to sleep."""
    busy = {m for m, n in queued_by_model.items() if n > 0}
    busy |= {
        str(rec.get("model"))
        for rec in instances
        if rec.get("state") == "active" and float(rec.get("num_in_flight") or 0) > 0
    }
    return {k for k in standby_keys if k in running and running[k].model not in busy}


def swap_steps(
    running: Sequence[PlannedInstance], swaps: Sequence[Swap]
) -> tuple[list[PlannedInstance], list[PlannedInstance]]:
    """A swap's two steps: (the running instances kept while the holders go to sleep, the
    sleepers woken next on the GPUs that freed)."""
    gone = {instance_key(h) for s in swaps for h in s.sleep}
    kept = [i for i in running if instance_key(i) not in gone]
    return kept, [s.wake for s in swaps]


def holders_to_yield(
    standbys: Sequence[PlannedInstance],
    running: Sequence[PlannedInstance],
    loads_beside_awake: bool,
    priorities: Mapping[str, float],
    pressed_models: Collection[str],
    in_flight_by_key: Mapping[str, float],
    queued_by_model: Mapping[str, int],
) -> tuple[list[PlannedInstance], list[PlannedInstance]]:
    """(the standbys to load now, the running instances that sleep while they load and wake
    once they sleep): three changes beside, `standby-yield`, the standbys' `standby` launch
    and sleep, `standby-return`. Where the engine kind loads beside an awake engine
    (`EngineKind.loads_beside_awake`, the sim engine): every standby, nothing sleeps. Else a
    real vLLM refuses to start where an awake engine leaves less free memory than its share,
    so each running instance on a standby's GPUs must yield for the standby's whole cold
    start, ahead of any demand: only one that `yields_to` the standby's model (as a swap's
    holder: never an instance of a model that needs more engines, `pressed_models`, nor of
    a higher priority) and is idle (nothing in flight, `in_flight_by_key` by `instance_key`,
    nor queued for its model, `queued_by_model`). A standby with a holder that may not yield
    is left out (the next look tries again)."""
    if loads_beside_awake:
        return list(standbys), []
    loaded: list[PlannedInstance] = []
    holders: dict[str, PlannedInstance] = {}
    for standby in standbys:
        on = [i for i in running if set(i.gpu_ids) & set(standby.gpu_ids)]
        if all(
            queued_by_model.get(h.model, 0) <= 0
            and in_flight_by_key.get(instance_key(h), 0.0) <= 0
            and yields_to(h, standby.model, priorities, pressed_models, 0.0)
            for h in on
        ):
            loaded.append(standby)
            holders.update((instance_key(h), h) for h in on)
    return loaded, list(holders.values())


def holds_to_lift(changed: Sequence[PlannedInstance], serving: Collection[str]) -> list[str]:
    """The models whose holds to lift once standbys loaded beside: those of the instances the
    changes touched (`changed`: the standbys, and the holders that yielded to them) that serve
    now (`serving`). A change's plan end holds a model it left with no instance (a holder's,
    while it sleeps), and a model that serves again must not stay held; the simulator's
    `sleep_loaded` lifts them so."""
    return sorted({i.model for i in changed} & set(serving))


@dataclass(frozen=True, slots=True)
class AsideStep:
    """One change beside the shifts a procedure asks of its shell: from what runs to
    `target`, logged as `trigger` (`ASIDE_REASONS`)."""

    trigger: str
    target: tuple[PlannedInstance, ...]


# what a shell sends back after each step: (the running instances now, their keys, the keys
# of the sleepers asleep now)
SwapState = tuple[Sequence[PlannedInstance], Collection[str], Collection[str]]


def swap_procedure(
    running: Sequence[PlannedInstance], swaps: Sequence[Swap]
) -> Generator[AsideStep, SwapState, None]:
    """A swap's changes beside, written once for both shells (the live one awaits each step,
    the simulator's runs the next when its clock reaches the end of the one before), each
    step sent the state after the one before: `swap-sleep`, the holders drain and sleep, the
    rest of `running` kept (`swap_steps`); `swap-wake`, the sleepers wake beside what runs;
    `swap-back`, only where a sleeper did not come up, its holders still asleep wake again
    (`woken_back`)."""
    kept, wakes = swap_steps(running, swaps)
    now_running, _, _ = yield AsideStep("swap-sleep", tuple(kept))
    now_running, running_keys, asleep_keys = yield AsideStep("swap-wake", (*now_running, *wakes))
    holders = woken_back(swaps, running_keys, asleep_keys)
    if holders:
        yield AsideStep("swap-back", (*now_running, *holders))


def woken_back(
    swaps: Sequence[Swap], running_keys: Collection[str], asleep_keys: Collection[str]
) -> list[PlannedInstance]:
    """The holders to wake again after the wake step: those of each swap whose sleeper does
    not run (its wake failed and so did its cold start) and still asleep (`asleep_keys`):
    their GPUs are free again, and their model's requests are served again."""
    out: list[PlannedInstance] = []
    for swap in swaps:
        if instance_key(swap.wake) in running_keys:
            continue
        out.extend(h for h in swap.sleep if instance_key(h) in asleep_keys)
    return out


def asleep_gpu_bytes(pm: PerfModel) -> float:
    """The GPU memory an engine asleep (level 1 or 2) still holds, all its GPUs together:
    each GPU's reserve; its weights and KV cache are offloaded or dropped."""
    return sum(g.reserve_bytes for g in pm.memory.per_gpu)


# readings a burst's rate is read over (`recent_rates`): a few ticks, which the minute's
# rate the forecast reads would dilute
NUM_READINGS_KEPT = 3


@dataclass(frozen=True, slots=True)
class StandbyRates:
    """What a shell keeps of the controller's readings to size standby sets by."""

    # (s, requests by model so far) of the last `NUM_READINGS_KEPT` readings, oldest first
    seen: tuple[tuple[float, Mapping[str, float]], ...] = ()
    # model -> the rate its standby set is sized for, req/s: the highest measured, or with
    # `outlook_horizon_s` the outlook's (`outlook_rates`)
    peak_rates: Mapping[str, float] = field(default_factory=dict)
    # model -> (s, req/s) of every reading, oldest first: the outlook's history (kept only
    # with `outlook_horizon_s`)
    history: Mapping[str, tuple[RateSample, ...]] = field(default_factory=dict)


def rates_observed(
    before: StandbyRates,
    now_s: float,
    finished_by_model: Mapping[str, float],
    instances: Sequence[Mapping[str, Any]],
    queued_by_model: Mapping[str, int],
    forecast: ForecastParams,
    params: StandbyParams,
    scale: float = 1.0,
) -> StandbyRates:
    """`before` with one reading at `now_s` kept, as both shells keep each tick's: the
    requests finished by model (`finished_by_model`, cumulative), or with `arrival_peaks`
    arrived (`arrived`: in flight on the gateway's pool records `instances` and waiting,
    `queued_by_model`, as well: a burst the engines fall behind on reads at its arrival
    rate); the rate over the readings kept (`recent_rates`, times `scale`: the live sim
    engines' wall seconds per modelled second, so rates are per modelled second as the
    SLOs) raises the peaks (`peak_rates`); with `outlook_horizon_s` each rate joins the
    history and the outlook's rates (`outlook_rates`) replace the peaks."""
    counts = dict(finished_by_model)
    if params.arrival_peaks:
        counts = arrived(counts, instances, queued_by_model)
    seen = (*before.seen, (now_s, counts))[-NUM_READINGS_KEPT:]
    rates = {m: r * scale for m, r in recent_rates(seen).items()}
    peaks = peak_rates(before.peak_rates, rates)
    history = before.history
    if params.outlook_horizon_s > 0:  # the outlook's rates instead (standby_outlook.py)
        grown = dict(history)
        for m, r in rates.items():
            grown[m] = (*grown.get(m, ()), (now_s, r))
        history = grown
        peaks = outlook_rates(history, now_s, forecast, params)
    return StandbyRates(seen, peaks, history)


def standby_planner(planner: ControllerPlanner, params: StandbyParams) -> ControllerPlanner:
    """The planner standby sets are sized by: with `slo_gears`, `planner`'s gear table and
    efficiency at `sizing: slo` (a standby covers the rate at which it meets the TTFT and TPOT
    p99 with queueing, perf/slo_capacity.py), its other knobs kept; else `planner`."""
    if not params.slo_gears:
        return planner
    slo = dataclasses.replace(planner.config or PlannerConfig(), sizing="slo")
    return ControllerPlanner(planner.performance, planner.efficiency, slo)
