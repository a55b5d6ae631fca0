"""Standby sleepers beside the live controller's tick (policies/shift/standby_sleepers.py;
`shift.standby`, off by default), as the simulator's controller drives them: the first plan
with the standby set in place, engines started and put to sleep ahead of demand (where the
engine kind cannot load beside an awake engine, that engine sleeps meanwhile if it is idle and
yields to the standby's model; the tick goes on while the standby loads), woken at once
when their model is pressed (or, time-sharing, swapped in for another model's engine on its
GPU), and the engines of idle models put to sleep. Kept apart from the tick loop
(control/controller.py) because it runs beside it, on its own clock and lock;
control/standby.py is another thing: the gateway's holds and refusals of the models with no
instance.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flexpipe.cluster import Cluster
from flexpipe.control.api.gateway_client import GatewayError
from flexpipe.control.core.samples import gateway_totals
from flexpipe.control.core.shift_outcome import ShiftOutcome, said
from flexpipe.control.core.standby_aside import (
    ASIDE_REASONS,
    StandbyRates,
    asleep_gpu_bytes,
    evicts_asleep,
    first_asleep,
    first_plan,
    footprint_bytes,
    holders_to_yield,
    holds_to_lift,
    launched_first,
    rates_observed,
    standby_planner,
    standby_view,
    standbys_to_start,
    swap_procedure,
    time_shared_gpus,
)
from flexpipe.control.core.tick import Readings
from flexpipe.control.executor import LiveInstance
from flexpipe.engine_kinds import engine_kind
from flexpipe.model_spec import load_model_spec
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.candidates import Planner
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

if TYPE_CHECKING:
    from flexpipe.control.controller import Controller

__all__ = ["StandbySleepers"]

log = logging.getLogger("flexpipe.control")


class StandbySleepers:
    """The standby-sleeper shell of one `Controller`, which owns it (`controller.beside`):
    the wakes and sleeps beside the shifts go through the controller's executor and journal."""

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.peak_awake: dict[str, int] = {}  # model -> most instances awake at once
        self.rates = StandbyRates()  # the rates standby sets are sized for (`rates_observed`)
        self.sizing: Planner | None = None  # what plans standbys (`planner`), built at first use
        self.idle_since: dict[str, float] = {}  # model -> since when it serves nothing
        self.aside = asyncio.Lock()  # one wake or sleep beside the shifts at a time
        self.aside_gpus: set[str] = set()  # GPUs the standbys loading beside take
        self.main_gpus: set[str] = set()  # what the shift in progress touches
        self.main_keys: set[str] = set()
        # what a standby loading while its holders sleep (`yield_for`) uses: the holders'
        # and the standbys' keys and GPUs, kept from every other wake, sleep and swap
        # until the holders are back (the load runs outside the `aside` lock)
        self.yield_gpus: set[str] = set()
        self.yield_keys: set[str] = set()
        self.guest_keys: set[str] = set()  # standbys placed beside another model's engine
        self.checked_s = -math.inf  # when standbys were last looked for
        self.to_sleep: set[str] = set()  # standbys of the first plan, put to sleep after it

    def first_plan(self, planned: Sequence[PlannedInstance]) -> list[PlannedInstance]:
        """The first plan with the standby set in place (`first_plan`: each model's standbys
        instead of the planner's instances of it), as the simulator starts; nothing runs
        or sleeps yet. Its standbys are put to sleep once it serves (`sleep_first`). Where
        the engine kind cannot load beside another engine, those sharing a GPU with another
        instance of the plan are started later, the holder asleep meanwhile
        (`launched_first`, `start_standbys`)."""
        loads_beside = engine_kind(self.ctl.cfg.engine_kind).loads_beside_awake
        standbys = launched_first(self.standbys({}), planned, loads_beside)
        self.to_sleep = {instance_key(s) for s in standbys}
        return first_plan(standbys, planned)

    async def sleep_first(self) -> None:
        """The first plan's standbys of models that nothing waits for and nothing is served
        on (`first_asleep`) go to sleep, a change beside logged as `standby`; the others
        serve first (the idle sleep or the down trigger puts them to sleep later)."""
        ctl = self.ctl
        keys, self.to_sleep = self.to_sleep, set()
        if not keys:
            return
        try:
            instances = await ctl.gateway.instances()
            queued = gateway_totals(await ctl.gateway.metrics()).queued_by_model or {}
        except GatewayError as exc:  # (left awake: the idle sleep puts them to sleep)
            log.warning("standby: the first plan's sleep: %s", exc)
            return
        running = {k: i.planned for k, i in ctl.running.items()}
        asleep = first_asleep(keys, running, instances, queued)
        if asleep:
            async with self.aside:
                target = [p for k, p in running.items() if k not in asleep]
                await self.run_aside(ctl.running, target, "standby")

    def observe(self, now_s: float, readings: Readings) -> Cluster:
        """A tick's readings kept (most awake; the rates standby sets are sized for,
        `rates_observed`: with `arrival_peaks` the gateway's in flight and waiting count, with
        `outlook_horizon_s` the outlook's, as the simulator's); the cluster the policy
        decides on."""
        ctl = self.ctl
        running = [i.planned for i in ctl.running.values()]
        self.peak_awake = most_awake(self.peak_awake, running)
        # per modelled second, as the core's rates (`time_scale`: wall s per modelled s)
        scale = ctl.cfg.time_scale if ctl.cfg.time_scale > 0 else 1.0
        self.rates = rates_observed(
            self.rates,
            now_s,
            readings.done_by_model,
            readings.instances,
            readings.queued_by_model or {},
            ctl.cfg.shift.forecast,
            ctl.cfg.shift.standby,
            scale,
        )
        return self.view()

    def planner(self) -> Planner:
        """What plans the standbys (`standby_planner`: the controller's, at the SLO with
        `slo_gears`), as the simulator's; built once, so that its memo is kept."""
        if self.sizing is None:
            self.sizing = standby_planner(self.ctl.planner, self.ctl.cfg.shift.standby)
        return self.sizing

    def view(self) -> Cluster:
        """The GPUs free to us as the planner sees them beside standby sleepers: the memory
        each sleeper still holds is used, a standby loading beside holds its GPUs whole;
        time-sharing, a sleeper beside a running engine fits in what that engine leaves
        (control/core/standby_aside.py, the simulator's view too)."""
        ctl = self.ctl
        cluster = ctl.cluster
        ids = set(cluster.gpu_ids)
        held = []
        for inst in ctl.executor.sleepers.values():
            p = inst.planned
            if set(p.gpu_ids) <= ids:  # (one on a GPU that is gone stops at the next tick)
                pm = perf_model_of(cluster, p, spec=load_model_spec(p.model_id))
                held.append((p, asleep_gpu_bytes(pm)))
        params = ctl.cfg.shift.standby
        running = [i.planned for i in ctl.running.values()]
        beside = time_shared_gpus(running, params.time_share)
        return standby_view(cluster, held, params.keep_for_wake, self.aside_gpus, beside)

    def footprint_bytes(self, inst: PlannedInstance, awake: bool) -> float:
        """`footprint_bytes` of `inst` priced by the performance model (the simulator's
        too): what time-sharing fits a sleeper beside a running engine with."""
        pm = perf_model_of(self.ctl.cluster, inst, spec=load_model_spec(inst.model_id))
        return footprint_bytes(pm, awake)

    async def loop(self) -> None:
        """Every `standby.aside_tick_s` (0: `tick_s`), beside the shifts: a pressed model's
        sleepers wake at once; else a model idle for `sleep_idle_s` sleeps; else, every
        `tick_s`, models short of standbys get them started (launched, then put to sleep)
        while the next looks go on."""
        every_s = self.ctl.cfg.shift.standby.aside_tick_s or self.ctl.cfg.tick_s
        starting: asyncio.Task[None] | None = None
        try:
            while True:
                await asyncio.sleep(every_s)
                if starting is not None and starting.done() and not starting.cancelled():
                    if starting.exception() is not None:  # (said once; the next look retries)
                        log.warning("standby start: %r", starting.exception())
                    starting = None
                try:
                    starting = await self.look(starting)
                except GatewayError as exc:
                    log.warning("standby sleepers: %s", exc)
                except Exception:  # a bug here must not end the looks: the next one retries
                    log.exception("standby sleepers")
        finally:
            if starting is not None:
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)

    async def look(self, starting: asyncio.Task[None] | None) -> asyncio.Task[None] | None:
        """One look beside the shifts; returns the standby start under way, if any."""
        ctl = self.ctl
        instances = await ctl.gateway.instances()
        queued = gateway_totals(await ctl.gateway.metrics()).queued_by_model or {}
        # (a wake or sleep beside under way: this look's readings are stale, the next decides)
        if self.aside.locked():
            return starting
        if await self.wake_aside(instances, queued) or await self.sleep_idle(instances, queued):
            return starting
        if starting is not None and not starting.done():
            return starting
        if ctl.wall() < self.checked_s + ctl.cfg.tick_s:
            return starting
        self.checked_s = ctl.wall()
        standbys = self.standbys(queued)
        if not standbys:
            return None
        return asyncio.create_task(self.start_standbys(standbys, instances, queued))

    def busy(self) -> tuple[set[str], set[str]]:
        """(GPUs, keys) no wake, sleep or swap beside may touch now: the shift in progress's
        and a standby load's with its holders asleep (`yield_for`)."""
        return self.main_gpus | self.yield_gpus, self.main_keys | self.yield_keys

    def standbys(self, queued: dict[str, int]) -> list[PlannedInstance]:
        """The standby engines to start now (`standbys_to_start`: on free GPUs, then, with
        `time_share`, beside other models' running engines), none on the GPUs the shift in
        progress touches nor for a model with requests waiting (its shift comes first)."""
        ctl = self.ctl
        waiting = {m for m, n in queued.items() if n > 0}
        running = [i.planned for i in ctl.running.values()]
        asleep = [i.planned for i in ctl.executor.sleepers.values()]
        wanted = standbys_to_start(
            self.view(),
            ctl.cluster,
            self.aside_gpus,
            ctl.cfg.demands,
            running,
            asleep,
            self.peak_awake,
            self.rates.peak_rates,
            self.planner(),
            ctl.clock(),
            ctl.cfg.shift.standby,
            self.footprint_bytes,
            skip=waiting,
        )
        busy_gpus, _ = self.busy()
        chosen = [s for s in wanted if not set(s.gpu_ids) & busy_gpus]
        if ctl.cfg.shift.standby.hosts_take_back:  # a guest gives its host's GPU back
            before = [*running, *asleep]
            kept = {instance_key(s) for s in chosen}
            self.guest_keys |= guests(wanted, before) & kept
        return chosen

    async def start_standbys(
        self,
        standbys: list[PlannedInstance],
        instances: Sequence[Mapping[str, Any]],
        queued: Mapping[str, int],
    ) -> None:
        """Launched in a running plan of their own (the policy sees them once asleep; their
        GPUs are held whole in its view meanwhile), then put to sleep at the level the sleep
        mode gives each (one that cannot sleep stops); the holds that put on models that
        serve are lifted (`holds_to_lift`). Where the engine kind cannot load beside an
        awake engine, the idle running instances on their GPUs that may yield
        (`holders_to_yield`, from the gateway's pool records `instances` and its wait queue
        `queued`, as this look read them) sleep first and wake once the standbys sleep
        (`yield_for`); a standby with a holder that may not yield waits for a later look."""
        ctl = self.ctl
        p = ctl.cfg.shift.standby
        standbys, holders = holders_to_yield(
            standbys,
            [i.planned for i in ctl.running.values()],
            engine_kind(ctl.cfg.engine_kind).loads_beside_awake,
            {d.name: d.priority for d in ctl.cfg.demands},
            pressed(instances, queued, p.busy_fraction),
            self.in_flight_by_key(instances),
            queued,
        )
        if not standbys:
            return
        self.aside_gpus = {g for s in standbys for g in s.gpu_ids}
        try:
            if holders:
                loaded = await self.yield_for(standbys, holders)
            else:
                await self.load_asleep(standbys)
                loaded = True
        finally:
            self.aside_gpus = set()
        if not loaded:  # (nothing changed: no hold of ours to lift)
            return
        if not ctl._lock.locked():  # (a shift in progress sweeps when it ends)
            ctl.takeover.sweep_spawned()
        serving = {i.planned.model for i in ctl.running.values()}
        await ctl._hold_all(holds_to_lift([*standbys, *holders], serving), 0)

    async def load_asleep(self, standbys: list[PlannedInstance]) -> None:
        """The standbys launched, then put to sleep (two changes beside, `standby`)."""
        loading: dict[str, LiveInstance] = {}
        await self.run_aside(loading, standbys, "standby")
        if loading:
            await self.run_aside(loading, [], "standby")

    async def yield_for(
        self, standbys: list[PlannedInstance], holders: list[PlannedInstance]
    ) -> bool:
        """The order a real vLLM needs to load beside an awake engine: `standby-yield`, the
        holders drain and sleep as a swap's holder does (`sleep`); the standbys load and
        sleep (`load_asleep`); `standby-return`, the holders wake (`wake`), also after a
        failed load. Not while the shift in progress or another such load uses a holder or
        its GPUs (`busy`): the next look tries again. The sleep and the wake hold the
        `aside` lock, the load (a cold start: minutes) does not, so that the tick's wakes
        go on meanwhile: the holders' and the standbys' keys and GPUs are marked busy
        (`yield_keys`, `yield_gpus`) until the holders are back. A cancelled load (the
        controller stopping) wakes nothing. False when it did not begin."""
        keys = {instance_key(i) for i in [*holders, *standbys]}
        gpu_ids = {g for i in [*holders, *standbys] for g in i.gpu_ids}
        async with self.aside:
            busy_gpus, busy_keys = self.busy()
            if keys & busy_keys or gpu_ids & busy_gpus:
                return False
            self.yield_keys |= keys
            self.yield_gpus |= gpu_ids
            try:
                await self.sleep(holders, "standby-yield")
            except BaseException:
                self.yield_keys -= keys
                self.yield_gpus -= gpu_ids
                raise
        try:
            await self.load_asleep(standbys)
        finally:
            try:
                back = [h for h in holders if instance_key(h) not in self.ctl.running]
                if back and not _cancelling():
                    async with self.aside:
                        await self.wake(back, "standby-return")
            finally:
                self.yield_keys -= keys
                self.yield_gpus -= gpu_ids
        return True

    async def sleep(self, leaving: Sequence[PlannedInstance], trigger: str) -> None:
        """`leaving` (running) out of the gateway's pool, drained and put to sleep at the
        level the sleep mode gives it (or stopped), the rest kept: one change beside."""
        ctl = self.ctl
        gone = {instance_key(i) for i in leaving}
        target = [i.planned for k, i in ctl.running.items() if k not in gone]
        await self.run_aside(ctl.running, target, trigger)

    async def wake(self, instances: Sequence[PlannedInstance], trigger: str) -> None:
        """`instances` woken (a failed wake cold-starts, as any) and added to the gateway's
        pool beside what runs: one change beside."""
        ctl = self.ctl
        running = [i.planned for i in ctl.running.values()]
        await self.run_aside(ctl.running, [*running, *instances], trigger)

    async def wake_aside(self, instances: Sequence[Mapping[str, Any]], queued: Any) -> bool:
        """Wake the sleepers of the models that need more engines (`pressed`) beside the
        shift in progress (if any), on GPUs it does not touch; else, time-sharing, swap one
        in (`swap_aside`); True when one woke. A wake or sleep beside under way is waited
        for first."""
        ctl = self.ctl
        p = ctl.cfg.shift.standby
        if not p.wake_aside:
            return False
        async with self.aside:
            running = [i.planned for i in ctl.running.values()]
            want = pressed(instances, queued or {}, p.busy_fraction)
            busy_gpus, busy_keys = self.busy()
            wakes = wakes_aside(
                ctl.cluster,
                running,
                [i.planned for i in ctl.executor.sleepers.values()],
                want,
                busy_gpus,
                busy_keys,
                p.wakes_per_tick,
            )
            if not wakes:
                return await self.swap_aside(instances, want)
            await self.wake(wakes, "wake-aside")
            return True

    async def swap_aside(
        self, instances: Sequence[Mapping[str, Any]], want: Mapping[str, int]
    ) -> bool:
        """Time-sharing (`standby.time_share`; under the `aside` lock): wake a pressed
        model's sleeper on GPUs another model's running engine holds (`swaps_aside`: that
        engine `yields_to` it, and nothing of the shift in progress touches either). Step
        one, `swap-sleep`: the holder drains (its requests in flight finish, or move as any
        leaving instance's) and sleeps at the level the sleep mode gives it (or stops),
        out of the gateway's pool first; step two, `swap-wake`: the sleeper wakes and joins
        the pool (a failed wake cold-starts it, as any wake). If it still does not run, the
        holders wake again (`swap-back`). True when a swap was carried out."""
        ctl = self.ctl
        p = ctl.cfg.shift.standby
        if not (p.enabled and p.time_share):
            return False
        running = [i.planned for i in ctl.running.values()]
        busy_gpus, busy_keys = self.busy()
        swaps = swaps_aside(
            ctl.cluster,
            running,
            [i.planned for i in ctl.executor.sleepers.values()],
            want,
            {d.name: d.priority for d in ctl.cfg.demands},
            self.in_flight_by_key(instances),
            busy_gpus,
            busy_keys,
            p.wakes_per_tick,
            self.guest_keys,
        )
        if not swaps:
            return False
        steps = swap_procedure(running, swaps)
        step = next(steps)
        while True:
            await self.run_aside(ctl.running, list(step.target), step.trigger)
            now_running = [i.planned for i in ctl.running.values()]
            try:
                step = steps.send((now_running, set(ctl.running), set(ctl.executor.sleepers)))
            except StopIteration:
                return True

    def in_flight_by_key(self, instances: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Each running instance's requests in flight (by `instance_key`), from the gateway's
        pool records (`instances`), matched by URL."""
        key_of = {i.url: k for k, i in self.ctl.running.items()}
        return {
            key_of[str(r.get("url"))]: float(r.get("num_in_flight") or 0)
            for r in instances
            if str(r.get("url")) in key_of
        }

    async def sleep_idle(self, instances: Sequence[Mapping[str, Any]], queued: Any) -> bool:
        """Put the engines of the models idle for `standby.sleep_idle_s` to sleep beside the
        shift in progress (if any); True when that happened."""
        ctl = self.ctl
        p = ctl.cfg.shift.standby
        now_s = ctl.clock()
        self.idle_since = idle_since(self.idle_since, instances, queued or {}, now_s)
        if p.sleep_idle_s <= 0:
            return False
        async with self.aside:
            running = {k: i.planned for k, i in ctl.running.items()}
            leaving = sleeps_aside(
                list(running.values()), self.idle_since, now_s, p, self.busy()[1]
            )
            if not leaving:
                return False
            await self.sleep(leaving, "sleep-aside")
            return True

    async def run_aside(
        self, running: dict[str, LiveInstance], target: list[PlannedInstance], trigger: str
    ) -> ShiftOutcome:
        """A change beside the policy's shifts through the same shift procedure, from
        `running` (changed in place), logged in the shift log but not in the policy's
        history."""
        ctl = self.ctl
        current = [i.planned for i in running.values()]
        entry = ctl.journal.aside(trigger, ASIDE_REASONS[trigger], current, target)
        evicts = evicts_asleep(trigger, running, target, ctl.cfg.shift.standby.time_share)
        outcome = await ctl.executor.shift(
            ctl.cluster,
            running,
            target,
            rehearse=False,
            all_or_nothing=False,
            sleepers=None if evicts else {},
        )
        ctl.journal.finish(entry, outcome)
        ctl.say(
            f"controller: {trigger} {said(outcome)} {outcome.reason} phases "
            + ", ".join(f"{k} {v:.1f}s" for k, v in outcome.phases_s.items())
        )
        return outcome


def _cancelling() -> bool:
    """Whether the task running this is being cancelled (the controller stopping)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
