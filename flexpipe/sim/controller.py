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
from collections.abc import Callable, Sequence
from typing import Any

from flexpipe.cluster import Cluster
from flexpipe.control.core.planner import ControllerPlanner
from flexpipe.control.core.resources import ResourceEvent, Resources
from flexpipe.control.core.samples import TPOT_HISTOGRAM, TTFT_HISTOGRAM, Buckets
from flexpipe.control.core.shift_procedure import InPlaceChooser
from flexpipe.control.core.sleeping import in_place_chooser, leaving_of, sleep_levels
from flexpipe.control.core.standby import Renewal, StandbyCommand
from flexpipe.control.core.standby_aside import first_plan
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
from flexpipe.sim.loop import CONTROL
from flexpipe.sim.request import SimRequest
from flexpipe.sim.shift_record import REASONS, record
from flexpipe.sim.shift_run import ShiftOutcome, ShiftRun, World
from flexpipe.sim.standby_run import StandbyRun

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
        first_demands: Sequence[ModelDemand] | None = None,
    ) -> None:
        """`first_demands`: what the first plan is sized for (default `demands`; the
        scenario's `start.expected_window_s` raises it to the rates at the start)."""
        self.world = world
        self.demands = tuple(demands)
        self.first_demands = tuple(first_demands) if first_demands is not None else self.demands
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
        # standby sleepers beside the shifts (`shift.standby`, off by default)
        self.beside = StandbyRun(self)

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
        first = self.planner(self.cluster, self.first_demands, now)
        # with standbys: each model's burst set instead of the first plan's (it is asleep,
        # save what the requests held meanwhile need, once it served them)
        standbys = self.beside.standbys([], now)
        first_target = first_plan(standbys, first.instances)
        self.beside.to_sleep = {instance_key(s) for s in standbys}
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
            self.world.loop.at(now + self.beside.every_s, CONTROL, self.beside.tick)

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
        beside = self.beside
        if beside.waking or (self.params.shift.standby.enabled and beside.wake_aside(now)):
            beside.tick_after = True
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
            cluster = beside.observe(now, running, cluster)
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
        beside = self.beside
        beside.main_keys = {instance_key(t) for t in target} | set(self.running)
        beside.main_gpus = {g for t in target for g in t.gpu_ids} | {
            g for r in self.running.values() for g in r.planned.gpu_ids
        }
        self._shift_started_s = now
        self._num_shifts += 1
        p = self.params
        if kept is not None:
            self._renew_at(now + kept.every_s, kept, self._num_shifts)

        def done(outcome: ShiftOutcome, end: float) -> None:
            self._shifting = False
            beside.main_gpus, beside.main_keys = set(), set()
            for model in release:
                self.world.hold(model, 0.0, end)
            # refused: no failure of the target (no blacklist)
            self.core.shift_finished(outcome, end, decided=decision is not None)
            self.on_shift(
                record(
                    now,
                    end,
                    decision.trigger if decision is not None else trigger,
                    decision.reason if decision is not None else REASONS[trigger],
                    None if decision is None else decision.score,
                    outcome,
                )
            )
            keys = beside.first_to_sleep() if decision is None else set()
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
