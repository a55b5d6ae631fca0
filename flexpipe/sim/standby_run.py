"""Standby sleepers beside the simulator's controller's shifts (policies/shift/
standby_sleepers.py; `shift.standby`, off by default), as the live controller drives them
(control/standby_live.py): standbys started and put to sleep ahead of demand, a pressed
model's sleepers woken (or, time-sharing, swapped in for another model's engine), idle
models' engines put to sleep, all on the virtual clock beside the tick. Kept apart from the
tick (sim/controller.py) because it runs on its own clock and state; the holds and refusals
of models with no instance are the core's (control/core/standby.py), not this.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from flexpipe.cluster import Cluster
from flexpipe.control.core.standby_aside import (
    AsideStep,
    StandbyRates,
    evicts_asleep,
    first_asleep,
    footprint_bytes,
    rates_observed,
    standby_planner,
    standby_view,
    standbys_to_start,
    swap_procedure,
    time_shared_gpus,
)
from flexpipe.model_spec import load_model_spec
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.migration import perf_model_of
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.policies.shift.standby_sleepers import (
    idle_since,
    most_awake,
    pressed,
    sleeps_aside,
    wakes_aside,
)
from flexpipe.policies.shift.time_share import (
    guests,
    swaps_aside,
)
from flexpipe.sim.loop import CONTROL
from flexpipe.sim.shift_record import REASONS, record
from flexpipe.sim.shift_run import ShiftOutcome, ShiftRun

if TYPE_CHECKING:
    from flexpipe.sim.controller import SimController

__all__ = ["StandbyRun"]


class StandbyRun:
    """The standby-sleeper part of one `SimController`, which owns it (`controller.beside`):
    the changes beside its shifts go through the same shift procedure (`ShiftRun`)."""

    def __init__(self, ctl: SimController) -> None:
        self.ctl = ctl
        params = ctl.params
        self.peak_awake: dict[str, int] = {}  # model -> most instances awake at once
        self.rates = StandbyRates()  # the rates standby sets are sized for (`rates_observed`)
        self.idle_since: dict[str, float] = {}  # model -> since when it serves nothing
        self.to_sleep: set[str] = set()  # standbys of the first plan, put to sleep after it
        self.waking = False  # sleepers wake beside the shifts
        self.busy = False  # standbys start (launched, then put to sleep) beside
        self.aside_gpus: set[str] = set()  # GPUs the standbys loading beside take
        self.tick_after = False  # a tick came during a wake beside
        self.main_gpus: set[str] = set()  # what the shift in progress touches
        self.main_keys: set[str] = set()
        self.every_s = params.shift.standby.aside_tick_s or params.tick_s
        self.checked_s = -math.inf  # when standbys were last looked for
        self.guest_keys: set[str] = set()  # standbys placed beside another model's engine
        # standbys planned at the SLO with `standby.slo_gears`
        self.planner = standby_planner(ctl.planner, params.shift.standby)

    def observe(self, now: float, running: list[PlannedInstance], cluster: Cluster) -> Cluster:
        """A tick's readings kept (most awake, peak rates); the cluster the policy decides on."""
        ctl = self.ctl
        self.peak_awake = most_awake(self.peak_awake, running)
        standby = ctl.params.shift.standby
        self.rates = rates_observed(
            self.rates,
            now,
            ctl._done,
            ctl.gateway_pool() if standby.arrival_peaks else (),
            ctl.queued_by_model() if standby.arrival_peaks else {},
            ctl.params.shift.forecast,
            standby,
        )
        return self.view(cluster)

    def asleep_now(self) -> list[Any]:
        """The records of the engines asleep now (not released)."""
        return [
            r
            for r in self.ctl.sleepers.values()
            if r.released_s < 0 and r.sleep is not None and r.sleep.level is not None
        ]

    def first_to_sleep(self) -> set[str]:
        """The first plan's standbys that go to sleep once it is done (`first_asleep`)."""
        ctl = self.ctl
        keys = first_asleep(
            self.to_sleep,
            {k: r.planned for k, r in ctl.running.items()},
            ctl.gateway_pool(),
            ctl.queued_by_model(),
        )
        self.to_sleep = set()
        return keys

    def wake_aside(self, now: float) -> bool:
        """Wake the sleepers of the models with requests waiting beside the shift in
        progress (if any); True when a wake started."""
        ctl = self.ctl
        if self.waking or not ctl.params.shift.standby.wake_aside:
            return False
        wakes = wakes_aside(
            ctl.cluster,
            [r.planned for r in ctl.running.values()],
            [r.planned for r in self.asleep_now()],
            pressed(
                ctl.gateway_pool(),
                ctl.queued_by_model(),
                ctl.params.shift.standby.busy_fraction,
            ),
            self.main_gpus,
            self.main_keys,
            ctl.params.shift.standby.wakes_per_tick,
        )
        if not wakes:
            return self.swap_aside(now)
        running = [r.planned for r in ctl.running.values()]
        self.waking = True

        def woken(end: float) -> None:
            self.waking = False

        self.run_aside(ctl.running, [*running, *wakes], now, "wake-aside", woken)
        return True

    def sleep_idle(self, now: float) -> bool:
        """Put the engines of models idle for `standby.sleep_idle_s` to sleep beside the
        shift in progress (if any); True when that started."""
        ctl = self.ctl
        params = ctl.params.shift.standby
        self.idle_since = idle_since(
            self.idle_since, ctl.gateway_pool(), ctl.queued_by_model(), now
        )
        if self.waking or params.sleep_idle_s <= 0:
            return False
        leaving = sleeps_aside(
            [r.planned for r in ctl.running.values()],
            self.idle_since,
            now,
            params,
            self.main_keys,
        )
        if not leaving:
            return False
        gone = {instance_key(i) for i in leaving}
        target = [r.planned for k, r in ctl.running.items() if k not in gone]
        self.waking = True

        def asleep(end: float) -> None:
            self.waking = False

        self.run_aside(ctl.running, target, now, "sleep-aside", asleep, ctl._sleep_levels(target))
        return True

    def view(self, cluster: Cluster) -> Cluster:
        """The GPUs free to us as the planner sees them beside standby sleepers: the memory
        each sleeper still holds is used, and a standby loading beside the shifts holds its
        GPUs whole."""
        ctl = self.ctl
        return standby_view(
            cluster,
            [(r.planned, r.sleep.gpu_memory_bytes) for r in self.asleep_now()],
            ctl.params.shift.standby.keep_for_wake,
            self.aside_gpus,
            time_shared_gpus(
                [r.planned for r in ctl.running.values()], ctl.params.shift.standby.time_share
            ),
        )

    def standbys(
        self, awake: list[PlannedInstance], now: float, busy: Sequence[PlannedInstance] = ()
    ) -> list[PlannedInstance]:
        """The standby engines to start beside `awake` (and what `busy` takes); none unless
        `shift.standby` is on."""
        ctl = self.ctl
        params = ctl.params.shift.standby
        if not params.enabled:
            return []
        waiting = {m for m, n in ctl.queued_by_model().items() if n > 0}
        # every sleeper, waking ones too: no standby lands on their GPUs
        sleeping = [r.planned for r in ctl.sleepers.values() if r.released_s < 0]
        chosen = standbys_to_start(
            self.view(ctl.cluster),
            ctl.cluster,
            self.aside_gpus,
            ctl.demands,
            [*awake, *busy],
            sleeping,
            self.peak_awake,
            self.rates.peak_rates,
            self.planner,
            now,
            params,
            self.footprint_bytes,
            skip=waiting,
        )
        if params.hosts_take_back:
            self.guest_keys |= guests(chosen, [*awake, *busy, *sleeping])
        return chosen

    def footprint_bytes(self, inst: PlannedInstance, awake: bool) -> float:
        """`footprint_bytes` of `inst` priced by the performance model (asleep: its reserve,
        as the sim engine's `SleepState.gpu_memory_bytes` reads it)."""
        pm = perf_model_of(self.ctl.cluster, inst, spec=load_model_spec(inst.model_id))
        return footprint_bytes(pm, awake)

    def swap_aside(self, now: float) -> bool:
        """Time-sharing (`standby.time_share`): wake a pressed model's sleeper on GPUs
        another model's running instance holds, that instance put to sleep first (the
        level `sleep_levels` gives it; one that cannot sleep stops), then the sleeper woken,
        both through the shift procedure and priced by the performance model; True when a
        swap started."""
        ctl = self.ctl
        params = ctl.params.shift.standby
        if not (params.enabled and params.time_share):
            return False
        swaps = swaps_aside(
            ctl.cluster,
            [r.planned for r in ctl.running.values()],
            [r.planned for r in self.asleep_now()],
            pressed(ctl.gateway_pool(), ctl.queued_by_model(), params.busy_fraction),
            {d.name: d.priority for d in ctl.demands},
            {k: float(len(ctl.world.requests_on(r))) for k, r in ctl.running.items()},
            self.main_gpus,
            self.main_keys,
            params.wakes_per_tick,
            self.guest_keys,
        )
        if not swaps:
            return False
        steps = swap_procedure([r.planned for r in ctl.running.values()], swaps)
        self.waking = True

        def carry_out(step: AsideStep, at: float) -> None:
            # the holders sleep at the level `sleep_levels` gives them (or stop)
            target = list(step.target)
            levels = ctl._sleep_levels(target) if step.trigger == "swap-sleep" else None
            self.run_aside(ctl.running, target, at, step.trigger, advance, levels)

        def advance(end: float) -> None:
            running = [r.planned for r in ctl.running.values()]
            asleep = {instance_key(r.planned) for r in self.asleep_now()}
            try:
                step = steps.send((running, set(ctl.running), asleep))
            except StopIteration:
                self.waking = False
                return
            carry_out(step, end)

        carry_out(next(steps), now)
        return True

    def tick(self, now: float) -> None:
        """Every `standby.aside_tick_s`, beside the shifts: a model with requests waiting
        wakes its sleepers on GPUs the shift in progress (if any) does not touch, at once;
        else, every `tick_s`, models short of standbys get them started (launched, then put
        to sleep)."""
        ctl = self.ctl
        ctl.world.loop.at(now + self.every_s, CONTROL, self.tick)
        if self.wake_aside(now) or self.sleep_idle(now) or self.busy:
            return
        running = [r.planned for r in ctl.running.values()]
        if now < self.checked_s + ctl.params.tick_s:
            return
        self.checked_s = now
        busy = self.main_gpus  # the shift in progress's GPUs: not for a standby now
        standbys = [s for s in self.standbys(running, now) if not set(s.gpu_ids) & busy]
        if standbys:
            # started in a running plan of their own: the policy sees them once asleep
            loading: dict[str, Any] = {}
            self.busy = True
            self.aside_gpus = {g for s in standbys for g in s.gpu_ids}
            self.run_aside(
                loading, standbys, now, "standby", lambda end: self.sleep_loaded(loading, end)
            )

    def sleep_loaded(self, loading: dict[str, Any], now: float) -> None:
        """The standbys `loading` are up: put them to sleep (the level `sleep_levels` gives
        each; one that cannot sleep stops), then lift the holds their plan's end made on the
        models that have instances."""
        ctl = self.ctl

        def asleep(end: float) -> None:
            self.busy = False
            self.aside_gpus = set()
            serving = {r.planned.model for r in ctl.running.values()}
            for model in sorted({r.planned.model for r in loading.values()} | serving):
                if model in serving:
                    ctl.world.hold(model, 0.0, end)

        levels = ctl._sleep_levels([], loading)
        self.run_aside(loading, [], now, "standby", asleep, levels)

    def run_aside(
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
        ctl = self.ctl
        p = ctl.params
        # time-sharing: a standby's start stops no sleeper on its GPUs (it fits beside them
        # asleep, standby_time_shared); it wakes none either
        evicts = evicts_asleep(trigger, running, target, ctl.params.shift.standby.time_share)

        def done(outcome: ShiftOutcome, end: float) -> None:
            ctl.on_shift(record(now, end, trigger, REASONS[trigger], None, outcome))
            then(end)
            if self.tick_after and not self.waking:
                self.tick_after = False
                ctl._schedule_tick(end)

        run = ShiftRun(
            ctl.world,
            running,
            target,
            done,
            drain_deadline_s=p.drain_deadline_s,
            rehearsal_tolerance=p.rehearsal_tolerance,
            rehearse=False,
            all_or_nothing=False,
            sleepers=ctl.sleepers if evicts else {},
            sleep_levels=sleep_levels or {},
        )
        run.start(now)
