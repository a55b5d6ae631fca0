"""Time-sharing a GPU between models (pure): one model's engine awake, others asleep beside it.

With `standby.time_share` (docs/shift-policy.md, "Time-sharing, live"): `standby_time_shared`
places the standbys a model still lacks on GPUs an awake engine of another model holds, where
their asleep footprint fits beside it; `swaps_aside` wakes such a sleeper by first putting the
holder to sleep (a swap), unless the holder is busier than the woken model needs (`yields_to`).
With `hosts_take_back`, a standby placed beside another model's engine (a guest, `guests`)
gives that GPU back to its host's sleeper even while it serves.

The standby set itself (which models keep how many engines asleep) is
flexpipe/policies/shift/standby_sleepers.py; the shells carry the answers out.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from flexpipe.cluster import Cluster
from flexpipe.policies.planner import ModelDemand, PlannedInstance
from flexpipe.policies.shift.candidates import Planner, free_of, keepable
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.policies.shift.standby_sleepers import (
    StandbyParams,
    _asks,
    _count_placed,
    _placed,
    _tally,
    _uncovered,
)

__all__ = [
    "Footprint",
    "Swap",
    "guests",
    "standby_time_shared",
    "swaps_aside",
    "time_share_view",
    "yields_to",
]


Footprint = Callable[[PlannedInstance, bool], float]
"""(instance, awake) -> the GPU memory it holds on all its GPUs together: awake, what its
engine takes (weights, KV cache, reserve); asleep, its reserve (the performance model's,
as `flexpipe:gpu_memory_bytes` reads it asleep)."""


def _bytes_by_gpu(
    instances: Iterable[PlannedInstance], footprint: Footprint, awake: bool
) -> dict[str, float]:
    out: dict[str, float] = {}
    for inst in instances:
        share = footprint(inst, awake) / max(1, len(inst.gpu_ids))
        for g in inst.gpu_ids:
            out[g] = out.get(g, 0.0) + share
    return out


def time_share_view(
    cluster: Cluster,
    model: str,
    awake: Sequence[PlannedInstance],
    asleep: Sequence[PlannedInstance],
    footprint: Footprint,
) -> Cluster:
    """The GPUs as a new engine of `model` would find them once it wakes, every other
    model's engine there put to sleep: an awake or asleep engine of another model holds its
    asleep footprint, one of `model` itself holds its GPUs whole (two engines of a model
    are never awake on one GPU by a swap)."""
    out = free_of(cluster, [i for i in [*awake, *asleep] if i.model == model])
    others = [i for i in [*awake, *asleep] if i.model != model]
    for g, num_bytes in sorted(_bytes_by_gpu(others, footprint, False).items()):
        if g in set(out.gpu_ids):
            gpu = out.gpu(g)
            used = min(gpu.capacity_bytes, gpu.used_bytes + num_bytes)
            out = out.with_used(g, used, owner=gpu.owner or "flexpipe-asleep")
    return out


def _fits_beside(
    cluster: Cluster,
    inst: PlannedInstance,
    awake: Sequence[PlannedInstance],
    asleep: Sequence[PlannedInstance],
    footprint: Footprint,
) -> bool:
    """`inst` asleep fits on its GPUs beside what holds them now: the awake engines'
    memory, the sleepers' reserves, other tenants' use."""
    held = _bytes_by_gpu(awake, footprint, True)
    for g, num_bytes in _bytes_by_gpu(asleep, footprint, False).items():
        held[g] = held.get(g, 0.0) + num_bytes
    mine = footprint(inst, False) / max(1, len(inst.gpu_ids))
    ids = set(cluster.gpu_ids)
    for g in inst.gpu_ids:
        if g not in ids:
            return False
        gpu = cluster.gpu(g)
        if gpu.used_bytes + held.get(g, 0.0) + mine > gpu.capacity_bytes:
            return False
    return True


def standby_time_shared(
    cluster: Cluster,
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
    """The standbys to start on GPUs other models' engines hold (`time_share`), for what
    `standby_wanted` left short: `awake`, `asleep` as there (with what `standby_wanted`
    chose among `asleep`); `cluster`: the GPUs free to us, other tenants' memory used and
    nothing of ours. Each is placed by the planner on `time_share_view` (the GPUs as it
    finds them once it wakes), one per model a round, and kept only where its asleep
    footprint fits beside what holds its GPUs now (`footprint`); its wake is a swap
    (`swaps_aside`)."""
    if not (params.enabled and params.time_share):
        return []
    have, capacity = _tally([*awake, *asleep])
    asks = _asks(demands, have, capacity, peak_counts, peak_rates_per_s, params, skip)
    chosen: list[PlannedInstance] = []
    while asks:
        for name, ask in list(asks.items()):
            sleeping = [*asleep, *chosen]
            view = time_share_view(cluster, name, awake, sleeping, footprint)
            if params.max_models_per_gpu:
                view = free_of(view, _crowded(name, [*awake, *sleeping], params))
            rest = _uncovered(ask, capacity)
            placed: list[PlannedInstance] = []
            hosts = _host_views(view, name, demands, [*awake, *sleeping], peak_rates_per_s, params)
            for host_view in hosts:
                placed = _placed(host_view, rest, 1, planner, now_s, params.single_stage)
                if placed and _fits_beside(cluster, placed[0], awake, sleeping, footprint):
                    break
                placed = []
            if not placed:
                del asks[name]
                continue
            chosen.append(placed[0])
            _count_placed(asks, ask, placed[0], have, capacity, peak_counts, params)
    return chosen


def _host_views(
    view: Cluster,
    model: str,
    demands: Sequence[ModelDemand],
    instances: Sequence[PlannedInstance],
    peak_rates_per_s: Mapping[str, float],
    params: StandbyParams,
) -> list[Cluster]:
    """Where a guest of `model` is looked for, in order: `view` alone; with
    `quiet_hosts_first`, first beside each other model's engines alone (the free GPUs
    too), the model busy the least share of the time first (its declared mean rate over
    its peak measured: an on/off model's duty; 1 where no peak is known yet), then
    `view`."""
    if not params.quiet_hosts_first:
        return [view]
    rates = {d.name: d.request_rate_per_s for d in demands}

    def duty(m: str) -> float:
        peak = peak_rates_per_s.get(m, 0.0)
        return min(1.0, rates.get(m, 0.0) / peak) if peak > 0 else 1.0

    hosts = sorted({i.model for i in instances} - {model}, key=lambda m: (duty(m), m))
    out = []
    for host in hosts:
        others = [i for i in instances if i.model not in (model, host)]
        out.append(free_of(view, others))
    return [*out, view]


def _crowded(
    model: str, instances: Sequence[PlannedInstance], params: StandbyParams
) -> list[PlannedInstance]:
    """The engines of other models on GPUs `max_models_per_gpu` other models hold already
    (their GPUs are not for another guest of `model`)."""
    models_on: dict[str, set[str]] = {}
    for inst in instances:
        if inst.model != model:
            for g in inst.gpu_ids:
                models_on.setdefault(g, set()).add(inst.model)
    full = {g for g, ms in models_on.items() if len(ms) >= params.max_models_per_gpu}
    return [i for i in instances if i.model != model and set(i.gpu_ids) & full]


@dataclass(frozen=True, slots=True)
class Swap:
    """A sleeper to wake once the running instances on its GPUs are put to sleep."""

    wake: PlannedInstance
    sleep: tuple[PlannedInstance, ...]


def guests(placed: Sequence[PlannedInstance], before: Iterable[PlannedInstance]) -> set[str]:
    """The keys of the standbys `placed` (in the order they were placed) that are guests:
    on a GPU an instance of another model holds (in `before`, or placed ahead of them). A
    guest gives its host's GPU back (`yields_to`, `hosts_take_back`)."""
    models_on: dict[str, set[str]] = {}
    for inst in before:
        for g in inst.gpu_ids:
            models_on.setdefault(g, set()).add(inst.model)
    out: set[str] = set()
    for inst in placed:
        if any(models_on.get(g, set()) - {inst.model} for g in inst.gpu_ids):
            out.add(instance_key(inst))
        for g in inst.gpu_ids:
            models_on.setdefault(g, set()).add(inst.model)
    return out


def yields_to(
    holder: PlannedInstance,
    model: str,
    priorities: Mapping[str, float],
    pressed_models: Collection[str],
    num_in_flight: float,
    guest: bool = False,
) -> bool:
    """Whether `holder` (running) is put to sleep so that a sleeper of `model` wakes on
    its GPUs: never for its own model, nor for a lower-priority model; a `guest` (a standby
    placed beside `model`'s engine there) always else, even while it serves or its model
    needs more engines: the GPU is its host's first; otherwise not when its model needs more
    engines itself (`pressed_models`); for one of the same priority only when it serves
    nothing (`num_in_flight`: its requests in flight); for a higher-priority model even
    while it serves (drained as any leaving instance)."""
    if holder.model == model:
        return False
    mine, theirs = priorities.get(model, 1.0), priorities.get(holder.model, 1.0)
    if theirs > mine:
        return False
    if guest:
        return True
    if holder.model in pressed_models:
        return False
    return theirs < mine or num_in_flight <= 0


def swaps_aside(
    cluster: Cluster,
    running: Sequence[PlannedInstance],
    asleep: Sequence[PlannedInstance],
    waiting_by_model: Mapping[str, int],
    priorities: Mapping[str, float],
    in_flight_by_key: Mapping[str, float],
    busy_gpu_ids: Collection[str],
    busy_keys: Collection[str] = (),
    max_per_model: int = 0,
    guest_keys: Collection[str] = (),
) -> list[Swap]:
    """The swaps to carry out now for the models that need more engines
    (`waiting_by_model`: `pressed`), highest priority first: a sleeper of such a model on
    GPUs running instances of other models hold, each of which `yields_to` it (its
    requests in flight: `in_flight_by_key`, by `instance_key`); none on GPUs or keys of the
    shift in progress (`busy_gpu_ids`, `busy_keys`), the sleeper still `keepable`, no GPU
    in two swaps; at most `max_per_model` a model (0: all), the most requests per GPU
    first. A holder among `guest_keys` (`guests`) yields to a sleeper that is none, its
    host. A sleeper on GPUs nothing runs on is `wakes_aside`'s, not a swap."""
    wanted = {m for m, n in waiting_by_model.items() if n > 0}
    taken = set(busy_gpu_ids)
    holders: dict[str, PlannedInstance] = {}
    for inst in running:
        for g in inst.gpu_ids:
            holders[g] = inst
    best_first = sorted(asleep, key=lambda i: -i.capacity_requests_per_s / max(1, len(i.gpu_ids)))
    out: list[Swap] = []
    for model in sorted(wanted, key=lambda m: (-priorities.get(m, 1.0), m)):
        num = 0
        for inst in best_first:
            if max_per_model and num >= max_per_model:
                break
            if (
                inst.model != model
                or instance_key(inst) in busy_keys
                or set(inst.gpu_ids) & taken
                or not keepable(cluster, inst.gpu_ids)
            ):
                continue
            sleep = {instance_key(holders[g]): holders[g] for g in inst.gpu_ids if g in holders}
            host = instance_key(inst) not in guest_keys
            if not sleep or any(
                k in busy_keys
                or set(h.gpu_ids) & taken
                or not yields_to(
                    h,
                    model,
                    priorities,
                    wanted,
                    in_flight_by_key.get(k, 0.0),
                    host and k in guest_keys,
                )
                for k, h in sleep.items()
            ):
                continue
            out.append(Swap(inst, tuple(sleep[k] for k in sorted(sleep))))
            taken |= set(inst.gpu_ids) | {g for h in sleep.values() for g in h.gpu_ids}
            num += 1
    return out
