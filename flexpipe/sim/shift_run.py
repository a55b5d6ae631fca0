"""Carrying out one shift on the virtual clock, in the live executor's order and phases
(`flexpipe/control/executor.py`, docs/controller.md):

1. warm: the new instances start; the phase lasts until the slowest is loaded (the
   performance model's cold start, as the sim engine sleeps it);
2. rehearse: one probe per new instance, run on a copy of its engine core; its modelled time
   against the gear table's prediction (`Estimate`), a miss beyond `rehearsal_tolerance`
   rolls the shift back;
3. switch: the new instances join the gateway's pool;
4. drain the leaving instances for at most `drain_deadline_s`; each request still running at
   the deadline is moved to a live instance of its model — its KV cache when
   `choose_migration` says moving it beats recomputing its context, else by recompute; one
   not answered yet is sent again (`rerun`);
5. release: their GPUs are free.

The order of the steps comes from `flexpipe.control.shift_plan.plan_shift` (new instances on
free GPUs first, then rolling in-place replacements, then the rest retire). A shift is a
generator that yields how long to wait (seconds) or a `DrainWait`; `ShiftRun` resumes it on
the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flexpipe.cluster import Cluster
from flexpipe.control.shift_plan import plan_shift, probe_tokens
from flexpipe.engine.request import EngineRequest, SamplingParams
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.migration import choose_migration, link_between, perf_model_of
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.sim.engine_factory import engine_core
from flexpipe.sim.loop import CONTROL, EventLoop
from flexpipe.sim.request import SimRequest
from flexpipe.sim.stretch import SIM_GEN_IDS

__all__ = ["DrainWait", "ShiftOutcome", "ShiftRun", "World", "rehearse"]

PROBE_PROMPT_TOKENS = 64  # "rehearsal " * 32, as the executor sends it
PROBE_OVERHEAD_S = 0.05  # the executor's HTTP allowance (no HTTP here: time scale 1)


class World(Protocol):
    """The simulator's side of a shift: instances, the gateway's pool and the requests."""

    loop: EventLoop

    @property
    def cluster(self) -> Cluster: ...

    def launch(self, planned: PlannedInstance, now: float) -> Any: ...  # record, or str: why not

    def activate(self, rec: Any, now: float) -> None: ...

    def stop_routing(self, rec: Any, now: float) -> list[SimRequest]: ...

    def requests_on(self, rec: Any) -> list[SimRequest]: ...

    def when_empty(self, recs: Sequence[Any], callback: Callable[[float], None]) -> None: ...

    def move(
        self, req: SimRequest, source: Any, target: Any, method: str, delay_s: float, now: float
    ) -> None: ...

    def release(self, rec: Any, now: float) -> None: ...

    def context_tokens(self, req: SimRequest, rec: Any) -> tuple[int, int]: ...


@dataclass(frozen=True, slots=True)
class DrainWait:
    recs: tuple[Any, ...]
    deadline_s: float


@dataclass
class ShiftOutcome:
    """What the shift log records of carrying a shift out (the executor's `ShiftOutcome`)."""

    succeeded: bool = True
    reason: str = ""
    phases_s: dict[str, float] = field(default_factory=dict)
    migrated: dict[str, int] = field(default_factory=dict)  # method -> requests
    rehearsal: list[dict[str, Any]] = field(default_factory=list)
    started: list[str] = field(default_factory=list)  # instance keys
    stopped: list[str] = field(default_factory=list)

    def count(self, method: str, n: int = 1) -> None:
        if n:
            self.migrated[method] = self.migrated.get(method, 0) + n


def rehearse(planned: PlannedInstance, cluster: Cluster, tolerance: float) -> dict[str, Any]:
    """The executor's probe, on a fresh copy of the instance's engine core: its modelled time
    against the gear table's prediction (TTFT + TPOT per further token at the full batch)."""
    from flexpipe.sim.deployment import Deployment
    from flexpipe.sim.engine_factory import engine_config

    est = planned.estimate
    n = probe_tokens(est.ttft_s, est.tpot_s, 1.0, PROBE_OVERHEAD_S)
    core = engine_core(engine_config(Deployment.of(planned), cluster))
    probe = EngineRequest("probe", list(range(PROBE_PROMPT_TOKENS)),
                          SamplingParams(max_tokens=n), n, SIM_GEN_IDS)  # fmt: skip
    core.add(probe, 0.0)
    t = 0.0
    while not probe.finished_s and core.has_work:
        plan = core.step(t)
        t += plan.duration_s
        core.complete(plan, t)
    measured_s = probe.finished_s
    predicted_s = est.ttft_s + est.tpot_s * (n - 1)
    ratio = measured_s / predicted_s if predicted_s > 0 else 1.0
    passed = ratio <= tolerance
    key = instance_key(planned)
    why = "" if passed else (
        f"{key}: probe took {measured_s:.3f} s against {predicted_s:.3f} s predicted "
        f"(x{ratio:.2f}, tolerance x{tolerance:g})"
    )  # fmt: skip
    return {"instance": key, "passed": passed, "why": why, "predicted_s": round(predicted_s, 4),
            "measured_s": round(measured_s, 4), "ratio": round(ratio, 3)}  # fmt: skip


Wait = float | DrainWait
Gen = Generator[Wait, float, None]


class ShiftRun:
    """One shift from `running` (key -> record, updated in place) to `target`."""

    def __init__(
        self,
        world: World,
        running: dict[str, Any],
        target: Sequence[PlannedInstance],
        on_done: Callable[[ShiftOutcome, float], None],
        *,
        drain_deadline_s: float = 30.0,
        rehearsal_tolerance: float = 2.0,
        rehearse: bool = True,
        all_or_nothing: bool = True,
    ) -> None:
        self.world = world
        self.running = running
        self.target = tuple(target)
        self.on_done = on_done
        self.drain_deadline_s = drain_deadline_s
        self.rehearsal_tolerance = rehearsal_tolerance
        self.do_rehearse = rehearse
        self.all_or_nothing = all_or_nothing
        self.out = ShiftOutcome()
        self._gen = self._shift()
        self._primed = False
        self._token = 0

    def start(self, now: float) -> None:
        self._resume(now, self._token)

    def _resume(self, now: float, token: int) -> None:
        if token != self._token:
            return  # a drain wait already resumed by its other end
        self._token += 1
        try:
            if self._primed:
                wait = self._gen.send(now)
            else:
                self._primed = True
                wait = next(self._gen)
        except StopIteration:
            self.on_done(self.out, now)
            return
        tok = self._token
        loop = self.world.loop
        if isinstance(wait, DrainWait):
            self.world.when_empty(wait.recs, lambda t: self._resume(t, tok))
            loop.at(wait.deadline_s, CONTROL, lambda t: self._resume(t, tok))
        else:
            loop.at(loop.now_s + wait, CONTROL, lambda t: self._resume(t, tok))

    # -------------------------------------------------------------------- the phases
    def _shift(self) -> Gen:
        running_planned = [r.planned for r in self.running.values()]
        steps = plan_shift(running_planned, self.target)
        if steps.refusal:
            self.out.succeeded = False
            self.out.reason = steps.refusal
            return
        by_key = dict(self.running)
        started = yield from self._bring_up(steps.now_adds, "")
        if not self.out.succeeded:
            return
        for n, (blockers, adds) in enumerate(steps.steps):
            suffix = "_in_place" if len(steps.steps) == 1 else f"_in_place{n + 1}"
            recs = [by_key[instance_key(b)] for b in blockers]
            yield from self._retire(recs, suffix)
            more = yield from self._bring_up(adds, suffix)
            if not self.out.succeeded:
                yield from self._roll_back(recs, started + more)
                return
            started += more
        rest = [by_key[instance_key(b)] for b in steps.rest]
        yield from self._retire(rest, "_rest" if steps.steps else "")

    def _bring_up(
        self, adds: Sequence[PlannedInstance], suffix: str
    ) -> Generator[Wait, float, list[Any]]:
        if not adds:
            return []
        world = self.world
        t0 = world.loop.now_s
        started: list[Any] = []
        failures = []
        for p in adds:
            rec = world.launch(p, t0)
            if isinstance(rec, str):
                failures.append(f"instance {p.name} did not start: {rec}")
            else:
                started.append(rec)
        if failures:
            self.out.reason = "; ".join(failures)
            if self.all_or_nothing or not started:
                for rec in started:
                    world.release(rec, t0)
                self.out.succeeded = False
                return []
        ready = max(r.ready_s for r in started)
        now = yield max(0.0, ready - t0)
        self.out.phases_s["warm" + suffix] = now - t0
        dead = [r for r in started if r.released_s >= 0]  # its GPUs went while it loaded
        if dead:
            self.out.reason = "; ".join(f"instance {r.dep.name} died starting: {r.died}"
                                        for r in dead)  # fmt: skip
            started = [r for r in started if r.released_s < 0]
            if self.all_or_nothing or not started:
                for rec in started:
                    world.release(rec, now)
                self.out.succeeded = False
                return []
        if self.do_rehearse:
            checks = [rehearse(r.planned, world.cluster, self.rehearsal_tolerance) for r in started]
            self.out.rehearsal.extend(checks)
            t1 = now
            now = yield max(c["measured_s"] for c in checks)
            self.out.phases_s["rehearse" + suffix] = now - t1
            missed = [c for c in checks if not c["passed"]]
            if missed:
                for rec in started:
                    world.release(rec, now)
                self.out.succeeded = False
                self.out.reason = "rehearsal missed: " + "; ".join(c["why"] for c in missed)
                return []
        for rec in started:
            world.activate(rec, now)
            self.running[rec.key] = rec
            self.out.started.append(rec.key)
        self.out.phases_s["switch" + suffix] = 0.0
        return started

    def _retire(self, leaving: Sequence[Any], suffix: str) -> Gen:
        if not leaving:
            return
        world = self.world
        t0 = world.loop.now_s
        in_flight = [len(world.stop_routing(rec, t0)) for rec in leaving]
        if any(world.requests_on(r) for r in leaving):
            yield DrainWait(tuple(leaving), t0 + self.drain_deadline_s)
        now = world.loop.now_s
        self.out.phases_s["drain" + suffix] = now - t0
        longest_s = 0.0
        for rec, num in zip(leaving, in_flight, strict=True):
            left = world.requests_on(rec)
            if left:
                longest_s = max(longest_s, self._move_off(rec, left, now))
            self.out.count("finished_in_place", max(0, num - len(left)))
        if longest_s > 0:  # the source holds the KV until it is across
            now = yield longest_s
        self.out.phases_s["migrate" + suffix] = now - t0 - self.out.phases_s["drain" + suffix]
        for rec in leaving:
            world.release(rec, now)
            self.running.pop(rec.key, None)
            self.out.stopped.append(rec.key)
        self.out.phases_s["release" + suffix] = 0.0

    def _move_off(self, source: Any, reqs: Sequence[SimRequest], now: float) -> float:
        """Move `reqs` to live instances of their model; returns the longest KV transfer."""
        world = self.world
        model = source.planned.model
        targets = [r for r in self.running.values() if r.planned.model == model and r.active]
        longest = 0.0
        for n, req in enumerate(reqs):
            if not targets:  # nowhere to go: the gateway continues it when the engine stops
                world.move(req, source, None, "recomputed", 0.0, now)
                self.out.count("recomputed")
                continue
            target = targets[n % len(targets)]
            num_prompt, num_out = world.context_tokens(req, source)
            if num_out == 0:
                world.move(req, source, target, "rerun", 0.0, now)
                self.out.count("rerun")
                continue
            cluster = world.cluster
            link = link_between(cluster, source.planned, target.planned)
            choice = choose_migration(perf_model_of(cluster, target.planned), num_prompt + num_out,
                                      link)  # fmt: skip
            method = "kv_moved" if choice.method == "kv" else "recomputed"
            delay = choice.pause_s if method == "kv_moved" else 0.0
            world.move(req, source, target, method, delay, now)
            self.out.count(method)
            longest = max(longest, delay)
        return longest

    def _roll_back(self, released: Sequence[Any], started: Sequence[Any]) -> Gen:
        """The in-place successor failed after the instances in its way were released: they
        start again (no rehearsal) and what the shift started leaves."""
        reason = self.out.reason
        self.out.succeeded = True
        rehearse_was, self.do_rehearse = self.do_rehearse, False
        back = yield from self._bring_up([r.planned for r in released], "_rollback")
        self.do_rehearse = rehearse_was
        if len(back) < len(released):
            reason += "; rollback: not every instance came back"
        yield from self._retire(list(started), "_rollback")
        self.out.succeeded = False
        self.out.reason = reason
        gone = {r.key for r in started}
        self.out.started = [k for k in self.out.started if k not in gone]
