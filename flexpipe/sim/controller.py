"""The live controller's loop on the virtual clock (`flexpipe/control/controller.py`).

Every `tick_s` (10 s), or at once when the GPUs change:

1. GPU changes come from the scenario's resource timeline through the controller's own
   `Resources.file_changed` (the same events the live file watch produces); an engine that
   died with its GPUs is an emergency: out of the running plan, its GPUs re-planned;
2. each model's `Sample` from what the gateway exposes — its pool records (`as_dict`, as
   `GET /admin/instances` gives them) and its TTFT and TPOT histograms (`LatencyBuckets`:
   the cumulative bucket counts the live controller parses from the gateway's Prometheus
   text, with `GatewayMetrics`' bounds) — read by the controller's `Sampler`; arrival rates
   by `RateWindow`;
3. `ShiftPolicy.decide(snapshot, now, rng)`, the live policy;
4. a shift is carried out by `ShiftRun` (make-before-break, the executor's phases), during
   which the controller does not tick (the live one awaits the shift inside its tick); the
   holds and refusals a tick renews are renewed meanwhile, as live (`standby.renewal`), by
   an event on the virtual clock, so a shift longer than the hold does not let them lapse.

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
from flexpipe.control.core.observe import RateWindow, model_states
from flexpipe.control.core.resources import ResourceEvent, Resources
from flexpipe.control.core.samples import TPOT_HISTOGRAM, TTFT_HISTOGRAM, Buckets, Sampler
from flexpipe.control.core.shift_outcome import finished_record
from flexpipe.control.standby import Renewal, renewal
from flexpipe.gateway.gateway_metrics import _LATENCY_BUCKETS_S, _TPOT_BUCKETS_S
from flexpipe.gateway.holds import STANDBY_HOLD_S
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner import ModelDemand, Plan, PlannedInstance, plan
from flexpipe.policies.planner.memo import EvaluationMemo
from flexpipe.policies.shift import ShiftParams, ShiftPolicy, placeable
from flexpipe.policies.shift.decision import ShiftDecision
from flexpipe.policies.shift.signals import Sample
from flexpipe.policies.shift.snapshot import ShiftRecord, ShiftSnapshot
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
    shift: ShiftParams = dataclasses.field(default_factory=ShiftParams)


class SimController:
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
        self.rng = rng
        self.on_shift = on_shift  # a finished shift's record (for the report)
        self.resources = Resources.of(cluster, 0.0)
        # the built-in gear table (no store), and the planner's evaluations across re-plans
        self._performance = GearLookup()
        self._memo = EvaluationMemo()
        self.policy = ShiftPolicy(params.shift, planner=self._planner)
        self.ttft = LatencyBuckets(TTFT_HISTOGRAM, _LATENCY_BUCKETS_S)
        self.tpot = LatencyBuckets(TPOT_HISTOGRAM, _TPOT_BUCKETS_S)
        self.running: dict[str, Any] = {}  # instance key -> record
        self.history: list[ShiftRecord] = []
        self.samples: dict[str, list[Sample]] = {d.name: [] for d in demands}
        self.resources_changed_s: float | None = None
        self.decisions: list[dict[str, Any]] = []  # shifts and holds under a trigger
        self.num_decisions = 0
        self.resource_events: list[dict[str, Any]] = []
        self._sampler = Sampler()
        self._rates = RateWindow(
            {d.name: d.request_rate_per_s for d in demands}, keep_s=params.shift.forecast.keep_s
        )
        self._done: dict[str, float] = {d.name: 0.0 for d in demands}
        self._shifting = False
        self._shift_started_s = 0.0
        self._num_shifts = 0  # a renewal event belongs to the shift it counts
        self._tick_version = 0
        self._decision: ShiftDecision | None = None
        self._standby: set[str] = set()  # models held in the gateway with no instance
        self.refused: dict[str, str] = {}  # models with no instance none can place -> why
        self.refusals: list[dict[str, Any]] = []  # when each started and ended (the report)

    @property
    def cluster(self) -> Cluster:
        return self.resources.effective

    @property
    def shifting_since(self) -> float | None:
        """When the shift in progress started (None: none is)."""
        return self._shift_started_s if self._shifting else None

    def _planner(
        self, cluster: Cluster, demands: Sequence[ModelDemand], now_s: float = 0.0
    ) -> Plan:
        """The controller's planner: planned fresh for the GPUs free now (no store: the
        built-in gear table), as the live controller's, with one lookup and one memo of
        evaluations for the whole run."""
        return plan(cluster, demands, self._performance, now_s=now_s, memo=self._memo)

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
        first = self._planner(self.cluster, self.demands, now)
        self.decisions.append({"at_s": now, "action": "shift", "trigger": "plan",
                               "reason": "the first plan", "score": None,
                               "target": [i.name for i in first.instances]})  # fmt: skip
        # as live: the first plan's models are held while their engines load (queued, not 404)
        held = sorted({p.model for p in first.instances})
        for model in held:
            self.world.hold(model, STANDBY_HOLD_S, now)
        self._carry_out(list(first.instances), now, None, rehearse=False, all_or_nothing=False,
                        release=held)  # fmt: skip

    def _schedule_tick(self, at_s: float) -> None:
        self._tick_version += 1
        version = self._tick_version
        self.world.loop.at(at_s, CONTROL, lambda t: self._tick(t, version))

    def file_changed(self, file: Cluster, now: float) -> list[ResourceEvent]:
        """The cluster file changed (the timeline): events, and a tick at once."""
        self.resources, events = self.resources.file_changed(file, now)
        if events:
            self.resources_changed_s = now
            for e in events:
                self.resource_events.append({"at_s": now, "gpu": e.gpu, "kind": e.kind.value,
                                             "why": e.why})  # fmt: skip
            if not self._shifting:
                self._schedule_tick(now)
        return events

    def instance_died(self, rec: Any, now: float) -> None:
        """`_reap_dead`: out of the running plan; its GPUs are re-planned."""
        key = rec.key
        if self.running.get(key) is rec:
            del self.running[key]
            self.resources_changed_s = now

    # ------------------------------------------------------------------ one tick
    def _tick(self, now: float, version: int) -> None:
        if version != self._tick_version or self._shifting:
            return
        self.resources, events = self.resources.tick(now)
        if events:
            self.resources_changed_s = now
        self._hold_standby(now)
        self._sample(now)
        snapshot = ShiftSnapshot.of(
            self.cluster,
            [r.planned for r in self.running.values()],
            model_states(
                self.demands,
                self._rates.rates_per_s,
                self.samples,
                self.params.min_instances_floor,
                self._rates.expected_rates_per_s(now, self.params.shift.forecast),
            ),
            self.history,
            self.resources_changed_s,
        )
        decision = self.policy.decide(snapshot, now, self.rng)
        self.num_decisions += 1
        if decision.action == "shift" and decision.target is not None:
            self.decisions.append(_brief(decision))
            self.history.append(decision.started(now))
            self._decision = decision
            self._carry_out(list(decision.target), now, decision)
            return
        if decision.trigger != "none":
            self.decisions.append(_brief(decision))
        self._schedule_tick(now + self.params.tick_s)

    def _hold_standby(self, now: float) -> None:
        """As the live controller's: a model with no instance is held (its requests queue
        for the wake), or refused when the planner cannot place one instance of it alone on
        the GPUs free to us and no occupation ends within the hold (`placeable.unplaceable`,
        the live controller's check)."""
        serving = {r.planned.model for r in self.running.values()}
        standby = {d.name for d in self.demands} - serving
        next_change_s = self.resources.next_change_s()
        unplaceable = placeable.unplaceable(
            self.cluster, self.demands, standby, now, self._planner,
            self.params.shift.wake_request_rate_per_s,
            None if next_change_s is None else next_change_s - now,
            STANDBY_HOLD_S,
        )  # fmt: skip
        for model in sorted(standby | self._standby | set(self.refused)):
            why = unplaceable.get(model)
            if why is not None:
                self.world.refuse(model, why, STANDBY_HOLD_S, now)
                if model not in self.refused:
                    self.refusals.append({"at_s": now, "model": model, "refused": why})
                self.refused[model] = why
            else:
                self.world.hold(model, STANDBY_HOLD_S if model in standby else 0.0, now)
                if self.refused.pop(model, None) is not None:
                    self.refusals.append({"at_s": now, "model": model, "refused": None})
            if model in standby:
                self._standby.add(model)
            else:
                self._standby.discard(model)

    def _sample(self, now: float) -> None:
        names = [d.name for d in self.demands]
        pool = self.gateway_pool()
        readings = self._sampler.sample_histograms(
            now, names, pool, {**self.ttft.read(), **self.tpot.read()}, self.num_queued(),
            self.queued_by_model(),
        )  # fmt: skip
        for name, sample in readings.items():
            self.samples[name].append(sample)
            del self.samples[name][:-100]
        self._rates.observe(now, self._done, names)

    def _renew_at(self, at_s: float, kept: Renewal, shift: int) -> None:
        """The live controller's renewal task (`StandbyModels.keep`) on the virtual clock:
        every `every_s` while shift number `shift` runs; its end ends it."""

        def renew(now: float) -> None:
            if not self._shifting or shift != self._num_shifts:
                return
            for model, why in kept.refused:
                self.world.refuse(model, why, STANDBY_HOLD_S, now)
            for model in kept.held:
                self.world.hold(model, STANDBY_HOLD_S, now)
            self._renew_at(now + kept.every_s, kept, shift)

        self.world.loop.at(at_s, CONTROL, renew)

    # ------------------------------------------------------------------ carrying out
    def _carry_out(
        self,
        target: list[PlannedInstance],
        now: float,
        decision: ShiftDecision | None,
        rehearse: bool = True,
        all_or_nothing: bool = True,
        release: Sequence[str] = (),
    ) -> None:
        """`release`: models held for this shift, released when it ends."""
        self._shifting = True
        self._shift_started_s = now
        self._num_shifts += 1
        p = self.params
        # as live: also the models the target has none of (ShiftRun holds them at zero)
        to_zero = {r.planned.model for r in self.running.values()} - {t.model for t in target}
        kept = renewal(
            self._standby | set(release) | to_zero, self.refused, p.tick_s, STANDBY_HOLD_S
        )
        if kept is not None:
            self._renew_at(now + kept.every_s, kept, self._num_shifts)

        def done(outcome: ShiftOutcome, end: float) -> None:
            self._shifting = False
            for model in release:
                self.world.hold(model, 0.0, end)
            if decision is not None:  # refused: no failure of the target (no blacklist)
                self.history[-1] = finished_record(self.history[-1], outcome, end)
            if outcome.succeeded:
                self.resources_changed_s = None
            self.on_shift({
                "at_s": now, "finished_s": end,
                "trigger": decision.trigger if decision is not None else "plan",
                "reason": decision.reason if decision is not None else "the first plan",
                "score": None if decision is None or decision.score is None
                else round(decision.score, 3),
                "succeeded": outcome.succeeded, "refused": outcome.refused,
                "outcome": _outcome(outcome), "why_failed": outcome.reason,
                "phases_s": {k: round(v, 6) for k, v in outcome.phases_s.items()},
                "migrated": dict(sorted(outcome.migrated.items())),
                "rehearsal": outcome.rehearsal,
                "started": outcome.started, "stopped": outcome.stopped,
            })  # fmt: skip
            self._schedule_tick(end + p.tick_s)

        run = ShiftRun(
            self.world, self.running, target, done,
            drain_deadline_s=p.drain_deadline_s, rehearsal_tolerance=p.rehearsal_tolerance,
            rehearse=rehearse, all_or_nothing=all_or_nothing,
        )  # fmt: skip
        run.start(now)


def _outcome(out: ShiftOutcome) -> str:
    """The shift log's outcome of a finished shift (`Controller._finish_entry`'s words)."""
    return "succeeded" if out.succeeded else "refused" if out.refused else "rolled_back"


def _brief(d: ShiftDecision) -> dict[str, Any]:
    return {
        "at_s": d.at_s,
        "action": d.action,
        "trigger": d.trigger,
        "reason": d.reason,
        "score": None if d.score is None else round(d.score, 3),
        "target": None if d.target is None else [i.name for i in d.target],
    }
