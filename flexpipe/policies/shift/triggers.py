"""When a shift may be considered (seed 000 §3.2): zones held for N samples, cooldown after
every shift, a blacklist of targets that failed, and GPUs that are gone or about to be.

Each function reads the snapshot at `now` and returns plain values; `policy.py` combines them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from flexpipe.cluster import Cluster, ClusterError
from flexpipe.perf import Efficiency
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.migration import perf_model_of
from flexpipe.policies.shift.signals import (
    Pressure,
    Sample,
    Thresholds,
    Zone,
    pressure_of,
    recent,
    trailing_run,
    zone_of,
)
from flexpipe.policies.shift.snapshot import ModelState, ShiftRecord

__all__ = [
    "ModelSignal",
    "TriggerParams",
    "ahead_of_capacity",
    "blacklist",
    "cooldown_until",
    "last_shift_end_s",
    "lost_instances",
    "model_signal",
    "near_up",
    "rising",
    "urgent_run",
]


@dataclass(frozen=True, slots=True)
class TriggerParams:
    """Defaults from seed 000 §3.2 and §4.3 (docs/shift-policy.md)."""

    thresholds: Thresholds = field(default_factory=Thresholds)
    window_s: float = 60.0  # samples older than this never count
    num_samples: int = 5  # consecutive samples in a zone before it fires
    # After every shift (counted from its end, so always longer than the shift itself). The
    # seed's 60 s oscillated; 180 s did not.
    cooldown_s: float = 180.0
    # A target instance that failed `max_failures` times within `failure_window_s` is skipped
    # for `blacklist_s` after its last failure.
    max_failures: int = 2
    failure_window_s: float = 600.0
    blacklist_s: float = 900.0
    # Resource-driven: the plan for the GPUs free now must raise goodput by this share, and
    # the change of GPUs must have lasted this long (tenants come and go within seconds).
    resource_min_gain_fraction: float = 0.02
    resource_settle_s: float = 30.0
    # A GPU whose lease (free_until_s) ends within this much is vacated now (planned reclaim).
    reclaim_lead_s: float = 120.0
    # An instance whose GPUs now leave room for less than this share of the KV cache it
    # holds overlaps a tenant that came back: vacated like a reclaim.
    squeeze_kv_fraction: float = 0.95
    # Fast up (docs/shift-policy.md, "Fast up, slow down"): an up-shift fires after this many
    # urgent samples in a row — the queue rose since the sample before, or the queue over the
    # model's SLO-meeting capacity would wait past its TTFT SLO, or the measured rate is over
    # that capacity. 0: off (only `num_samples` in the up zone fire).
    fast_up_samples: int = 0
    # False: the cooldown after a shift holds down- and resource-shifts only; an up-shift the
    # SLO needs (fired) goes through at once. Scaling down keeps its samples and cooldown.
    cooldown_blocks_up: bool = True
    # True: no candidate takes a running instance's GPUs from a model in or near its up zone
    # (urgent, or both pressures over `near_up_fraction` of their up thresholds) to give them
    # to a model of lower priority (candidates.py `protects_priority`).
    protect_priority: bool = False
    near_up_fraction: float = 0.5
    # A rise of the queue is urgent only once the queue drained at the SLO-meeting capacity
    # would wait at least this share of the TTFT SLO (0: any rise; 0 -> 1 request is noise
    # on a steady model and re-fires an up-shift it has just been given back).
    fast_up_min_wait_fraction: float = 0.0
    # Utilisation's slope (seed 001: past 0.8 utilisation latency grows far faster than the
    # load): the newest sample is urgent when the line through the window's utilisations
    # rises and reaches `slope_up_utilization` within `slope_lead_s` (about a cold start:
    # the rising load caught before its queue forms). 0: off.
    slope_lead_s: float = 0.0
    slope_up_utilization: float = 0.8
    # Ahead of the curve: a model whose expected rate (the forecast, `ModelState.
    # expected_request_rate_per_s`) exceeds this share of its running instances' SLO-meeting
    # capacity fires up (added instances, as fast up) before its load arrives. 0: off. Above
    # 1 / (1 + down_headroom) a shrink never leaves a plan this fires on again.
    ahead_capacity_fraction: float = 0.0
    # Fast up plans for the arrivals plus the queue drained within this long (0: the TTFT
    # SLO). A queue left by a cold start drains in a minute; planned to drain within the
    # SLO it asks for an instance per few requests waiting.
    backlog_drain_s: float = 0.0

    @property
    def fast_up(self) -> bool:
        """An up-shift may fire before `num_samples` (urgent samples or the forecast): it
        then only adds, and a down-shift only shrinks (docs/shift-policy.md)."""
        return self.fast_up_samples > 0 or self.ahead_capacity_fraction > 0

    def __post_init__(self) -> None:
        if self.num_samples < 1 or self.max_failures < 1:
            raise ValueError("num_samples and max_failures must be >= 1")
        if self.fast_up_samples < 0:
            raise ValueError("fast_up_samples must be >= 0 (0: off)")
        if not 0 <= self.near_up_fraction <= 1:
            raise ValueError("near_up_fraction must be in [0, 1]")
        if not 0 <= self.slope_up_utilization <= 1:
            raise ValueError("slope_up_utilization must be in [0, 1]")
        if (
            min(
                self.fast_up_min_wait_fraction,
                self.slope_lead_s,
                self.ahead_capacity_fraction,
                self.backlog_drain_s,
            )
            < 0
        ):
            raise ValueError(
                "fast_up_min_wait_fraction, slope_lead_s, ahead_capacity_fraction and "
                "backlog_drain_s must be >= 0"
            )
        if min(self.window_s, self.failure_window_s) <= 0:
            raise ValueError("window_s and failure_window_s must be positive")
        if min(self.cooldown_s, self.blacklist_s, self.resource_settle_s) < 0:
            raise ValueError("cooldown_s, blacklist_s and resource_settle_s must be >= 0")
        if self.resource_min_gain_fraction < 0 or self.reclaim_lead_s < 0:
            raise ValueError("resource_min_gain_fraction and reclaim_lead_s must be >= 0")


@dataclass(frozen=True, slots=True)
class ModelSignal:
    """A model's signals at `now`: the newest pressures and the zone run they end."""

    model: str
    pressure: Pressure | None  # of the newest sample; None: no sample in the window
    zone: Zone  # of the newest sample
    run: int  # consecutive samples ending in `zone`
    fired: Zone  # `zone` once `run` reaches num_samples (UP or DOWN), else HOLD
    num_samples: int  # samples in the window (after the last shift)
    # urgent samples in a row ending now (fast up; 0 when it is off)
    urgent_run: int = 0
    fast: bool = False  # fired UP by the fast path (urgent_run >= fast_up_samples)
    ahead: bool = False  # fired UP by the forecast (expected rate over the capacity's share)

    def to_dict(self) -> dict[str, object]:
        p = self.pressure
        return {
            "model": self.model,
            "queue": None if p is None else round(p.queue, 4),
            "latency": None if p is None else round(p.latency, 4),
            "utilization": None if p is None else round(p.utilization, 4),
            "zone": self.zone.value,
            "run": self.run,
            "fired": self.fired.value,
            "num_samples": self.num_samples,
        }


def urgent_run(
    samples: Sequence[Sample],
    ttft_slo_s: float,
    rate_per_s: float,
    capacity_per_s: float,
    min_wait_fraction: float = 0.0,
    slope_lead_s: float = 0.0,
    slope_up_utilization: float = 0.8,
) -> int:
    """How many samples in a row, ending with the newest, say the model needs more now: its
    queue rose since the sample before (and would wait at least `min_wait_fraction` of the
    TTFT SLO), or the queue drained at `capacity_per_s` (its instances' SLO-meeting capacity)
    would keep a new request waiting past its TTFT SLO. The newest is urgent too when the
    measured rate is over the capacity (the queue will grow), or when utilisation rises
    towards `slope_up_utilization` within `slope_lead_s` (`rising`; 0: not read)."""
    n = 0
    for i in range(len(samples) - 1, -1, -1):
        s = samples[i]
        wait_s = math.inf if capacity_per_s <= 0 else s.queue_depth / capacity_per_s
        grew = (
            i > 0
            and s.queue_depth > samples[i - 1].queue_depth
            and wait_s >= min_wait_fraction * ttft_slo_s
        )
        waits = s.queue_depth > 0 and wait_s > ttft_slo_s
        newest = i == len(samples) - 1
        overloaded = newest and s.queue_depth > 0 and rate_per_s > capacity_per_s
        climbing = (
            newest and slope_lead_s > 0 and rising(samples, slope_lead_s, slope_up_utilization)
        )
        if not (grew or waits or overloaded or climbing):
            break
        n += 1
    return n


def rising(samples: Sequence[Sample], lead_s: float, level: float) -> bool:
    """Utilisation climbs to `level` within `lead_s`: the least-squares line through the
    samples' utilisations (oldest first, at least three spanning time) has a positive slope
    and reaches `level` at `newest + lead_s`. A flat or falling load is never urgent here,
    however busy: the queue rules answer that."""
    if len(samples) < 3 or samples[-1].at_s <= samples[0].at_s:
        return False
    mean_t = sum(s.at_s for s in samples) / len(samples)
    mean_u = sum(s.utilization for s in samples) / len(samples)
    var_t = sum((s.at_s - mean_t) ** 2 for s in samples)
    slope = sum((s.at_s - mean_t) * (s.utilization - mean_u) for s in samples) / var_t
    at_lead = mean_u + slope * (samples[-1].at_s + lead_s - mean_t)
    return slope > 0 and at_lead >= level


def model_signal(
    model: ModelState,
    now_s: float,
    since_s: float | None,
    params: TriggerParams,
    capacity_per_s: float = 0.0,
) -> ModelSignal:
    """Zone run of `model`'s samples in the window. Samples from before `since_s` (the end of
    the last shift) describe the old plan and are ignored. `capacity_per_s`: the SLO-meeting
    capacity of its running instances (read only by the fast path)."""
    samples = [
        s
        for s in recent(model.samples, now_s, params.window_s)
        if since_s is None or s.at_s >= since_s
    ]
    slo = model.demand.slo
    pressures = [pressure_of(s, slo.ttft_p99_s, slo.tpot_p99_s) for s in samples]
    zone, run = trailing_run([zone_of(p, params.thresholds) for p in pressures])
    fired = zone if run >= params.num_samples else Zone.HOLD
    urgent, fast, ahead = 0, False, False
    if params.fast_up_samples > 0:
        urgent = urgent_run(
            samples,
            slo.ttft_p99_s,
            model.request_rate_per_s,
            capacity_per_s,
            params.fast_up_min_wait_fraction,
            params.slope_lead_s,
            params.slope_up_utilization,
        )
        if fired is not Zone.UP and urgent >= params.fast_up_samples:
            fired, fast = Zone.UP, True
    if fired is not Zone.UP and ahead_of_capacity(model, capacity_per_s, params):
        fired, ahead = Zone.UP, True
    return ModelSignal(
        model.name,
        pressures[-1] if pressures else None,
        zone,
        run,
        fired,
        len(samples),
        urgent,
        fast,
        ahead,
    )


def ahead_of_capacity(model: ModelState, capacity_per_s: float, params: TriggerParams) -> bool:
    """The forecast says the load will pass `ahead_capacity_fraction` of the capacity of the
    model's running instances (`capacity_per_s`; a model with none is the wake's)."""
    f, expected = params.ahead_capacity_fraction, model.expected_request_rate_per_s
    if f <= 0 or expected is None or capacity_per_s <= 0:
        return False
    return expected > f * capacity_per_s


def near_up(signal: ModelSignal, params: TriggerParams) -> bool:
    """In or near the up zone: fired or urgent now, or both pressures over `near_up_fraction`
    of their up thresholds (what `protect_priority` guards)."""
    if signal.fired is Zone.UP or signal.zone is Zone.UP or signal.urgent_run > 0:
        return True
    p, t, f = signal.pressure, params.thresholds, params.near_up_fraction
    return p is not None and p.queue > f * t.up_queue and p.latency > f * t.up_latency


def last_shift_end_s(history: Sequence[ShiftRecord]) -> float | None:
    """When the last finished shift ended (None: no shift has finished)."""
    ends = [r.finished_s for r in history if r.finished_s is not None]
    return max(ends) if ends else None


def cooldown_until(history: Sequence[ShiftRecord], params: TriggerParams) -> float | None:
    """End of the cooldown after the last shift; +inf while a shift is in progress."""
    if any(r.in_progress for r in history):
        return float("inf")
    end = last_shift_end_s(history)
    return None if end is None else end + params.cooldown_s


def blacklist(
    history: Sequence[ShiftRecord], now_s: float, params: TriggerParams
) -> dict[str, float]:
    """instance key -> until when it is skipped: it failed `max_failures` times within
    `failure_window_s`, the last of them less than `blacklist_s` ago. A shift the executor
    refused before changing anything tried nothing: it is not a failure of its target."""
    failures: dict[str, list[float]] = {}  # key -> times it failed
    for r in history:
        if r.failed:
            at = r.finished_s if r.finished_s is not None else r.started_s
            for key in r.target_keys:
                failures.setdefault(key, []).append(at)
    out: dict[str, float] = {}
    for key, times in failures.items():
        times.sort()
        for i in range(params.max_failures - 1, len(times)):
            first, last = times[i - params.max_failures + 1], times[i]
            if last - first <= params.failure_window_s and now_s < last + params.blacklist_s:
                out[key] = max(out.get(key, 0.0), last + params.blacklist_s)
    return out


def _why_lost(
    cluster: Cluster,
    inst: PlannedInstance,
    now_s: float,
    params: TriggerParams,
    efficiency: Efficiency | None,
) -> str | None:
    for gid in inst.gpu_ids:
        try:
            gpu = cluster.gpu(gid)
        except ClusterError:
            return f"{gid} is no longer in the cluster"
        if gpu.free_bytes <= 0:
            return f"{gid} is held by {gpu.owner or 'another tenant'}"
        if gpu.free_until_s is not None and gpu.free_until_s - now_s <= params.reclaim_lead_s:
            return f"{gid} is reclaimed in {max(0.0, gpu.free_until_s - now_s):.0f} s"
    memory = perf_model_of(cluster, inst, efficiency).memory
    if not memory.feasible:
        return f"no longer fits beside the other tenants: {memory.reason}"
    if memory.kv_capacity_tokens < params.squeeze_kv_fraction * inst.kv_capacity_tokens:
        return (
            f"no longer fits beside the other tenants: room for {memory.kv_capacity_tokens}"
            f" KV tokens, it holds {inst.kv_capacity_tokens}"
        )
    return None


def lost_instances(
    cluster: Cluster,
    running: Sequence[PlannedInstance],
    now_s: float,
    params: TriggerParams,
    efficiency: Efficiency | None = None,
) -> list[tuple[PlannedInstance, str]]:
    """Running instances on a GPU that is gone (not in the cluster, or fully held by another
    tenant), whose lease ends within `reclaim_lead_s`, or that no longer fit the memory the
    other tenants leave (the performance model's memory plan), with the reason."""
    out: list[tuple[PlannedInstance, str]] = []
    for inst in running:
        why = _why_lost(cluster, inst, now_s, params, efficiency)
        if why is not None:
            out.append((inst, why))
    return out
