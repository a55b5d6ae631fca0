"""The controller's tick (`control/core/tick.py`, the live controller's too) on the virtual
clock.

Every `tick_s` (10 s), or at once when the GPUs change:

1. GPU changes come from the scenario's resource timeline through the controller's own
   `Resources.file_changed` (the same events the live file watch produces); an engine that
   died with its GPUs is an emergency: out of the running plan, its GPUs re-planned;
2. the core's holds and refusals of the models with no instance go to the gateway;
3. what the gateway exposes — its pool records (`as_dict`, as `GET /admin/instances` gives
   them) and its TTFT and TPOT histograms (`LatencyBuckets`: the cumulative bucket counts
   the live controller parses from the gateway's Prometheus text, with `GatewayMetrics`'
   bounds) — goes to the core, which answers with `ShiftPolicy.decide`'s decision;
4. a shift is carried out by `ShiftRun` (make-before-break, the executor's phases), during
   which the controller does not tick (the live one awaits the shift inside its tick); the
   holds and refusals a tick renews are renewed meanwhile (the core's `Renewal`) by an event
   on the virtual clock, so a shift longer than the hold does not let them lapse.

Every decision taken, and every hold under a trigger, is kept for the report.
"""

from __future__ import annotations

import dataclasses
import math
import random
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from flexpipe.cluster import Cluster
from flexpipe.control.core.planner import ControllerPlanner
from flexpipe.control.core.resources import ResourceEvent, Resources
from flexpipe.control.core.samples import TPOT_HISTOGRAM, TTFT_HISTOGRAM, Buckets
from flexpipe.control.core.shift_procedure import InPlaceChooser
from flexpipe.control.core.sleeping import in_place_chooser, leaving_of, sleep_levels
from flexpipe.control.core.standby import Renewal, StandbyCommand
from flexpipe.control.core.standby_aside import ASIDE_REASONS, standby_view
from flexpipe.control.core.tick import (
    Readings,
    TickCore,
    TickParams,
    cold_models,
    decision_brief,
)
from flexpipe.engine_kinds import engine_kind
from flexpipe.gateway.core.holds import STANDBY_HOLD_S
from flexpipe.gateway.gateway_metrics import _LATENCY_BUCKETS_S, _TPOT_BUCKETS_S
from flexpipe.model_spec import load_model_spec
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner import ModelDemand, PlannedInstance, PlannerConfig
from flexpipe.policies.shift import ShiftParams, ShiftPolicy
from flexpipe.policies.shift.decision import ShiftDecision
from flexpipe.policies.shift.in_place import MAKE_BEFORE_BREAK, ROLLING
from flexpipe.policies.shift.migration import perf_model_of
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.policies.shift.standby_sleepers import (
    idle_since,
    most_awake,
    peak_rates,
    pressed,
    recent_rates,
    sleeps_aside,
    standby_time_shared,
    standby_wanted,
    swaps_aside,
    wakes_aside,
)
from flexpipe.sim.loop import CONTROL
from flexpipe.sim.request import SimRequest
from flexpipe.sim.shift_run import ShiftOutcome, ShiftRun, World

__all__ = ["ControllerParams", "LatencyBuckets", "SimController"]


class LatencyBuckets:
    """One latency histogram of the gateway, by model, as the controller reads it: what
    `parse_histograms` makes of a Prometheus histogram with these bucket bounds fed the same
    values (per model the cumulative count at each bound, +Inf last; a value counts in the
    first bucket whose bound is >= it, NaN in none). The simulator keeps these counts instead
    of a `GatewayMetrics` whose text it would render and parse back every tick."""

    def __init__(self, name: str, bounds_s: tuple[float, ...]) -> None:
        self.name = name
        self.bounds_s = (*bounds_s, math.inf)
        self.counts: dict[str, list[int]] = {}  # model -> observations per bucket

    def observe(self, model: str, value_s: float) -> None:
        counts = self.counts.get(model)
        if counts is None:
            counts = self.counts[model] = [0] * len(self.bounds_s)
        if value_s == value_s:  # (not NaN)
            counts[bisect_left(self.bounds_s, value_s)] += 1

    def read(self) -> dict[tuple[str, str], Buckets]:
        """(histogram name, model) -> cumulative buckets, as `parse_histograms` gives them."""
        out: dict[tuple[str, str], Buckets] = {}
        for model, counts in self.counts.items():
            total = 0
            cumulative = []
            for bound, n in zip(self.bounds_s, counts, strict=True):
                total += n
                cumulative.append((bound, float(total)))
            out[(self.name, model)] = tuple(cumulative)
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class ControllerParams:
    """`ControllerConfig`'s numbers that matter on a virtual clock."""

    tick_s: float = 10.0
    drain_deadline_s: float = 30.0
    rehearsal_tolerance: float = 2.0
    min_instances_floor: int = 1
    # the simulator sleeps nothing unless a scenario turns sleep mode on (`controller.shift.
    # sleep_mode`): its runs stay what they were before sleep mode existed
    shift: ShiftParams = dataclasses.field(default_factory=lambda: ShiftParams(sleep_mode="off"))
    # the planner's knobs (the scenario's `planner:` section: `sizing`)
    planner: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)


class SimController:
    """The simulator's shell around the controller's tick (`control/core/tick.py`): it reads
    what its gateway exposes, calls the core and carries out what it says on the virtual
    clock (a shift by `ShiftRun`, its renewals and the next tick by events)."""

    def __init__(
        self,
        world: World,
        cluster: Cluster,
        demands: Sequence[ModelDemand],
        gateway_pool: Callable[[], list[dict[str, Any]]],
        num_queued: Callable[[], int],
        queued_by_model: Callable[[], dict[str, int]],
        params: ControllerParams,
        rng: random.Random,
        on_shift: Callable[[dict[str, Any]], None],
    ) -> None:
        self.world = world
        self.demands = tuple(demands)
        self.gateway_pool = gateway_pool
        self.num_queued = num_queued
        self.queued_by_model = queued_by_model  # the gateway's wait queue by model
        self.params = params
        self.on_shift = on_shift  # a finished shift's record (for the report)
        self.resources = Resources.of(cluster, 0.0)
        # the built-in gear table (no store); the policy's drain deadline is the scenario's
        # `shift.pricing` as given (the live controller prices at its own drain deadline)
        self.planner = ControllerPlanner(GearLookup(), config=params.planner)
        self.core = TickCore(
            TickParams(self.demands, STANDBY_HOLD_S, params.tick_s, params.min_instances_floor),
            ShiftPolicy(params.shift, planner=self.planner),
            self.planner,
            rng,
        )
        self.ttft = LatencyBuckets(TTFT_HISTOGRAM, _LATENCY_BUCKETS_S)
        self.tpot = LatencyBuckets(TPOT_HISTOGRAM, _TPOT_BUCKETS_S)
        self.running: dict[str, Any] = {}  # instance key -> record
        self.sleepers: dict[str, Any] = {}  # instance key -> record of a sleeping engine
        self.decisions: list[dict[str, Any]] = []  # shifts and holds under a trigger
        self.num_decisions = 0
        self.resource_events: list[dict[str, Any]] = []
        self._done: dict[str, float] = {d.name: 0.0 for d in demands}
        self._shifting = False
        self._shift_started_s = 0.0
        self._num_shifts = 0  # a renewal event belongs to the shift it counts
        self._tick_version = 0
        self.refusals: list[dict[str, Any]] = []  # when each started and ended (the report)
        # standby sleepers (policies/shift/standby_sleepers.py; `shift.standby`, off by default)
        self._peak_awake: dict[str, int] = {}  # model -> most instances awake at once
        self._peak_rates: dict[str, float] = {}  # model -> highest rate measured, req/s
        # (tick time, finished requests by model then): the rate over the last ticks
        self._done_seen: deque[tuple[float, dict[str, float]]] = deque(maxlen=3)
        self._idle_since: dict[str, float] = {}  # model -> since when it serves nothing
        self._to_sleep: set[str] = set()  # standbys of the first plan, put to sleep after it
        self._waking = False  # sleepers wake beside the shifts
        self._standby_busy = False  # standbys start (launched, then put to sleep) beside
        self._aside_gpus: set[str] = set()  # GPUs the standbys loading beside take
        self._tick_after_aside = False  # a tick came during a wake beside
        self._main_gpus: set[str] = set()  # what the shift in progress touches
        self._main_keys: set[str] = set()
        self._aside_every_s = params.shift.standby.aside_tick_s or params.tick_s
        self._standby_checked_s = -math.inf  # when standbys were last looked for

    @property
    def cluster(self) -> Cluster:
        return self.resources.effective

    @property
    def refused(self) -> dict[str, str]:
        """Models with no instance none can place -> why."""
        return self.core.standby_state.refused

    @property
    def shifting_since(self) -> float | None:
        """When the shift in progress started (None: none is)."""
        return self._shift_started_s if self._shifting else None

    # ------------------------------------------------------------------ what the gateway sees
    def first_token(self, model: str, ttft_s: float) -> None:
        """The gateway's TTFT of a request whose first token just reached its client."""
        self.ttft.observe(model, ttft_s)

    def request_ended(self, req: SimRequest) -> None:
        """The gateway's readings of a finished request (the controller reads them)."""
        self._done[req.model] = self._done.get(req.model, 0.0) + 1
        if req.completed and req.num_generated_tokens > 1:
            self.tpot.observe(req.model, req.tpot_s)

    # ------------------------------------------------------------------ lifecycle
    def start(self, now: float) -> None:
        first = self.planner(self.cluster, self.demands, now)
        # with standbys: each model's burst set instead of the first plan's (it is asleep,
        # save what the requests held meanwhile need, once it served them)
        standbys = self._standbys([], now)
        with_standby = {s.model for s in standbys}
        first_target = [
            *standbys,
            *(i for i in first.instances if i.model not in with_standby),
        ]
        self._to_sleep = {instance_key(s) for s in standbys}
        self.decisions.append(
            {
                "at_s": now,
                "action": "shift",
                "trigger": "plan",
                "reason": "the first plan",
                "score": None,
                "target": [i.name for i in first_target],
            }
        )
        # the first plan's models are held while their engines load (queued, not 404); the
        # live controller's `start` adopts what a previous one left running first
        held = cold_models(first_target, [r.planned for r in self.running.values()])
        for model in held:
            self.world.hold(model, STANDBY_HOLD_S, now)
        self._carry_out(
            first_target,
            now,
            None,
            self.core.renewal(held),
            rehearse=False,
            all_or_nothing=False,
            release=held,
        )
        if self.params.shift.standby.enabled:
            self.world.loop.at(now + self._aside_every_s, CONTROL, self._aside_tick)

    def _schedule_tick(self, at_s: float) -> None:
        self._tick_version += 1
        version = self._tick_version
        self.world.loop.at(at_s, CONTROL, lambda t: self._tick(t, version))

    def file_changed(self, file: Cluster, now: float) -> list[ResourceEvent]:
        """The cluster file changed (the timeline): events, and a tick at once (the live
        controller's file watch wakes its tick the same way)."""
        self.resources, events = self.resources.file_changed(file, now)
        self.core.resources_changed(events, now)
        if events:
            for e in events:
                self.resource_events.append(
                    {"at_s": now, "gpu": e.gpu, "kind": e.kind.value, "why": e.why}
                )
            if not self._shifting:
                self._schedule_tick(now)
        return events

    def instance_died(self, rec: Any, now: float) -> None:
        """An engine died with its GPUs (the simulator says when; the live controller finds
        out at its next tick): out of the running plan, its GPUs re-planned."""
        self.core.drop_dead(self.running, [rec], now)

    # ------------------------------------------------------------------ one tick
    def _tick(self, now: float, version: int) -> None:
        """The core's steps at one instant of the virtual clock (no shift runs: the live
        controller awaits its shift inside its tick, this one ticks again when it ends)."""
        if version != self._tick_version or self._shifting:
            return
        # a wake or a standby's sleep beside: right after it; a burst's sleepers wake first
        if self._waking or (self.params.shift.standby.enabled and self._wake_aside(now)):
            self._tick_after_aside = True
            return
        core = self.core
        self.resources, events = self.resources.tick(now)
        core.resources_changed(events, now)
        serving = {r.planned.model for r in self.running.values()}
        for cmd in core.standby(serving, self.resources, now, now):
            self._send(cmd, now)
            change = core.standby_state.settle(cmd)
            if change is not None:
                self.refusals.append({"at_s": now, "model": change.model, "refused": change.why})
        readings = Readings(
            self.gateway_pool(),
            {**self.ttft.read(), **self.tpot.read()},
            self.num_queued(),
            self.queued_by_model(),
            self._done,
        )
        core.observe(now, readings)
        asleep = [
            (r.planned, r.sleep.level)
            for r in self.sleepers.values()
            if r.released_s < 0 and r.sleep is not None and r.sleep.level is not None
        ]
        running = [r.planned for r in self.running.values()]
        cluster = self.cluster
        if self.params.shift.standby.enabled:
            self._peak_awake = most_awake(self._peak_awake, running)
            self._done_seen.append((now, dict(self._done)))
            self._peak_rates = peak_rates(self._peak_rates, recent_rates(self._done_seen))
            cluster = self._standby_view(cluster)
        decided = core.decide(now, cluster, running, asleep)
        self.num_decisions += 1
        if decided.logged:
            self.decisions.append(decision_brief(decided.decision))
        if decided.shift:
            target = decided.decision.target
            assert target is not None
            self._carry_out(list(target), now, decided.decision, decided.renewal)
            return
        self._schedule_tick(now + self.params.tick_s)

    def _send(self, cmd: StandbyCommand, now: float) -> None:
        """A hold or refusal to the gateway (the live controller's goes over HTTP)."""
        if cmd.why is not None:
            self.world.refuse(cmd.model, cmd.why, cmd.seconds, now)
        else:
            self.world.hold(cmd.model, cmd.seconds, now)

    def _renew_at(self, at_s: float, kept: Renewal, shift: int) -> None:
        """The renewal of holds and refusals while shift number `shift` runs, every
        `every_s` on the virtual clock (the live controller's is a task beside its shift,
        `StandbyModels.keep`); its end ends it."""

        def renew(now: float) -> None:
            if not self._shifting or shift != self._num_shifts:
                return
            for cmd in kept.commands(STANDBY_HOLD_S):
                self._send(cmd, now)
            self._renew_at(now + kept.every_s, kept, shift)

        self.world.loop.at(at_s, CONTROL, renew)

    # ------------------------------------------------------------------ carrying out
    def _carry_out(
        self,
        target: list[PlannedInstance],
        now: float,
        decision: ShiftDecision | None,
        kept: Renewal | None,
        rehearse: bool = True,
        all_or_nothing: bool = True,
        release: Sequence[str] = (),
        trigger: str = "plan",
    ) -> None:
        """`kept`: renewed while it runs; `release`: models held for this shift, released
        when it ends; `trigger`: its name in the report when no decision took it."""
        self._shifting = True
        # what the shift uses: its target's keys and every instance running as it starts
        self._main_keys = {instance_key(t) for t in target} | set(self.running)
        self._main_gpus = {g for t in target for g in t.gpu_ids} | {
            g for r in self.running.values() for g in r.planned.gpu_ids
        }
        self._shift_started_s = now
        self._num_shifts += 1
        p = self.params
        if kept is not None:
            self._renew_at(now + kept.every_s, kept, self._num_shifts)
        shielded = self._shielded(self.running, target)

        def done(outcome: ShiftOutcome, end: float) -> None:
            self._unshield(shielded)
            self._shifting = False
            self._main_gpus, self._main_keys = set(), set()
            for model in release:
                self.world.hold(model, 0.0, end)
            # refused: no failure of the target (no blacklist)
            self.core.shift_finished(outcome, end, decided=decision is not None)
            self.on_shift(
                _record(
                    now,
                    end,
                    decision.trigger if decision is not None else trigger,
                    decision.reason if decision is not None else _REASONS[trigger],
                    None if decision is None else decision.score,
                    outcome,
                )
            )
            keys = self._first_standbys_to_sleep() if decision is None else set()
            if keys:
                self._carry_out(
                    [r.planned for k, r in self.running.items() if k not in keys],
                    end,
                    None,
                    None,
                    rehearse=False,
                    all_or_nothing=False,
                    trigger="standby",
                )
                return
            self._schedule_tick(end + p.tick_s)

        run = ShiftRun(
            self.world,
            self.running,
            target,
            done,
            drain_deadline_s=p.drain_deadline_s,
            rehearsal_tolerance=p.rehearsal_tolerance,
            rehearse=rehearse,
            all_or_nothing=all_or_nothing,
            sleepers=self.sleepers,
            sleep_levels=self._sleep_levels(target),
            in_place=self._in_place(),
            in_place_drain_s=p.shift.pricing.in_place_drain_s,
        )
        run.start(now)

    def _in_place(self) -> InPlaceChooser | None:
        """How in-place steps re-gear (`shift.pricing.in_place`; None: rolling)."""
        if self.params.shift.pricing.in_place == ROLLING:
            return None
        cluster = self.cluster
        level1 = [r.planned for r in self.sleepers.values() if r.sleep and r.sleep.level == 1]
        return in_place_chooser(
            MAKE_BEFORE_BREAK,
            engine_kind("sim").sleep_levels,
            cluster,
            level1,
            lambda p: perf_model_of(cluster, p, spec=load_model_spec(p.model_id)),
        )

    # ------------------------------------------------------------------ standby sleepers
    def _asleep_now(self) -> list[Any]:
        """The records of the engines asleep now (not released)."""
        return [
            r
            for r in self.sleepers.values()
            if r.released_s < 0 and r.sleep is not None and r.sleep.level is not None
        ]

    def _first_standbys_to_sleep(self) -> set[str]:
        """The first plan's standbys that go to sleep once it is done: those of models no
        request waits for and none is served on (the others serve their burst first; the
        idle sleep or the down trigger puts them to sleep)."""
        waiting = {m for m, n in self.queued_by_model().items() if n > 0}
        waiting |= {
            str(rec.get("model"))
            for rec in self.gateway_pool()
            if rec.get("state") == "active" and float(rec.get("num_in_flight") or 0) > 0
        }
        keys = {
            k
            for k in self._to_sleep
            if k in self.running and self.running[k].planned.model not in waiting
        }
        self._to_sleep = set()
        return keys

    def _wake_aside(self, now: float) -> bool:
        """Wake the sleepers of the models with requests waiting beside the shift in
        progress (if any); True when a wake started."""
        if self._waking or not self.params.shift.standby.wake_aside:
            return False
        wakes = wakes_aside(
            self.cluster,
            [r.planned for r in self.running.values()],
            [r.planned for r in self._asleep_now()],
            pressed(
                self.gateway_pool(),
                self.queued_by_model(),
                self.params.shift.standby.busy_fraction,
            ),
            self._main_gpus,
            self._main_keys,
            self.params.shift.standby.wakes_per_tick,
        )
        if not wakes:
            return self._swap_aside(now)
        running = [r.planned for r in self.running.values()]
        self._waking = True

        def woken(end: float) -> None:
            self._waking = False

        self._run_aside(self.running, [*running, *wakes], now, "wake-aside", woken)
        return True

    def _sleep_idle(self, now: float) -> bool:
        """Put the engines of models idle for `standby.sleep_idle_s` to sleep beside the
        shift in progress (if any); True when that started."""
        params = self.params.shift.standby
        self._idle_since = idle_since(
            self._idle_since, self.gateway_pool(), self.queued_by_model(), now
        )
        if self._waking or params.sleep_idle_s <= 0:
            return False
        leaving = sleeps_aside(
            [r.planned for r in self.running.values()],
            self._idle_since,
            now,
            params,
            self._main_keys,
        )
        if not leaving:
            return False
        gone = {instance_key(i) for i in leaving}
        target = [r.planned for k, r in self.running.items() if k not in gone]
        self._waking = True

        def asleep(end: float) -> None:
            self._waking = False

        self._run_aside(
            self.running, target, now, "sleep-aside", asleep, self._sleep_levels(target)
        )
        return True

    def _standby_view(self, cluster: Cluster) -> Cluster:
        """The GPUs free to us as the planner sees them beside standby sleepers: the memory
        each sleeper still holds is used, and a standby loading beside the shifts holds its
        GPUs whole."""
        # time-sharing: a sleeper beside a running instance of another model fits in what
        # that instance's engine leaves (standby_time_shared): not counted again, nor taken
        # for another tenant's
        beside = self._held_by_running()
        return standby_view(
            cluster,
            [
                (r.planned, r.sleep.gpu_memory_bytes)
                for r in self._asleep_now()
                if not set(r.planned.gpu_ids) & beside
            ],
            self.params.shift.standby.keep_for_wake,
            self._aside_gpus - beside,
        )

    def _standbys(
        self, awake: list[PlannedInstance], now: float, busy: Sequence[PlannedInstance] = ()
    ) -> list[PlannedInstance]:
        """The standby engines to start beside `awake` (and what `busy` takes); none unless
        `shift.standby` is on."""
        params = self.params.shift.standby
        if not params.enabled:
            return []
        waiting = {m for m, n in self.queued_by_model().items() if n > 0}
        # every sleeper, waking ones too: no standby lands on their GPUs
        sleeping = [r.planned for r in self.sleepers.values() if r.released_s < 0]
        chosen = standby_wanted(
            self._standby_view(self.cluster),
            self.demands,
            [*awake, *busy],
            sleeping,
            self._peak_awake,
            self._peak_rates,
            self.planner,
            now,
            params,
            skip=waiting,
        )
        if not params.time_share:
            return chosen
        cluster = self.cluster
        for g in sorted(self._aside_gpus & set(cluster.gpu_ids)):
            cluster = cluster.with_used(g, cluster.gpu(g).capacity_bytes, owner="flexpipe")
        shared = standby_time_shared(
            cluster,
            self.demands,
            [*awake, *busy],
            [*sleeping, *chosen],
            self._peak_awake,
            self._peak_rates,
            self.planner,
            now,
            params,
            self._footprint_bytes,
            skip=waiting,
        )
        return [*chosen, *shared]

    def _held_by_running(self) -> set[str]:
        """With `standby.time_share`, the GPUs running instances hold (where sleepers of
        other models may sleep beside them); else none."""
        if not self.params.shift.standby.time_share:
            return set()
        return {g for r in self.running.values() for g in r.planned.gpu_ids}

    def _shielded(
        self, running: dict[str, Any], target: Sequence[PlannedInstance]
    ) -> dict[str, Any]:
        """With `standby.time_share`: the sleepers a change from `running` to `target` must
        keep although they share GPUs with a target instance, taken out of `sleepers` while
        it runs (give them back with `_unshield`): they sleep beside an instance that runs
        on (the shift procedure stops every sleeper on GPUs a target instance holds, as it
        must for a new one)."""
        if not self.params.shift.standby.time_share:
            return {}
        wanted = {instance_key(t) for t in target}
        new_gpus = {
            g
            for t in target
            if instance_key(t) not in running and instance_key(t) not in self.sleepers
            for g in t.gpu_ids
        }
        kept_gpus = {g for t in target if instance_key(t) in running for g in t.gpu_ids}
        keys = [
            k
            for k, r in self.sleepers.items()
            if k not in wanted
            and not set(r.planned.gpu_ids) & new_gpus
            and set(r.planned.gpu_ids) & kept_gpus
        ]
        return {k: self.sleepers.pop(k) for k in keys}

    def _unshield(self, shielded: dict[str, Any]) -> None:
        for k, r in shielded.items():
            self.sleepers.setdefault(k, r)

    def _footprint_bytes(self, inst: PlannedInstance, awake: bool) -> float:
        """The GPU memory `inst` holds on all its GPUs together, awake or asleep, as the
        performance model prices it (asleep: its reserve, as the sim engine's
        `SleepState.gpu_memory_bytes` reads it)."""
        pm = perf_model_of(self.cluster, inst, spec=load_model_spec(inst.model_id))
        if awake:
            return sum(
                g.weights_bytes + g.reserve_bytes + max(g.kv_bytes, 0.0) for g in pm.memory.per_gpu
            )
        return sum(g.reserve_bytes for g in pm.memory.per_gpu)

    def _swap_aside(self, now: float) -> bool:
        """Time-sharing (`standby.time_share`): wake a pressed model's sleeper on GPUs
        another model's running instance holds, that instance put to sleep first (the
        level `sleep_levels` gives it; one that cannot sleep stops), then the sleeper woken,
        both through the shift procedure and priced by the performance model; True when a
        swap started."""
        params = self.params.shift.standby
        if not (params.enabled and params.time_share):
            return False
        swaps = swaps_aside(
            self.cluster,
            [r.planned for r in self.running.values()],
            [r.planned for r in self._asleep_now()],
            pressed(self.gateway_pool(), self.queued_by_model(), params.busy_fraction),
            {d.name: d.priority for d in self.demands},
            {k: float(len(self.world.requests_on(r))) for k, r in self.running.items()},
            self._main_gpus,
            self._main_keys,
            params.wakes_per_tick,
        )
        if not swaps:
            return False
        gone = {instance_key(h) for s in swaps for h in s.sleep}
        kept = [r.planned for k, r in self.running.items() if k not in gone]
        self._waking = True

        def woken(end: float) -> None:
            self._waking = False

        def wake(end: float) -> None:
            running = [r.planned for r in self.running.values()]
            self._run_aside(
                self.running, [*running, *(s.wake for s in swaps)], end, "swap-wake", woken
            )

        self._run_aside(self.running, kept, now, "swap-sleep", wake, self._sleep_levels(kept))
        return True

    def _aside_tick(self, now: float) -> None:
        """Every `standby.aside_tick_s`, beside the shifts: a model with requests waiting
        wakes its sleepers on GPUs the shift in progress (if any) does not touch, at once;
        else, every `tick_s`, models short of standbys get them started (launched, then put
        to sleep)."""
        self.world.loop.at(now + self._aside_every_s, CONTROL, self._aside_tick)
        if self._wake_aside(now) or self._sleep_idle(now) or self._standby_busy:
            return
        running = [r.planned for r in self.running.values()]
        if now < self._standby_checked_s + self.params.tick_s:
            return
        self._standby_checked_s = now
        busy = self._main_gpus  # the shift in progress's GPUs: not for a standby now
        standbys = [s for s in self._standbys(running, now) if not set(s.gpu_ids) & busy]
        if standbys:
            # started in a running plan of their own: the policy sees them once asleep
            loading: dict[str, Any] = {}
            self._standby_busy = True
            self._aside_gpus = {g for s in standbys for g in s.gpu_ids}
            self._run_aside(
                loading, standbys, now, "standby", lambda end: self._sleep_aside(loading, end)
            )

    def _sleep_aside(self, loading: dict[str, Any], now: float) -> None:
        """The standbys `loading` are up: put them to sleep (the level `sleep_levels` gives
        each; one that cannot sleep stops), then lift the holds their plan's end made on the
        models that have instances."""

        def asleep(end: float) -> None:
            self._standby_busy = False
            self._aside_gpus = set()
            serving = {r.planned.model for r in self.running.values()}
            for model in sorted({r.planned.model for r in loading.values()} | serving):
                if model in serving:
                    self.world.hold(model, 0.0, end)

        levels = self._sleep_levels([], loading)
        self._run_aside(loading, [], now, "standby", asleep, levels)

    def _run_aside(
        self,
        running: dict[str, Any],
        target: list[PlannedInstance],
        now: float,
        trigger: str,
        then: Callable[[float], None],
        sleep_levels: dict[str, int] | None = None,
    ) -> None:
        """A change beside the shifts (a wake, a standby's start or sleep) through the same
        shift procedure, from `running` (key -> record, changed in place); not in the
        policy's history. `then`: called at its end."""
        p = self.params
        shielded = self._shielded(running, target)
        # time-sharing: a standby's start stops no sleeper on its GPUs (it fits beside them
        # asleep, standby_time_shared); it wakes none either
        starting = self.params.shift.standby.time_share and trigger == "standby" and target

        def done(outcome: ShiftOutcome, end: float) -> None:
            self._unshield(shielded)
            self.on_shift(_record(now, end, trigger, _REASONS[trigger], None, outcome))
            then(end)
            if self._tick_after_aside and not self._waking:
                self._tick_after_aside = False
                self._schedule_tick(end)

        run = ShiftRun(
            self.world,
            running,
            target,
            done,
            drain_deadline_s=p.drain_deadline_s,
            rehearsal_tolerance=p.rehearsal_tolerance,
            rehearse=False,
            all_or_nothing=False,
            sleepers={} if starting else self.sleepers,
            sleep_levels=sleep_levels or {},
        )
        run.start(now)

    def _sleep_levels(
        self, target: Sequence[PlannedInstance], running: dict[str, Any] | None = None
    ) -> dict[str, int]:
        """Which of the running instances `target` lacks sleep instead of stopping, and how
        deep (control/core/sleeping.py; none with `shift.sleep_mode` off, the default). A
        sleeper whose engine died with its GPUs is forgotten first. `running`: the running
        plan (the controller's own by default)."""
        running = self.running if running is None else running
        for key in [k for k, r in self.sleepers.items() if r.released_s >= 0]:
            del self.sleepers[key]
        mode = self.params.shift.sleep_mode
        if mode == "off":
            return {}
        cluster = self.cluster
        specs = {r.planned.model_id: load_model_spec(r.planned.model_id) for r in running.values()}
        specs |= {
            r.planned.model_id: load_model_spec(r.planned.model_id) for r in self.sleepers.values()
        }
        return sleep_levels(
            mode,
            engine_kind("sim").sleep_levels,
            cluster,
            leaving_of({k: r.planned for k, r in running.items()}, target),
            [
                r.planned
                for r in self.sleepers.values()
                if r.sleep is not None and r.sleep.level == 1
            ],
            lambda p: perf_model_of(cluster, p, spec=specs[p.model_id]),
        )


_REASONS = {"plan": "the first plan", **ASIDE_REASONS}


def _record(
    at_s: float,
    end_s: float,
    trigger: str,
    reason: str,
    score: float | None,
    outcome: ShiftOutcome,
) -> dict[str, Any]:
    """A finished shift as the report keeps it."""
    return {
        "at_s": at_s,
        "finished_s": end_s,
        "trigger": trigger,
        "reason": reason,
        "score": None if score is None else round(score, 3),
        "succeeded": outcome.succeeded,
        "refused": outcome.refused,
        "outcome": _outcome(outcome),
        "why_failed": outcome.reason,
        "phases_s": {k: round(v, 6) for k, v in outcome.phases_s.items()},
        "migrated": dict(sorted(outcome.migrated.items())),
        "rehearsal": outcome.rehearsal,
        "started": outcome.started,
        "stopped": outcome.stopped,
    }


def _outcome(out: ShiftOutcome) -> str:
    """The shift log's outcome of a finished shift (`Journal.finish`'s words)."""
    return "succeeded" if out.succeeded else "refused" if out.refused else "rolled_back"
