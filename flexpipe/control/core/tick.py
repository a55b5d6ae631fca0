"""The controller's tick (pure): observe, signals, the shift policy's decision, what to do.

One tick, in this order (the live controller awaits the gateway between the steps, the
simulator's calls them at one instant of its virtual clock):

1. what changed since the last tick: GPUs (`resources_changed`: resource events start the
   resource trigger's clock) and engines that died (`drop_dead`: out of the running plan,
   their GPUs re-planned, an emergency);
2. `standby`: the holds and refusals of the models with no instance (core/standby.py), sent
   before the gateway is read (a hold that ends re-routes the requests it queued);
3. `decide`: the gateway's readings (`Readings`) become each model's `Sample` and arrival
   rate, the snapshot is built and `ShiftPolicy.decide(snapshot, now, rng)` answers; a shift
   it takes is entered in the policy's history, with the holds to renew while it runs;
4. the shell carries the shift out (the live executor, or the simulator's `ShiftRun`) and
   reports its end (`shift_finished`).

No clock, no I/O, no asyncio: `now_s` and a seeded `random.Random` come in.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from flexpipe.cluster import Cluster
from flexpipe.control.core.observe import RateWindow, model_states
from flexpipe.control.core.resources import ResourceEvent, Resources
from flexpipe.control.core.samples import Buckets, Sampler
from flexpipe.control.core.shift_outcome import ShiftOutcome, finished_record
from flexpipe.control.core.standby import Renewal, StandbyCommand, StandbyState
from flexpipe.policies.planner import ModelDemand, PlannedInstance
from flexpipe.policies.shift import ShiftPolicy
from flexpipe.policies.shift.candidates import Planner
from flexpipe.policies.shift.decision import ShiftDecision
from flexpipe.policies.shift.signals import Sample
from flexpipe.policies.shift.snapshot import ShiftRecord, ShiftSnapshot

__all__ = [
    "MAX_SAMPLES_KEPT",
    "Decided",
    "Readings",
    "TickCore",
    "TickParams",
    "cold_models",
    "decision_brief",
]

MAX_SAMPLES_KEPT = 100  # per model: the policy reads the newest few (observe.MAX_SAMPLES_GIVEN)

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class TickParams:
    """The controller's numbers a tick reads."""

    demands: tuple[ModelDemand, ...]
    standby_hold_s: float  # a hold or refusal of the gateway lasts this long, unless renewed
    tick_s: float = 10.0
    min_instances_floor: int = 1
    # sim engines at a time scale: wall seconds per modelled second (latencies and rates are
    # read in the model's seconds, as SLOs are); the simulator reads in modelled time: 1
    time_scale: float = 1.0


@dataclass(frozen=True, slots=True)
class Readings:
    """What the gateway exposes, read once per tick."""

    instances: Sequence[Mapping[str, Any]]  # its pool records (`GET /admin/instances`)
    # (TTFT_HISTOGRAM or TPOT_HISTOGRAM, model) -> cumulative buckets (`parse_histograms`)
    histograms: Mapping[tuple[str, str], Buckets]
    num_queued: int  # its wait queue, every model
    queued_by_model: Mapping[str, int] | None  # None: a gateway that does not say
    done_by_model: Mapping[str, float]  # cumulative finished requests per model


@dataclass(frozen=True, slots=True)
class Decided:
    """A tick's outcome. `shift`: a shift to carry out to `decision.target` (its record is in
    the history); `renewal`: the holds and refusals to renew while it runs."""

    decision: ShiftDecision
    snapshot: ShiftSnapshot
    shift: bool = False
    renewal: Renewal | None = None

    @property
    def logged(self) -> bool:
        """Kept in the simulator's report: a shift, or a hold under a trigger (the live
        shift log records every decision)."""
        return self.shift or self.decision.trigger != "none"


def decision_brief(d: ShiftDecision) -> dict[str, Any]:
    """A decision as the simulator's report keeps it (the live one's shift log keeps more:
    `ShiftEntry.from_decision`)."""
    return {
        "at_s": d.at_s,
        "action": d.action,
        "trigger": d.trigger,
        "reason": d.reason,
        "score": None if d.score is None else round(d.score, 3),
        "target": None if d.target is None else [i.name for i in d.target],
    }


def cold_models(target: Iterable[PlannedInstance], running: Iterable[PlannedInstance]) -> list[str]:
    """The models of `target` with no instance `running`: held in the gateway while their
    engines load (the first plan's), so that their requests queue instead of a 404."""
    return sorted({p.model for p in target} - {p.model for p in running})


class TickCore:
    """The state a controller carries from tick to tick (samples, rates, the policy's
    history, the standby models) and the steps of one tick (see the module docstring)."""

    def __init__(
        self, params: TickParams, policy: ShiftPolicy, planner: Planner, rng: random.Random
    ) -> None:
        """`planner`: the one the policy plans with (the standby check places with it too)."""
        self.params = params
        self.policy = policy
        self.planner = planner
        self.rng = rng
        names = [d.name for d in params.demands]
        self.samples: dict[str, list[Sample]] = {n: [] for n in names}
        self.sampler = Sampler()
        forecast = policy.params.forecast
        self.rates = RateWindow(
            {d.name: d.request_rate_per_s for d in params.demands}, keep_s=forecast.keep_s
        )
        self.expected_rates_per_s: dict[str, float] = {}  # model -> forecast (the last tick's)
        self.history: list[ShiftRecord] = []
        self.resources_changed_s: float | None = None
        self.standby_state = StandbyState()

    # ------------------------------------------------------------------ 1. what changed
    def resources_changed(self, events: Sequence[ResourceEvent], now_s: float) -> None:
        """GPUs came or went: the resource trigger's clock starts (again)."""
        if events:
            self.resources_changed_s = now_s

    def drop_dead(
        self, running: MutableMapping[str, _T], dead: Iterable[_T], now_s: float
    ) -> list[tuple[str, _T]]:
        """Engines that exited leave the running plan (`running`: instance key -> instance,
        changed in place); their GPUs are re-planned. Returns (key, instance) of each that
        left; one no longer in the plan (replaced under its key) is not dropped."""
        gone = {id(x) for x in dead}
        out = [(k, x) for k, x in running.items() if id(x) in gone]
        for key, _ in out:
            del running[key]
            self.resources_changed_s = now_s
        return out

    # ------------------------------------------------------------------ 2. standby
    def standby(
        self,
        serving: Iterable[str],
        resources: Resources,
        resources_now_s: float,
        now_s: float,
    ) -> list[StandbyCommand]:
        """The holds and refusals of the models not `serving`, placed on the GPUs free to us
        (`resources.effective`). `resources_now_s`: now on the resources' clock (the live
        controller's is the wall clock), for an occupation due to end within the hold. The
        shell settles each command the gateway took (`standby_state.settle`)."""
        p = self.params
        next_change_s = resources.next_change_s()
        return self.standby_state.commands(
            p.demands,
            set(serving),
            resources.effective,
            now_s,
            self.planner,
            self.policy.params.wake_request_rate_per_s,
            None if next_change_s is None else next_change_s - resources_now_s,
            p.standby_hold_s,
        )

    def standby_models(self, serving: Iterable[str]) -> list[str]:
        """The models with no instance (those not `serving`), in demand order."""
        names = set(serving)
        return [d.name for d in self.params.demands if d.name not in names]

    # ------------------------------------------------------------------ 3. decide
    def observe(self, now_s: float, readings: Readings) -> None:
        """Each model's `Sample` and the arrival rates, from the gateway's readings."""
        p = self.params
        names = [d.name for d in p.demands]
        scale = p.time_scale if p.time_scale > 0 else 1.0
        samples = self.sampler.sample_histograms(
            now_s,
            names,
            readings.instances,
            readings.histograms,
            readings.num_queued,
            readings.queued_by_model,
        )
        for name, sample in samples.items():
            if scale != 1.0:  # latencies in the model's seconds, as SLOs are
                sample = dataclasses.replace(
                    sample,
                    ttft_p99_s=None if sample.ttft_p99_s is None else sample.ttft_p99_s / scale,
                    tpot_p99_s=None if sample.tpot_p99_s is None else sample.tpot_p99_s / scale,
                )
            kept = self.samples[name]
            kept.append(sample)
            del kept[:-MAX_SAMPLES_KEPT]
        self.rates.observe(now_s, readings.done_by_model, names, p.time_scale)

    def decide(
        self,
        now_s: float,
        cluster: Cluster,
        running: Sequence[PlannedInstance],
        asleep: Sequence[tuple[PlannedInstance, int]] = (),
    ) -> Decided:
        """The policy's decision on the snapshot of now (after `observe`). A shift is entered
        in the history at once (the policy's cooldown counts from its start). `asleep`: the
        sleeping instances and their levels (a target may wake one)."""
        p = self.params
        self.expected_rates_per_s = self.rates.expected_rates_per_s(
            now_s, self.policy.params.forecast
        )
        snapshot = ShiftSnapshot.of(
            cluster,
            running,
            model_states(
                p.demands,
                self.rates.rates_per_s,
                self.samples,
                p.min_instances_floor,
                self.expected_rates_per_s,
            ),
            self.history,
            self.resources_changed_s,
            asleep,
            p.time_scale,
        )
        decision = self.policy.decide(snapshot, now_s, self.rng)
        if decision.action != "shift" or decision.target is None:
            return Decided(decision, snapshot)
        self.history.append(decision.started(now_s))
        # the shift holds a model the target has none of before its last instance drains
        to_zero = {i.model for i in running} - {i.model for i in decision.target}
        return Decided(decision, snapshot, shift=True, renewal=self.renewal(to_zero))

    def renewal(self, shift_holds: Iterable[str]) -> Renewal | None:
        """What a shift keeps alive while it runs: the last tick's holds and refusals, and
        `shift_holds`, the holds it makes itself."""
        p = self.params
        return self.standby_state.renewal(shift_holds, p.tick_s, p.standby_hold_s)

    # ------------------------------------------------------------------ 4. its end
    def shift_finished(self, outcome: ShiftOutcome, end_s: float, decided: bool = True) -> None:
        """A shift ended. `decided`: one `decide` took (its history record is completed; a
        failure counts against its target); else the first plan. Done: the resource change
        it answered is answered."""
        if decided:
            self.history[-1] = finished_record(self.history[-1], outcome, end_s)
        if outcome.succeeded:
            self.resources_changed_s = None
