"""Carrying out one shift on the virtual clock, in the live executor's order and phases
(`flexpipe/control/executor.py`, docs/controller.md):

1. warm: the new instances start; the phase lasts until the slowest is loaded (the
   performance model's cold start, as the sim engine sleeps it);
2. rehearse: one probe per new instance, run on a copy of its engine core; its modelled time
   against the gear table's prediction (`Estimate`), a miss beyond `rehearsal_tolerance`
   rolls the shift back;
3. switch: the new instances join the gateway's pool;
4. drain the leaving instances for at most `drain_deadline_s`; the requests that would still
   run at the deadline move at once, and what still runs at the deadline moves then, each
   planned by the executor's `plan_moves` (destination, KV move or recompute, and when: in
   waves, `warm=True` as the executor plans) from the same inputs, and admitted there ahead
   of the queue (`MOVE_PRIORITY`); a recompute is pre-copied first as the gateway does
   (`_pre_copy`: a one-token warm-up of its context on the destination's engine, the request
   generating on its source meanwhile), then cut over at its source's next token
   (`sim.moves.cut_over_at_s`, the gateway's rule); one not answered yet is sent again
   (`rerun`);
5. release: their GPUs are free.

The instances go through the gateway's pool as the executor tells the admin API: starting
(loaded), rehearsing, active, draining, gone.

The order of the steps comes from `flexpipe.control.core.shift_plan.plan_shift` (new instances on
free GPUs first, then rolling in-place replacements, then the rest retire). A shift is a
generator that yields how long to wait (seconds) or a `DrainWait`; `ShiftRun` resumes it on
the event loop.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flexpipe.cluster import Cluster
from flexpipe.control.core.move_inputs import (
    context_tokens,
    decode_interval_s,
    destination_of,
    tokens_left,
    warm_timeout_s,
)
from flexpipe.control.core.shift_outcome import ShiftOutcome
from flexpipe.control.core.shift_plan import plan_shift, probe_tokens
from flexpipe.engine.request import EngineRequest, SamplingParams
from flexpipe.gateway.core.holds import STANDBY_HOLD_S
from flexpipe.gateway.relay import WARM_POLL_S
from flexpipe.lifecycle import State
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.migration import (
    MoveRequest,
    PlannedMove,
    link_between,
    outlives,
    perf_model_of,
    plan_moves,
)
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.sim.engine_factory import engine_core
from flexpipe.sim.loop import CONTROL, EventLoop
from flexpipe.sim.moves import cut_over_at_s
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

    def set_state(self, rec: Any, state: State, now: float) -> None: ...  # the admin API's

    def stop_routing(self, rec: Any, now: float) -> list[SimRequest]: ...

    def requests_on(self, rec: Any) -> list[SimRequest]: ...

    def when_empty(self, recs: Sequence[Any], callback: Callable[[float], None]) -> None: ...

    def move(
        self,
        req: SimRequest,
        source: Any,
        target: Any,
        method: str,
        delay_s: float,
        now: float,
        warm: str | None = None,
    ) -> None: ...

    def warm_up(
        self,
        req: SimRequest,
        source: Any,
        target: Any,
        timeout_s: float,
        now: float,
        done: Callable[[str, float], None],
    ) -> None: ...  # the gateway's pre-copy of a recompute move (`relay.warm_up`)

    def awaits_first_token(self, rec: Any) -> bool: ...

    def fence(self, req: SimRequest, rec: Any, wait_s: float, now: float) -> None: ...

    def release(self, rec: Any, now: float) -> None: ...

    def hold(self, model: str, seconds: float, now: float) -> None: ...  # the admin API's

    def refuse(self, model: str, reason: str, seconds: float, now: float) -> None: ...  # admin

    def context_tokens(self, req: SimRequest, rec: Any) -> tuple[int, int]: ...


@dataclass(frozen=True, slots=True)
class DrainWait:
    recs: tuple[Any, ...]
    deadline_s: float


@dataclass(frozen=True, slots=True)
class MovesWait:
    """Until every pre-copied move carried out so far has cut over (the executor awaits its
    gateway calls, which return after the warm-up)."""


def _as_gateway(req: SimRequest, num_prompt: int, num_out: int) -> dict[str, Any]:
    """`req` as the gateway's `GET /admin/requests` lists it (what the executor reads)."""
    return {"id": req.request_id, "num_prompt_tokens": num_prompt,
            "num_output_tokens": num_out, "max_tokens": req.num_output_tokens}  # fmt: skip


Move = tuple[PlannedMove, Any, Any, SimRequest]  # (planned, source, destination, request)


class _Drain:
    over = False  # the drain ended (empty, or its deadline): no early wave starts after
    kv_across_s = 0.0  # when the last KV moved before the deadline is across


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


Wait = float | DrainWait | MovesWait
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
        warm_moves: bool = True,
    ) -> None:
        self.world = world
        self.running = running
        self.target = tuple(target)
        self.on_done = on_done
        self.drain_deadline_s = drain_deadline_s
        self.rehearsal_tolerance = rehearsal_tolerance
        self.do_rehearse = rehearse
        self.all_or_nothing = all_or_nothing
        self.warm_moves = warm_moves  # the executor's: recompute moves pre-copied, priced so
        self.out = ShiftOutcome(succeeded=True)
        self._num_pre_copying = 0  # moves carried out, warming up, not cut over yet
        self._moves_waiter: Callable[[float], None] | None = None
        self._num_moved = 0  # requests moved (or left with nowhere to go) in this retire
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
        elif isinstance(wait, MovesWait):
            if self._num_pre_copying:
                self._moves_waiter = lambda t: self._resume(t, tok)
            else:
                loop.at(loop.now_s, CONTROL, lambda t: self._resume(t, tok))
        else:
            loop.at(loop.now_s + wait, CONTROL, lambda t: self._resume(t, tok))

    # -------------------------------------------------------------------- the phases
    def _shift(self) -> Gen:
        world = self.world
        running_planned = [r.planned for r in self.running.values()]
        # a model the target has no instance of scales to zero (as the executor's)
        steps = plan_shift(running_planned, self.target, scale_to_zero=True)
        if steps.refusal:  # before anything changed: refused, not failed
            self.out.succeeded = False
            self.out.refused = True
            self.out.reason = steps.refusal
            return
        kept_models = {p.model for p in self.target}
        for model in sorted({p.model for p in steps.leaving} - kept_models):
            # to zero: its requests from now on wait for a cold start, not a 404
            world.hold(model, STANDBY_HOLD_S, world.loop.now_s)
        by_key = dict(self.running)
        started = yield from self._bring_up(steps.now_adds, "")
        if not self.out.succeeded:
            return
        for n, (blockers, adds) in enumerate(steps.steps):
            suffix = "_in_place" if len(steps.steps) == 1 else f"_in_place{n + 1}"
            recs = [by_key[instance_key(b)] for b in blockers]
            held = self._hold(adds, recs)
            yield from self._retire(recs, suffix)
            more = yield from self._bring_up(adds, suffix)
            if not self.out.succeeded:
                yield from self._roll_back(recs, started + more)
            for model in held:
                world.hold(model, 0.0, world.loop.now_s)
            if not self.out.succeeded:
                return
            started += more
        rest = [by_key[instance_key(b)] for b in steps.rest]
        yield from self._retire(rest, "_rest" if steps.steps else "")

    def _hold(self, adds: Sequence[PlannedInstance], leaving: Sequence[Any]) -> list[str]:
        """The executor's `_hold`: an in-place step takes capacity away while its replacement
        starts on the same GPUs, so the gateway keeps the models' requests queued that long
        (twice the cold start the leaving instances took, plus the drain); released after
        the step."""
        models = sorted({p.model for p in adds})
        cold_s = max((r.ready_s - r.launched_s for r in leaving), default=30.0)
        hold_s = 2 * cold_s + self.drain_deadline_s + 30.0
        for model in models:
            self.world.hold(model, hold_s, self.world.loop.now_s)
        return models

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
        if not self.do_rehearse and not self.all_or_nothing:  # the first plan, a rollback
            return (yield from self._serve_each_when_ready(started, t0, suffix))
        ready = max(r.ready_s for r in started)
        now = yield max(0.0, ready - t0)
        self.out.phases_s["warm" + suffix] = now - t0
        started = self._alive(started, now)  # its GPUs may have gone while it loaded
        if not self.out.succeeded:
            return []
        for rec in started:  # loaded: in the gateway's pool, not routed
            world.set_state(rec, State.STARTING, now)
        if self.do_rehearse:
            for rec in started:
                world.set_state(rec, State.REHEARSING, now)
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
            started = self._alive(started, now)  # or while it rehearsed
            if not self.out.succeeded:
                return []
        for rec in started:
            world.set_state(rec, State.ACTIVE, now)
            self.running[rec.key] = rec
            self.out.started.append(rec.key)
        self.out.phases_s["switch" + suffix] = 0.0
        return started

    def _serve_each_when_ready(
        self, started: list[Any], t0: float, suffix: str
    ) -> Generator[Wait, float, list[Any]]:
        """The executor's `_serve_each_when_ready`: no rehearsal, and some may fail, so each
        instance serves as soon as its engine is loaded."""
        world = self.world
        served: list[Any] = []
        now = t0
        for ready_s in sorted({r.ready_s for r in started}):
            now = yield max(0.0, ready_s - now)
            for rec in started:
                if rec.ready_s == ready_s and rec.released_s < 0:  # not dead with its GPUs
                    world.set_state(rec, State.STARTING, now)
                    world.set_state(rec, State.ACTIVE, now)
                    self.running[rec.key] = rec
                    self.out.started.append(rec.key)
                    served.append(rec)
        self.out.phases_s["warm" + suffix] = now - t0
        self.out.phases_s["switch" + suffix] = 0.0
        dead = [r for r in started if r not in served]
        if dead:
            why = "; ".join(f"instance {r.dep.name} died starting: {r.died}" for r in dead)
            self.out.reason = f"{self.out.reason}; {why}" if self.out.reason else why
            self.out.succeeded = bool(served)
        return served

    def _alive(self, started: list[Any], now: float) -> list[Any]:
        """The started instances whose engines did not die with their GPUs; when one did and
        the shift is all or nothing (or none is left), the others are released too and the
        shift fails."""
        dead = [r for r in started if r.released_s >= 0]
        if not dead:
            return started
        self.out.reason = "; ".join(f"instance {r.dep.name} died starting: {r.died}"
                                    for r in dead)  # fmt: skip
        alive = [r for r in started if r.released_s < 0]
        if self.all_or_nothing or not alive:
            for rec in alive:
                self.world.release(rec, now)
            self.out.succeeded = False
            return []
        return alive

    def _retire(self, leaving: Sequence[Any], suffix: str) -> Gen:
        """The executor's `_retire`: draining (no new requests); what would outlive the drain
        deadline moves at once, in the planned waves, while the deadline lasts; what still
        runs at the deadline moves then; the GPUs are released when the last KV is across."""
        if not leaving:
            return
        world = self.world
        t0 = world.loop.now_s
        in_flight = sum(len(world.stop_routing(rec, t0)) for rec in leaving)
        self._num_moved = 0
        drain = _Drain()
        early = self._plan(leaving, leaving, self.drain_deadline_s)
        for at_s, wave in _waves(early):
            world.loop.at(t0 + at_s, CONTROL, functools.partial(self._early, drain, wave))
        if any(world.requests_on(r) for r in leaving):
            yield DrainWait(tuple(leaving), t0 + self.drain_deadline_s)
        drain.over = True
        if self._num_pre_copying:  # the early moves under way cut over first
            yield MovesWait()
        now = world.loop.now_s
        self.out.phases_s["drain" + suffix] = now - t0
        left = [r for r in leaving if world.requests_on(r)]
        end_s = max(now, drain.kv_across_s)
        for at_s, wave in _waves(self._plan(left, leaving, None)):
            if now + at_s > world.loop.now_s:
                yield now + at_s - world.loop.now_s
            end_s = max(end_s, self._carry(wave, world.loop.now_s))
            if self._num_pre_copying:  # the gateway answers the wave once it cut over
                yield MovesWait()
        if end_s > world.loop.now_s:  # the source holds the KV until it is across
            yield end_s - world.loop.now_s
        self.out.count("finished_in_place", max(0, in_flight - self._num_moved))
        done_s = world.loop.now_s
        self.out.phases_s["migrate" + suffix] = done_s - now
        for rec in leaving:
            world.release(rec, done_s)
            self.running.pop(rec.key, None)
            self.out.stopped.append(rec.key)
        self.out.phases_s["release" + suffix] = 0.0

    def _plan(
        self, sources: Sequence[Any], leaving: Sequence[Any], outliving_s: float | None
    ) -> list[Move]:
        """The executor's `_move_off` planning: per model, what runs on `sources` (with
        `outliving_s`: only what would still run that long from now) to the active
        instances of the model that stay, by `plan_moves`. A request with nowhere to go at
        the deadline is continued by the gateway wherever it can (counted as recomputed)."""
        world = self.world
        cluster = world.cluster
        now = world.loop.now_s
        gone = {r.key for r in leaving}
        horizon_s = math.inf if outliving_s is None else outliving_s
        urls = [(r.instance.url, r.planned) for r in sources]
        planned: list[Move] = []
        for model in sorted({r.planned.model for r in sources}):
            reqs: list[MoveRequest] = []
            where: dict[int, tuple[Any, SimRequest]] = {}
            for src in sources:
                if src.planned.model != model:
                    continue
                mine = [(q, _as_gateway(q, *world.context_tokens(q, src)))
                        for q in world.requests_on(src)]  # fmt: skip
                interval_s = decode_interval_s(cluster, src.planned, [d for _, d in mine])
                if outliving_s is not None:
                    mine = [(q, d) for q, d in mine
                            if outlives(tokens_left(d), interval_s, outliving_s)]  # fmt: skip
                for q, d in mine:
                    reqs.append(MoveRequest(q.request_id, context_tokens(d), src.instance.url,
                                            interval_s))  # fmt: skip
                    where[q.request_id] = (src, q)
            targets = [r for k, r in self.running.items()
                       if r.planned.model == model and r.active and k not in gone]  # fmt: skip
            if not targets:
                if outliving_s is None:  # the gateway continues them when the engine stops
                    for src, q in where.values():
                        world.move(q, src, None, "recomputed", 0.0, now)
                        self.out.count("recomputed")
                        self._num_moved += 1
                continue
            destinations = [
                destination_of(cluster, urls, t.instance.url, t.planned,
                               [_as_gateway(q, *world.context_tokens(q, t))
                                for q in world.requests_on(t)])
                for t in targets
            ]  # fmt: skip
            by_url = {t.instance.url: t for t in targets}
            for m in plan_moves(reqs, destinations, horizon_s, warm=self.warm_moves):
                src, q = where[m.id]
                planned.append((m, src, by_url[m.destination], q))
        return planned

    def _early(self, drain: _Drain, wave: Sequence[Move], now: float) -> None:
        if not drain.over:  # no wave starts after the deadline (what is left moves then)
            drain.kv_across_s = max(drain.kv_across_s, self._carry(wave, now))

    def _carry(self, wave: Sequence[Move], now: float) -> float:
        """One wave of moves (the gateway's `move`): each request still running on its
        source continues on its destination, ahead of its queue; returns when the last KV of
        the wave is across."""
        world = self.world
        end_s = now
        for m, src, dst, req in wave:
            if not any(r is req for r in world.requests_on(src)):
                continue  # it ended meanwhile (the gateway's "not_running")
            num_prompt, num_out = world.context_tokens(req, src)
            delay_s = 0.0
            if num_out == 0:
                method = "rerun"
            elif m.choice.method == "kv":
                method = "kv_moved"
                link = link_between(world.cluster, src.planned, dst.planned)
                if link is not None:  # the engine imports what the context is now
                    delay_s = perf_model_of(world.cluster, dst.planned).kv_transfer_s(
                        num_prompt + num_out, link.bandwidth_bytes_per_s, link.latency_s
                    )
                world.fence(req, dst, delay_s, now)
            else:
                timeout_s = warm_timeout_s(m.choice.done_s, 1.0, self.warm_moves)
                self._pre_copy(req, src, dst, timeout_s, now)
                continue
            world.move(req, src, dst, method, delay_s, now)
            self.out.count(method)
            self._num_moved += 1
            end_s = max(end_s, now + delay_s)
        return end_s

    def _pre_copy(self, req: SimRequest, src: Any, dst: Any, timeout_s: float, now: float) -> None:
        """The gateway's recompute move (`gateway.moves.move_request`): the destination
        warmed with the context (`World.warm_up`), then, warmed, at most `timeout_s` more
        until no stream there awaits its first token (`gateway.moves.between_prefills`,
        polled as the gateway does), then the cut-over; the request generates on its source
        all the while."""
        self._num_pre_copying += 1
        world = self.world
        bound_s = 0.0  # warmed: until when it waits for no prefill on the destination

        def cut_over(warm: str, t: float) -> None:
            """At its source's next token (`sim.moves.cut_over_at_s`), as the gateway does."""
            ran = any(r is req for r in world.requests_on(src))
            at_s = t
            if ran:  # new requests keep off the destination until it has the stream, fenced
                at_s, wait_s = cut_over_at_s(req, src, t)  # for the wait's bound, as
                world.fence(req, dst, wait_s, t)  # `gateway.moves.fence_target` does
            if at_s > t:
                world.loop.at(at_s, CONTROL, functools.partial(carried_out, warm))
            else:
                carried_out(warm, t)

        def carried_out(warm: str, t: float) -> None:
            if any(r is req for r in world.requests_on(src)):  # else it ended meanwhile
                world.move(req, src, dst, "recomputed", 0.0, t, warm)
                self.out.count("recomputed")
                self._num_moved += 1
            self._num_pre_copying -= 1
            if not self._num_pre_copying and self._moves_waiter is not None:
                waiter, self._moves_waiter = self._moves_waiter, None
                world.loop.at(t, CONTROL, waiter)

        def between_prefills(t: float) -> None:
            if world.awaits_first_token(dst) and t < bound_s:
                world.loop.at(t + WARM_POLL_S, CONTROL, between_prefills)
            else:
                cut_over("warmed", t)

        def warmed(outcome: str, t: float) -> None:
            nonlocal bound_s
            if outcome == "warmed":
                bound_s = t + timeout_s
                between_prefills(t)
            else:
                cut_over(outcome, t)

        world.warm_up(req, src, dst, timeout_s, now, warmed)

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


def _waves(moves: Sequence[Move]) -> list[tuple[float, list[Move]]]:
    """Moves planned within 10 ms of each other go together (the executor's waves)."""
    waves: dict[float, list[Move]] = {}
    for item in moves:
        waves.setdefault(round(item[0].at_s, 2), []).append(item)
    return sorted(waves.items())
