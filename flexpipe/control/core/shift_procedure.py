"""The shift, make-before-break, written once for both clocks (docs/controller.md):

1. warm: the target's new instances start; the phase lasts until they are loaded;
2. rehearse: one probe through each new engine against the gear table's prediction; a miss
   beyond the tolerance rolls the shift back (new instances stopped; the caller logs and
   blacklists the target);
3. switch: the new instances serve;
4. drain the instances that leave: no new requests; what would still run at the drain
   deadline moves at once, in waves, while the deadline lasts (the other instances still
   have the free slots this traffic is about to take); what still runs at the deadline
   moves then, each to where it pauses least (`plan_moves`: its KV over the link, or
   recomputed), and the method is recorded;
5. release: the old engines stop, their GPUs are free; or sleep: an instance given a sleep
   level (`sleep_levels`: the shell decides which may sleep, and how deep) whose GPUs the
   target does not need is put to sleep instead (vLLM's sleep mode), kept in `sleepers`.

A target instance with the model, gear and GPUs of a sleeping one wakes it instead of a cold
start (no rehearsal: it served on that gear before); a wake that fails releases it and
cold-starts the instance. A sleeper on GPUs another target instance needs is released first
(docs/controller.md, "Sleep instead of stop").

The order comes from `plan_shift`: new instances on free GPUs first, then rolling in-place
replacements (a new instance that needs the GPUs of a leaving one starts after that one is
released, its model's requests held meanwhile), then the rest retire. A model the target has
no instance of scales to zero: it is held for `standby_hold_s` before its last instance
drains, so that its next requests queue for the instance its demand starts. A failed
in-place successor rolls back. Every phase is timed.

`ShiftProcedure.run` is a generator: it yields commands (`shift_commands`) and is sent each
one's `Reply`; it reads no clock and does no I/O. The live executor (`control/executor.py`)
and the simulator (`sim/shift_run.py`) drive it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from flexpipe.control.core.instance_names import unique_name
from flexpipe.control.core.shift_commands import (
    AwaitReady,
    Command,
    Drain,
    Drained,
    Failed,
    Hold,
    Join,
    Launch,
    Move,
    Moved,
    NextReady,
    Rehearse,
    Release,
    Reply,
    SetState,
    Sleep,
    StillAlive,
    StopRouting,
    Wait,
    Wake,
    Wave,
)
from flexpipe.control.core.shift_moves import plan_waves
from flexpipe.control.core.shift_outcome import ShiftOutcome
from flexpipe.control.core.standby_aside import launch_waves
from flexpipe.model_spec import ModelSpec
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.in_place import COLD, ROLLING, SIDE_BY_SIDE, WAKE, InPlaceChoice
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.policies.shift.step_order import plan_shift

__all__ = [
    "DEFAULT_COLD_START_S",
    "IN_PLACE_MARGIN_S",
    "MOVED_LEAVE_S",
    "InPlaceChooser",
    "ShiftParams",
    "ShiftProcedure",
    "in_place_hold_s",
]

T = TypeVar("T")
Steps = Generator[Command, Reply, T]
# (leaving instances, their successors on the same GPUs) -> how the in-place step goes
InPlaceChooser = Callable[[Sequence[PlannedInstance], Sequence[PlannedInstance]], InPlaceChoice]

DEFAULT_COLD_START_S = 30.0  # an in-place step whose leaving instances' load time is unknown
IN_PLACE_MARGIN_S = 30.0  # on top of the in-place hold's cold starts and drain
MOVED_LEAVE_S = 10.0  # how long an instance whose requests all moved may take to be empty


@dataclass(frozen=True, slots=True)
class ShiftParams:
    """`time_scale`: driver seconds per modelled second (the live sim engines' time scale;
    1 in the simulator): the drain deadline is in driver seconds, moves are planned in
    modelled ones. `warm_moves`: the gateway pre-copies recompute moves (priced so).
    `kv_moves`: the engines can hand a request's KV cache over (the engine kind's declaration,
    flexpipe/engine_kinds.py); without it every move recomputes."""

    drain_deadline_s: float = 30.0
    standby_hold_s: float = 600.0
    time_scale: float = 1.0
    warm_moves: bool = True
    kv_moves: bool = True
    rehearse: bool = True
    all_or_nothing: bool = True
    # driver seconds an in-place step's leaving instances drain for when their successors
    # wait pre-started asleep (`shift.pricing.in_place_drain_s`; in_place.py)
    in_place_drain_s: float = 2.0
    # the engine kind starts beside another engine loading on its GPU (engine_kinds.py);
    # else engines sharing a GPU launch in waves (`launch_waves`)
    loads_beside_awake: bool = True


def in_place_hold_s(cold_start_s: float, drain_deadline_s: float) -> float:
    """How long the gateway queues a model's requests while an in-place step takes its
    capacity away and the replacement starts on the same GPUs: twice the cold start the
    leaving instances took, plus the drain, plus a margin; released after the step."""
    return 2 * cold_start_s + drain_deadline_s + IN_PLACE_MARGIN_S


class ShiftProcedure:
    """One shift from `running` (key -> instance, updated in place) to `target`. `names`:
    the names the deployment's instances had so far; given, each instance launched gets a
    name none had (and it is added); None: the planner's names are kept (the simulator's
    world names its engines itself). `specs`: model id -> its spec, for every model of
    `running` and `target` (the performance model prices moves with it); None: the shipped
    catalog's (`perf_model_of`). `sleepers`: key -> sleeping instance (updated in place);
    `sleep_levels`: key -> the level a leaving instance sleeps at instead of stopping (absent
    or 0: it stops). `in_place`: how each in-place step re-gears (`choose_in_place` bound to
    the cluster by the shell: `make_before_break`); None: rolling."""

    def __init__(
        self,
        running: dict[str, Any],
        target: Sequence[PlannedInstance],
        params: ShiftParams,
        names: set[str] | None = None,
        specs: Mapping[str, ModelSpec] | None = None,
        sleepers: dict[str, Any] | None = None,
        sleep_levels: Mapping[str, int] | None = None,
        in_place: InPlaceChooser | None = None,
    ) -> None:
        self.in_place = in_place
        self.sleepers = sleepers if sleepers is not None else {}
        self.sleep_levels = sleep_levels or {}
        self.specs = specs or {}
        self.running = running
        self.target = tuple(target)
        self.params = params
        self.names = names
        self.out = ShiftOutcome(succeeded=True)
        self.now_s = 0.0

    def _do(self, command: Command) -> Steps[Any]:
        reply = yield command
        self.now_s = reply.now_s
        return reply.value

    # ------------------------------------------------------------------ the shift
    def run(self, now_s: float) -> Steps[ShiftOutcome]:
        self.now_s = now_s
        out = self.out
        p = self.params
        # a model the target has no instance of scales to zero
        plan = plan_shift(
            [i.planned for i in self.running.values()], self.target, scale_to_zero=True
        )
        if plan.refusal:  # before anything changed: refused, not failed
            return ShiftOutcome(False, plan.refusal, refused=True)
        kept_models = {t.model for t in self.target}
        for model in sorted({i.model for i in plan.leaving} - kept_models):
            # to zero: its requests from now on wait for a cold start, not a 404
            why = yield from self._do(Hold(model, p.standby_hold_s))
            if why:
                return ShiftOutcome(False, f"{model}: cannot hold it at zero: {why}", refused=True)
        by_key = dict(self.running)
        yield from self._evict_sleepers()
        started = yield from self._bring_up(plan.now_adds, "", p.rehearse, p.all_or_nothing, out)
        if not out.succeeded:
            return out
        for n, (blockers, adds) in enumerate(plan.steps):
            suffix = "_in_place" if len(plan.steps) == 1 else f"_in_place{n + 1}"
            leaving = [by_key[instance_key(b)] for b in blockers]
            choice = self.in_place(blockers, adds) if self.in_place is not None else None
            if choice is not None and choice.how == SIDE_BY_SIDE:  # nothing stops first
                yield from self._bring_up(adds, suffix, p.rehearse, p.all_or_nothing, out)
                if not out.succeeded:
                    yield from self._roll_back([], started)
                    return out
                out.in_place.append(f"{SIDE_BY_SIDE}, capacity away 0.000 s: {choice.why}")
                yield from self._retire(leaving, suffix)
                continue
            drain_s = None
            if choice is not None and choice.how == WAKE:
                yield from self._pre_start(adds, choice.level, suffix)
                if not out.succeeded:  # nothing stopped yet: the old plan serves on
                    yield from self._roll_back([], started)
                    return out
                drain_s = p.in_place_drain_s
            held = yield from self._hold(adds, leaving)
            try:
                t0 = self.now_s
                yield from self._retire(leaving, suffix, drain_deadline_s=drain_s)
                yield from self._bring_up(adds, suffix, p.rehearse, p.all_or_nothing, out)
                how = ROLLING if choice is None else choice.how
                if how == WAKE and not {instance_key(a) for a in adds} & set(out.woken):
                    how = COLD  # no successor slept or woke: it cold-started
                why = f": {choice.why}" if choice is not None and choice.why else ""
                out.in_place.append(f"{how}, capacity away {self.now_s - t0:.3f} s{why}")
                if not out.succeeded:
                    yield from self._roll_back(leaving, started)
            except GeneratorExit:  # abandoned (a simulation ended mid-shift): nothing to do
                raise
            except BaseException:  # the driver was cancelled and threw it in: unhold, go on
                yield from self._unhold(held)
                raise
            yield from self._unhold(held)
            if not out.succeeded:
                return out
        rest = [by_key[instance_key(b)] for b in plan.rest]
        yield from self._retire(rest, "_rest" if plan.steps else "", may_sleep=True)
        return out

    def _evict_sleepers(self) -> Steps[None]:
        """Sleepers the target does not wake but whose GPUs its new instances need stop first
        (a sleeping engine keeps its process and some memory on them). The GPUs of an instance
        the target keeps running are not newly needed: a sleeper beside it (time-sharing,
        docs/shift-policy.md) sleeps on."""
        wanted = {instance_key(t) for t in self.target}
        needed = {
            g
            for t in self.target
            if instance_key(t) not in self.sleepers and instance_key(t) not in self.running
            for g in t.gpu_ids
        }
        evict = [
            i
            for k, i in self.sleepers.items()
            if k not in wanted and set(i.planned.gpu_ids) & needed
        ]
        if not evict:
            return
        t0 = self.now_s
        yield from self._do(Release(tuple(evict)))
        for inst in evict:
            self.sleepers.pop(inst.key, None)
            self.out.stopped.append(inst.key)
        self.out.phases_s["release_asleep"] = self.now_s - t0

    def _hold(self, adds: Sequence[PlannedInstance], leaving: Sequence[Any]) -> Steps[list[str]]:
        """The models of an in-place step's successors, held for `in_place_hold_s`; returns
        those the gateway holds."""
        cold_s = max((i.cold_start_s for i in leaving), default=DEFAULT_COLD_START_S)
        hold_s = in_place_hold_s(cold_s, self.params.drain_deadline_s)
        held = []
        for model in sorted({a.model for a in adds}):
            why = yield from self._do(Hold(model, hold_s))
            if not why:
                held.append(model)
        return held

    def _unhold(self, models: Sequence[str]) -> Steps[None]:
        for model in models:
            yield from self._do(Hold(model, 0.0))

    def _roll_back(self, released: Sequence[Any], started: Sequence[Any]) -> Steps[None]:
        """An in-place successor failed (did not start, or missed its rehearsal) after the
        instances in its way were released: those start again (no rehearsal: they served
        until now; each serves as soon as it is loaded) and what the shift started on free
        GPUs leaves, so that the running plan is the old one again (the successors of earlier
        in-place steps stay: the instances they replaced are gone)."""
        out = self.out
        again = ShiftOutcome(succeeded=True)
        back = yield from self._bring_up(
            [i.planned for i in released], "_rollback", False, False, again
        )
        out.phases_s.update(again.phases_s)
        if len(back) < len(released):
            out.reason += f"; rollback: {again.reason or 'not every instance came back'}"
        yield from self._retire(list(started), "_rollback")
        gone = {i.key for i in started}
        out.started = [k for k in out.started if k not in gone]

    # ------------------------------------------------------------------ bringing up
    def _named(self, planned: PlannedInstance) -> PlannedInstance:
        if self.names is None:
            return planned
        name = unique_name(planned.name, self.names)
        self.names.add(name)
        return planned if name == planned.name else replace(planned, name=name)

    def _bring_up(
        self,
        adds: Sequence[PlannedInstance],
        suffix: str,
        rehearse: bool,
        all_or_nothing: bool,
        out: ShiftOutcome,
    ) -> Steps[list[Any]]:
        """Start, rehearse and activate `adds`; returns those that serve. All or nothing: a
        failure stops every one of them and fails the shift; else the shift fails only when
        none serves."""
        if not adds:
            return []
        woken, adds = yield from self._wake(adds, suffix, out)
        if not adds:
            return woken
        started = yield from self._launch(adds, suffix, rehearse, all_or_nothing, out)
        return [*woken, *started]

    def _wake(
        self, adds: Sequence[PlannedInstance], suffix: str, out: ShiftOutcome
    ) -> Steps[tuple[list[Any], list[PlannedInstance]]]:
        """Wake the sleepers `adds` want; returns (those that serve, the adds still to
        launch: those with no sleeper, and those whose sleeper did not wake)."""
        sleeping = [
            self.sleepers[instance_key(a)] for a in adds if instance_key(a) in self.sleepers
        ]
        if not sleeping:
            return [], list(adds)
        t0 = self.now_s
        results = yield from self._do(Wake(tuple(sleeping)))
        woken = []
        dead = []
        for inst, result in zip(sleeping, results, strict=True):
            self.sleepers.pop(inst.key, None)
            if isinstance(result, Failed):
                dead.append(inst)
                continue
            yield from self._activate(result, out)
            out.woken.append(result.key)
            woken.append(result)
        if dead:  # its engine died or its GPUs were taken: stopped, cold-started instead
            yield from self._do(Release(tuple(dead)))
            out.stopped.extend(i.key for i in dead)
        out.phases_s["wake" + suffix] = self.now_s - t0
        woke = {i.key for i in woken}
        return woken, [a for a in adds if instance_key(a) not in woke]

    def _launch(
        self,
        adds: Sequence[PlannedInstance],
        suffix: str,
        rehearse: bool,
        all_or_nothing: bool,
        out: ShiftOutcome,
        sleep_level: int = 0,
    ) -> Steps[list[Any]]:
        """Start, rehearse and activate `adds`; with a `sleep_level`, put them to sleep
        instead of activating them (`_pre_start`). Returns those that serve."""
        planned = [self._named(a) for a in adds]
        t0 = self.now_s
        tokens = yield from self._start(planned)
        failures = [
            f"instance {a.name} did not start: {t.why}"
            for a, t in zip(planned, tokens, strict=True)
            if isinstance(t, Failed)
        ]
        launched = [t for t in tokens if not isinstance(t, Failed)]
        if failures and not (yield from self._judge(out, failures, launched, all_or_nothing)):
            return []
        if not rehearse and not all_or_nothing:  # the first plan, a rollback
            return (yield from self._serve_each_when_ready(launched, t0, suffix, failures, out))
        ready = yield from self._do(AwaitReady(tuple(launched)))
        out.phases_s["warm" + suffix] = self.now_s - t0
        started = yield from self._keep(ready, failures, out, all_or_nothing)
        if not started:
            return []
        joined = yield from self._do(Join(tuple(started)))
        out.phases_s["warm" + suffix] = self.now_s - t0
        refused = [Failed(why) if why else i for i, why in zip(started, joined, strict=True)]
        started = yield from self._keep(refused, failures, out, all_or_nothing)
        if not started:
            return []
        if rehearse:
            t1 = self.now_s
            yield from self._do(SetState(tuple(started), "rehearsing"))
            checks = yield from self._do(Rehearse(tuple(started)))
            out.rehearsal.extend(checks)
            out.phases_s["rehearse" + suffix] = self.now_s - t1
            missed = [c for c in checks if not c["passed"]]
            if missed:
                yield from self._do(Release(tuple(started)))
                out.succeeded = False
                out.reason = "rehearsal missed: " + "; ".join(c["why"] for c in missed)
                return []
            alive = yield from self._do(StillAlive(tuple(started)))  # (it may die rehearsing)
            started = yield from self._keep(alive, failures, out, all_or_nothing)
            if not started:
                return []
        if sleep_level:
            yield from self._fall_asleep(started, sleep_level, suffix)
            return []
        t2 = self.now_s
        for inst in started:
            yield from self._activate(inst, out)
        out.phases_s["switch" + suffix] = self.now_s - t2
        return started

    def _start(self, planned: Sequence[PlannedInstance]) -> Steps[list[Any]]:
        """Launch `planned` (one token per instance, as `Launch` replies): at once, or in
        waves (`launch_waves`: where the engine kind cannot load beside another engine,
        those sharing a GPU in memory), each once the wave before has loaded or failed."""
        waves = launch_waves(planned, self.params.loads_beside_awake)
        if len(waves) == 1:
            together: list[Any] = yield from self._do(Launch(tuple(planned)))
            return together
        left = list(range(len(planned)))  # (by position: two planned may be equal)
        tokens: list[Any] = [None] * len(planned)
        for n, wave in enumerate(waves):
            at = [left.pop(next(j for j, i in enumerate(left) if planned[i] is w)) for w in wave]
            launched = yield from self._do(Launch(tuple(wave)))
            for i, token in zip(at, launched, strict=True):
                tokens[i] = token
            alive = tuple(t for t in launched if not isinstance(t, Failed))
            if n + 1 < len(waves) and alive:
                yield from self._do(AwaitReady(alive))
        return tokens

    def _keep(
        self, results: Sequence[Any], failures: list[str], out: ShiftOutcome, all_or_nothing: bool
    ) -> Steps[list[Any]]:
        """The instances of `results` that are not `Failed`; [] when the failures fail the
        bring-up (then the others are released)."""
        kept = [r for r in results if not isinstance(r, Failed)]
        new = [r.why for r in results if isinstance(r, Failed)]
        if not new:
            return kept
        failures.extend(new)
        ok = yield from self._judge(out, failures, kept, all_or_nothing)
        return kept if ok else []

    def _judge(
        self, out: ShiftOutcome, failures: Sequence[str], alive: Sequence[Any], all_or_nothing: bool
    ) -> Steps[bool]:
        """After failures: go on with `alive`, or release it and fail the bring-up."""
        out.reason = "; ".join(failures)
        if all_or_nothing or not alive:
            if alive:
                yield from self._do(Release(tuple(alive)))
            out.succeeded = False
            return False
        return True

    def _activate(self, inst: Any, out: ShiftOutcome) -> Steps[None]:
        yield from self._do(SetState((inst,), "active"))
        self.running[inst.key] = inst
        out.started.append(inst.key)

    def _serve_each_when_ready(
        self, launched: list[Any], t0: float, suffix: str, failures: list[str], out: ShiftOutcome
    ) -> Steps[list[Any]]:
        """No rehearsal, and some may fail: each instance serves as soon as its engine is
        loaded, so the requests held for a cold start wait for the fastest engine, not the
        slowest."""
        served: list[Any] = []
        pending = list(launched)
        while pending:
            done = yield from self._do(NextReady(tuple(pending)))
            for token, inst in done:
                pending.remove(token)
                if isinstance(inst, Failed):
                    failures.append(inst.why)
                    continue
                (why,) = yield from self._do(Join((inst,)))
                if why:
                    failures.append(why)
                    continue
                yield from self._activate(inst, out)
                served.append(inst)
        out.phases_s["warm" + suffix] = self.now_s - t0
        out.phases_s["switch" + suffix] = 0.0  # each switched as it became ready
        if failures:
            out.reason = "; ".join(failures)
            out.succeeded = bool(served)
        return served

    # ------------------------------------------------------------------ retiring
    def _retire(
        self,
        leaving: Sequence[Any],
        suffix: str,
        may_sleep: bool = False,
        drain_deadline_s: float | None = None,
    ) -> Steps[None]:
        """Drain `leaving` (for `drain_deadline_s`, driver s; None: the shift's deadline),
        move what would outlive the deadline, then stop them (or, with `may_sleep`, put those
        with a sleep level to sleep)."""
        if not leaving:
            return
        out = self.out
        p = self.params
        t0 = self.now_s
        num_in_flight = yield from self._do(StopRouting(tuple(leaving)))
        wait_s = p.drain_deadline_s if drain_deadline_s is None else drain_deadline_s
        # the deadline in modelled seconds, as the performance model's token intervals
        deadline_s = wait_s / p.time_scale if p.time_scale > 0 else math.inf
        early, _ = yield from self._plan_moves(leaving, leaving, deadline_s)
        drained: Drained = yield from self._do(Drain(tuple(leaving), wait_s, early))
        num_moved = self._count(drained.moved)
        busy_until_s = max(self.now_s, drained.moved.busy_until_s)
        out.phases_s["drain" + suffix] = self.now_s - t0
        t1 = self.now_s
        left = [i for i, empty in zip(leaving, drained.empty, strict=True) if not empty]
        late, num_stuck = yield from self._plan_moves(left, leaving, None)
        num_moved += num_stuck
        for wave in late:
            wait_s = t1 + wave.at_s - self.now_s
            if wait_s > 0:
                yield from self._do(Wait(wait_s))
            moved: Moved = yield from self._do(Move(wave))
            num_moved += self._count(moved)
            busy_until_s = max(busy_until_s, moved.busy_until_s)
        yield from self._do(Drain(tuple(leaving), MOVED_LEAVE_S))  # moved ones leave at once
        if busy_until_s > self.now_s:  # the source holds the KV until it is across
            yield from self._do(Wait(busy_until_s - self.now_s))
        out.count("finished_in_place", max(0, num_in_flight - num_moved))
        out.phases_s["migrate" + suffix] = self.now_s - t1
        stopping = list(leaving)
        if may_sleep:
            stopping = yield from self._sleep(leaving, suffix)
        if not stopping:
            return
        t2 = self.now_s
        yield from self._do(Release(tuple(stopping)))
        for inst in stopping:
            self.running.pop(inst.key, None)
            out.stopped.append(inst.key)
        out.phases_s["release" + suffix] = self.now_s - t2

    def _pre_start(self, adds: Sequence[PlannedInstance], level: int, suffix: str) -> Steps[None]:
        """The successors of an in-place step start beside the instances they replace,
        rehearse, and sleep at `level` until those are gone (in_place.py): kept in
        `sleepers`, so that the step's bring-up wakes them. A failed start or rehearsal
        fails the shift before anything stopped; one that does not fall asleep stops, and
        its instance cold-starts in the step, as rolling. Its phases: `*_prestart*`."""
        yield from self._launch(adds, "_prestart" + suffix, self.params.rehearse, True, self.out,
                                sleep_level=level)  # fmt: skip

    def _fall_asleep(self, started: Sequence[Any], level: int, suffix: str) -> Steps[None]:
        """Pre-started instances to sleep, into `sleepers`; one that stays awake stops."""
        t0 = self.now_s
        results = yield from self._do(Sleep(tuple(started), level))
        awake = []
        for inst, result in zip(started, results, strict=True):
            if isinstance(result, Failed):
                awake.append(inst)
            else:
                self.sleepers[inst.key] = result
        if awake:
            yield from self._do(Release(tuple(awake)))
        self.out.phases_s["sleep" + suffix] = self.now_s - t0

    def _sleep(self, leaving: Sequence[Any], suffix: str) -> Steps[list[Any]]:
        """Put the drained instances that have a sleep level to sleep, a Sleep per level;
        returns those still to stop (no level, or the sleep failed)."""
        levels = sorted({self.sleep_levels.get(i.key, 0) for i in leaving} - {0})
        if not levels:
            return list(leaving)
        t0 = self.now_s
        asleep: set[str] = set()
        for level in levels:
            group = [i for i in leaving if self.sleep_levels.get(i.key, 0) == level]
            results = yield from self._do(Sleep(tuple(group), level))
            for inst, result in zip(group, results, strict=True):
                if isinstance(result, Failed):
                    continue
                self.running.pop(inst.key, None)
                self.sleepers[inst.key] = result
                self.out.slept.append(inst.key)
                asleep.add(inst.key)
        self.out.phases_s["sleep" + suffix] = self.now_s - t0
        return [i for i in leaving if i.key not in asleep]

    def _count(self, moved: Moved) -> int:
        for outcome in moved.outcomes:
            self.out.count(outcome)
        return moved.num_moved

    def _plan_moves(
        self, sources: Sequence[Any], leaving: Sequence[Any], outliving_s: float | None
    ) -> Steps[tuple[tuple[Wave, ...], int]]:
        p = self.params
        waves, num_stuck, continued = yield from plan_waves(
            self._do,
            self.running,
            sources,
            leaving,
            outliving_s,
            p.time_scale,
            p.warm_moves,
            self.specs,
            p.kv_moves,
        )
        self._count(Moved(continued))
        return waves, num_stuck
