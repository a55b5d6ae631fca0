"""Carrying out a shift, make-before-break (issue 9 §4), on the real clock:

1. warm: start the target's new instances (launcher), wait until they answer /health;
2. rehearse: a probe through each new engine, compared with the gear table's prediction; a
   miss beyond `tolerance` rolls the shift back (new instances stopped; the caller logs and
   blacklists the target);
3. switch: the new instances join the gateway's pool;
4. drain the instances that leave: no new requests; in-flight ones get `drain_deadline_s`
   to finish, then each one left is moved to a live instance of its model — its KV cache
   over the link when that is cheaper than recomputing its context, else by recompute — and
   the method is recorded;
5. release: the old engines stop, their GPUs are free.

A new instance that needs GPUs of a leaving one (an in-place shift) is started after that
one is released; the shift is refused when that would leave a model with no instance
serving in between (serving capacity never drops to zero). A model the target has no
instance of at all scales to zero on purpose: it is held in the gateway before its last
instance drains, so its next requests queue for the instance its demand starts. Every phase
is timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flexpipe.cluster import Cluster
from flexpipe.control import rehearsal
from flexpipe.control.api.gateway_client import GatewayClient, GatewayError
from flexpipe.control.core.move_inputs import (
    context_tokens,
    decode_interval_s,
    destination_of,
    tokens_left,
    warm_timeout_s,
)
from flexpipe.control.core.shift_outcome import ShiftOutcome
from flexpipe.control.core.shift_plan import plan_shift
from flexpipe.http.client import ClientPool
from flexpipe.launch import EngineHandle, EngineSpec, Launcher
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.migration import (
    Destination,
    MoveRequest,
    PlannedMove,
    link_between,
    outlives,
    plan_moves,
)
from flexpipe.policies.shift.snapshot import instance_key

__all__ = ["Executor", "LiveInstance"]

log = logging.getLogger("flexpipe.control")


@dataclass
class LiveInstance:
    """An instance the controller runs: the plan's view and the engine's."""

    planned: PlannedInstance
    handle: EngineHandle
    state: str = "starting"  # starting | rehearsing | active | draining | gone
    store_id: int | None = None

    @property
    def key(self) -> str:
        return instance_key(self.planned)

    @property
    def url(self) -> str:
        return self.handle.endpoint


def _print_line(line: str) -> None:
    print(line, flush=True)


SpecOf = Callable[[PlannedInstance], EngineSpec]
OnState = Callable[[LiveInstance, str], None]


class Executor:
    def __init__(
        self,
        launcher: Launcher,
        gateway: GatewayClient,
        spec_of: SpecOf,
        *,
        engine_admin_token: str | None = None,
        time_scale: float = 1.0,
        drain_deadline_s: float = 30.0,
        rehearsal_tolerance: float = 2.0,
        probe_overhead_s: float = 0.05,
        standby_hold_s: float = 600.0,
        warm_moves: bool = True,
        on_state: OnState | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_moves: Callable[[str], None] | None = None,
    ) -> None:
        self.launcher = launcher
        self.gateway = gateway
        self.spec_of = spec_of
        self.engine_admin_token = engine_admin_token
        self.time_scale = time_scale
        self.drain_deadline_s = drain_deadline_s
        self.rehearsal_tolerance = rehearsal_tolerance
        self.probe_overhead_s = probe_overhead_s
        self.standby_hold_s = standby_hold_s
        # the gateway pre-copies recompute moves (relay.warm_up): priced so, and bounded
        self.warm_moves = warm_moves
        self.on_state = on_state or (lambda inst, state: None)
        self.clock = clock
        # one line per batch of moves (which requests left which instance, how): the
        # controller's output by default, as its other lines
        self.on_moves = on_moves or _print_line
        self._probe_pool = ClientPool(max_idle_per_backend=2)

    async def close(self) -> None:
        await self._probe_pool.close()

    def _set(self, inst: LiveInstance, state: str) -> None:
        inst.state = state
        self.on_state(inst, state)

    # ------------------------------------------------------------------ the shift
    async def shift(
        self,
        cluster: Cluster,
        running: dict[str, LiveInstance],
        target: Sequence[PlannedInstance],
        rehearse: bool = True,
        all_or_nothing: bool = True,
    ) -> ShiftOutcome:
        """Move from `running` (updated in place) to `target`. `all_or_nothing` False (the
        first plan): instances that start serve even when others could not."""
        out = ShiftOutcome(succeeded=True)
        # a model the target has no instance of scales to zero
        plan = plan_shift([i.planned for i in running.values()], target, scale_to_zero=True)
        if plan.refusal:
            return ShiftOutcome(False, plan.refusal, refused=True)
        kept_models = {p.model for p in target}
        for model in sorted({p.model for p in plan.leaving} - kept_models):
            try:  # to zero: its requests from now on wait for a cold start, not a 404
                await self.gateway.hold(model, self.standby_hold_s)
            except GatewayError as exc:
                return ShiftOutcome(False, f"{model}: cannot hold it at zero: {exc}", refused=True)
        rest = [running[instance_key(i)] for i in plan.rest]
        started = await self._bring_up(plan.now_adds, running, out, rehearse, all_or_nothing)
        if not out.succeeded:
            return out
        for n, (planned_blockers, adds) in enumerate(plan.steps):
            suffix = "_in_place" if len(plan.steps) == 1 else f"_in_place{n + 1}"
            blockers = [running[instance_key(b)] for b in planned_blockers]
            held = await self._hold(adds, blockers)
            try:
                await self._retire(cluster, blockers, running, started, out, suffix)
                await self._bring_up(adds, running, out, rehearse, all_or_nothing, suffix)
                if not out.succeeded:
                    await self._roll_back(cluster, blockers, started, running, out)
                    return out
            finally:
                for model in held:
                    with contextlib.suppress(GatewayError):
                        await self.gateway.hold(model, 0)
        await self._retire(cluster, rest, running, started, out, "_rest" if plan.steps else "")
        return out

    async def _hold(
        self, later_adds: Sequence[PlannedInstance], leaving: Sequence[LiveInstance]
    ) -> list[str]:
        """An in-place shift takes a model's capacity away while the replacement starts on
        the same GPUs: the gateway keeps its requests queued that long (twice the cold start
        the leaving instances took, plus the drain) instead of refusing them."""
        models = sorted({p.model for p in later_adds})
        cold_s = max((i.handle.cold_start_s for i in leaving), default=30.0)
        hold_s = 2 * cold_s + self.drain_deadline_s + 30.0
        held = []
        for model in models:
            with contextlib.suppress(GatewayError):
                await self.gateway.hold(model, hold_s)
                held.append(model)
        return held

    async def _roll_back(
        self,
        cluster: Cluster,
        released: Sequence[LiveInstance],
        started: Sequence[LiveInstance],
        running: dict[str, LiveInstance],
        out: ShiftOutcome,
    ) -> None:
        """An in-place successor failed (did not start, or missed its rehearsal) after the
        instances in its way were released: start those again (no rehearsal: they served
        until now) and take out what the shift already started, so that the running plan is
        the old one again. Before this, a failed in-place rehearsal left the model without
        the instance it replaced (and without any other leaving instance)."""
        failed = ShiftOutcome(succeeded=True)
        back = await self._bring_up(
            [i.planned for i in released], running, failed, False, False, "_rollback"
        )
        out.phases_s.update(failed.phases_s)
        if len(back) < len(released):
            out.reason += f"; rollback: {failed.reason or 'not every instance came back'}"
        await self._retire(cluster, list(started), running, back, out, "_rollback")
        out.started = [k for k in out.started if k not in {i.key for i in started}]

    async def _bring_up(
        self,
        adds: Sequence[PlannedInstance],
        running: dict[str, LiveInstance],
        out: ShiftOutcome,
        rehearse: bool,
        all_or_nothing: bool = True,
        phase_suffix: str = "",
    ) -> list[LiveInstance]:
        """Start, rehearse and activate `adds`. Cancelled part-way (the controller stops
        while engines load), every engine it launched that is not yet in `running` is
        stopped before the cancellation goes on: nothing is left for PR_SET_PDEATHSIG."""
        if not adds:
            return []
        starts = [asyncio.ensure_future(self.launcher.start(self.spec_of(p))) for p in adds]
        launched: list[LiveInstance] = []
        try:
            if not rehearse and not all_or_nothing:  # the first plan, a rollback
                return await self._serve_each_when_ready(
                    adds, starts, launched, running, out, phase_suffix
                )
            return await self._bring_up_started(
                adds, starts, launched, running, out, rehearse, all_or_nothing, phase_suffix
            )
        except BaseException:
            for task in starts:  # each start stops the engine it was waiting for
                task.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
            ready = [LiveInstance(p, t.result()) for p, t in zip(adds, starts, strict=True)
                     if t.done() and not t.cancelled() and t.exception() is None]  # fmt: skip
            urls = {i.url for i in running.values()}
            orphans = {i.url: i for i in [*launched, *ready] if i.url not in urls}
            await self._stop(list(orphans.values()))
            raise

    async def _serve_each_when_ready(
        self,
        adds: Sequence[PlannedInstance],
        starts: Sequence[asyncio.Future[EngineHandle]],
        launched: list[LiveInstance],
        running: dict[str, LiveInstance],
        out: ShiftOutcome,
        phase_suffix: str,
    ) -> list[LiveInstance]:
        """No rehearsal, and some may fail: each instance serves as soon as its engine is
        ready, so the requests held for a cold start wait for the fastest engine, not the
        slowest. The simulator's ShiftRun does the same."""
        t0 = self.clock()
        served: list[LiveInstance] = []
        failures: list[str] = []
        pending: set[asyncio.Future[EngineHandle]] = set(starts)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=starts.index):
                p = adds[starts.index(task)]
                exc = task.exception()
                if exc is not None:
                    failures.append(f"instance {p.name} did not start: {exc}")
                    continue
                inst = await self._join_pool(p, task.result(), launched, failures)
                if inst is None:
                    continue
                await self._tell(inst, "active")
                running[inst.key] = inst
                out.started.append(inst.key)
                self._set(inst, "active")
                served.append(inst)
        out.phases_s["warm" + phase_suffix] = self.clock() - t0
        out.phases_s["switch" + phase_suffix] = 0.0  # each switched as it became ready
        if failures:
            out.reason = "; ".join(failures)
            out.succeeded = bool(served)
        return served

    async def _join_pool(
        self,
        p: PlannedInstance,
        handle: EngineHandle,
        launched: list[LiveInstance],
        failures: list[str],
    ) -> LiveInstance | None:
        """A started engine into the gateway's pool as `starting` (not routed until active);
        None, with the reason in `failures` and the engine stopped, when the gateway refuses."""
        inst = LiveInstance(p, handle)
        launched.append(inst)
        self._set(inst, "starting")
        try:
            await self.gateway.add(inst.url, p.model, p.gear.max_num_seqs,
                                   admin_token=self.engine_admin_token,
                                   state="starting")  # fmt: skip
        except GatewayError as exc:
            failures.append(f"instance {p.name}: the gateway refused it: {exc}")
            await self._stop([inst])
            return None
        return inst

    async def _bring_up_started(
        self,
        adds: Sequence[PlannedInstance],
        starts: Sequence[asyncio.Future[EngineHandle]],
        launched: list[LiveInstance],
        running: dict[str, LiveInstance],
        out: ShiftOutcome,
        rehearse: bool,
        all_or_nothing: bool,
        phase_suffix: str,
    ) -> list[LiveInstance]:
        t0 = self.clock()
        results = await asyncio.gather(*starts, return_exceptions=True)
        started: list[LiveInstance] = []
        failures = []
        for p, r in zip(adds, results, strict=True):
            if isinstance(r, BaseException):
                failures.append(f"instance {p.name} did not start: {r}")
                continue
            inst = await self._join_pool(p, r, launched, failures)
            if inst is not None:
                started.append(inst)
        out.phases_s["warm" + phase_suffix] = self.clock() - t0
        if failures:
            out.reason = "; ".join(failures)
            if all_or_nothing or not started:
                await self._stop(started)
                out.succeeded = False
                return []
        if rehearse:
            t0 = self.clock()
            for inst in started:
                await self._tell(inst, "rehearsing")
                self._set(inst, "rehearsing")
            checks = await asyncio.gather(*(
                rehearsal.rehearse(self._probe_pool, i.planned, i.url, self.time_scale,
                                   self.probe_overhead_s, self.rehearsal_tolerance)
                for i in started
            ))  # fmt: skip
            out.rehearsal.extend(checks)
            out.phases_s["rehearse" + phase_suffix] = self.clock() - t0
            missed = [c for c in checks if not c["passed"]]
            if missed:
                await self._stop(started)
                out.succeeded = False
                out.reason = "rehearsal missed: " + "; ".join(c["why"] for c in missed)
                return []
        t0 = self.clock()
        for inst in started:
            await self._tell(inst, "active")
            running[inst.key] = inst
            out.started.append(inst.key)
            self._set(inst, "active")
        out.phases_s["switch" + phase_suffix] = self.clock() - t0
        return started

    async def _retire(
        self,
        cluster: Cluster,
        leaving: Sequence[LiveInstance],
        running: dict[str, LiveInstance],
        started: Sequence[LiveInstance],
        out: ShiftOutcome,
        phase_suffix: str = "",
    ) -> None:
        if not leaving:
            return
        t0 = self.clock()
        for inst in leaving:
            self._set(inst, "draining")
        # No new requests from here on. What would still run at the deadline moves now, while
        # the other instances still have the free slots this one's traffic is about to take
        # (in waves: one destination prefills one move after another, and a request keeps
        # generating here until its turn); the rest finishes in place by the deadline or is
        # moved after it.
        in_flight = await asyncio.gather(*(self._in_flight(i) for i in leaving))
        # the deadline in modelled seconds, as the performance model's token intervals
        deadline_s = self.drain_deadline_s / self.time_scale if self.time_scale > 0 else math.inf
        stop = asyncio.Event()
        early = asyncio.ensure_future(
            self._move_off(cluster, leaving, running, leaving, out, deadline_s, stop)
        )
        drained = await asyncio.gather(
            *(self._drain(i, self.drain_deadline_s) for i in leaving), return_exceptions=True
        )
        stop.set()  # no wave starts after the deadline: what is left moves below
        num_moved = await early
        out.phases_s["drain" + phase_suffix] = self.clock() - t0
        t0 = self.clock()
        left = [i for i, ok in zip(leaving, drained, strict=True) if ok is not True]
        num_moved += await self._move_off(cluster, left, running, leaving, out)
        await asyncio.gather(*(self._drain(i, 10.0) for i in leaving))  # moved ones leave at once
        out.count("finished_in_place", max(0, sum(in_flight) - num_moved))
        out.phases_s["migrate" + phase_suffix] = self.clock() - t0
        t0 = self.clock()
        await self._stop(list(leaving))  # and out of the gateway's pool: gone
        for inst in leaving:
            running.pop(inst.key, None)
            out.stopped.append(inst.key)
        out.phases_s["release" + phase_suffix] = self.clock() - t0

    async def _in_flight(self, inst: LiveInstance) -> int:
        """Stop routing to `inst` and count the requests it still runs (0 if unknown)."""
        await self._drain(inst, 0.0)
        try:
            return len(await self.gateway.requests_on(inst.url))
        except GatewayError:
            return 0

    async def _drain(self, inst: LiveInstance, wait_s: float) -> bool:
        try:
            return await self.gateway.drain(inst.url, wait_s)
        except GatewayError as exc:
            log.warning("drain of %s: %s", inst.url, exc)
            return False

    async def _move_off(
        self,
        cluster: Cluster,
        sources: Sequence[LiveInstance],
        running: dict[str, LiveInstance],
        leaving: Sequence[LiveInstance],
        out: ShiftOutcome,
        outliving_s: float | None = None,
        stop: asyncio.Event | None = None,
    ) -> int:
        """Move what runs on `sources` to live instances of their models (with `outliving_s`:
        only what would still run that long from now), all of a model planned together
        (`plan_moves`: where each pauses least, the wait for a free slot there counted, and
        when, so that no move waits paused behind another on the same destination or link),
        carried out wave by wave at the planned times until `stop` is set. Returns how many
        requests moved, or were still running with nowhere to go (the gateway continues
        them when their instance stops)."""
        if not sources:
            return 0
        gone = {i.key for i in leaving}
        found = await asyncio.gather(*(self._requests_on(i) for i in sources))
        horizon_s = math.inf if outliving_s is None else outliving_s
        planned: list[tuple[PlannedMove, LiveInstance, LiveInstance]] = []
        stream_ids: dict[int, Any] = {}
        num_stuck = 0
        for model in sorted({i.planned.model for i in sources}):
            reqs: list[MoveRequest] = []
            from_url: dict[int, LiveInstance] = {}
            for src, src_reqs in zip(sources, found, strict=True):
                if src.planned.model != model:
                    continue
                interval_s = decode_interval_s(cluster, src.planned, src_reqs)
                if outliving_s is not None:
                    src_reqs = [r for r in src_reqs
                                if outlives(tokens_left(r), interval_s, outliving_s)]  # fmt: skip
                for r in src_reqs:
                    reqs.append(MoveRequest(int(r["id"]), context_tokens(r), src.url, interval_s))
                    from_url[int(r["id"])] = src
                    stream_ids[int(r["id"])] = r.get("request_id")
            targets = [
                i for k, i in running.items()
                if i.planned.model == model and i.state == "active" and k not in gone
            ]  # fmt: skip
            if not targets:
                num_stuck += 0 if outliving_s is not None else len(reqs)
                continue
            destinations = await asyncio.gather(
                *(self._destination(cluster, sources, t) for t in targets)
            )
            by_url = {t.url: t for t in targets}
            for m in plan_moves(reqs, destinations, horizon_s, warm=self.warm_moves):
                planned.append((m, from_url[m.id], by_url[m.destination]))
        num_moved = 0
        t0 = self.clock()
        waves: dict[float, list[tuple[PlannedMove, LiveInstance, LiveInstance]]] = {}
        for item in planned:  # moves planned within 10 ms of each other go together
            waves.setdefault(round(item[0].at_s, 2), []).append(item)
        for at_s in sorted(waves):
            wait_s = at_s * self.time_scale - (self.clock() - t0)
            if stop is not None and wait_s > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await stop.wait()
            elif wait_s > 0:
                await asyncio.sleep(wait_s)
            if stop is not None and stop.is_set():
                break
            when = "before the drain deadline" if outliving_s is not None else "at the deadline"
            num_moved += await self._move_wave(cluster, waves[at_s], stream_ids, out, when)
        return num_moved + num_stuck

    async def _move_wave(
        self,
        cluster: Cluster,
        wave: Sequence[tuple[PlannedMove, LiveInstance, LiveInstance]],
        stream_ids: dict[int, Any],
        out: ShiftOutcome,
        when: str,
    ) -> int:
        """One batch of moves through the gateway; one line per source says what moved, and
        per request (by the stream id its client sees) the pause it was priced at, how it
        moved, the warm-up's outcome for a recompute and where it went:
        `chatcmpl-1=42ms:recompute:warmed@http://127.0.0.1:4321`."""
        moves = []
        for m, src, dst in wave:
            move: dict[str, Any] = {"id": m.id, "method": m.choice.method, "target": dst.url}
            if m.choice.method == "recompute":  # the gateway's pre-copy: bounded, in wall s
                move["warm_timeout_s"] = warm_timeout_s(
                    m.choice.done_s, self.time_scale, self.warm_moves
                )
            link = link_between(cluster, src.planned, dst.planned)
            if link is not None:
                move["bandwidth_bytes_per_s"] = link.bandwidth_bytes_per_s
                move["latency_s"] = link.latency_s
            moves.append(move)
        t0 = self.clock()
        at_wall_s = time.time()  # in the line: its readers see it later than it happened
        try:
            results = await self.gateway.move(moves)
        except GatewayError as exc:
            log.warning("moves: %s", exc)
            return len(moves)
        took_s = self.clock() - t0
        source_of = {m.id: src.url for m, src, _ in wave}
        priced_s = {m.id: m.choice.pause_s for m, _, _ in wave}
        target_of = {m.id: dst.url for m, _, dst in wave}
        by_source: dict[str, tuple[dict[str, int], list[str]]] = {}
        for r in results:
            outcome = str(r.get("outcome"))
            if outcome == "not_running":
                continue
            out.count(outcome)
            counts, ids = by_source.setdefault(source_of[int(r["id"])], ({}, []))
            counts[outcome] = counts.get(outcome, 0) + 1
            if r.get("warmed"):
                counts["warmed"] = counts.get("warmed", 0) + 1
            call_id = int(r["id"])
            how = outcome if r.get("warm") is None else f"{outcome}:{r['warm']}"
            ids.append(f"{stream_ids.get(call_id) or '-'}={priced_s[call_id] * 1e3:.0f}ms:"
                       f"{how}@{target_of[call_id]}")  # fmt: skip
        for url, (counts, ids) in by_source.items():
            self.on_moves(
                f"controller: moved {len(ids)} request(s) off {url} {when} "
                f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}) at "
                f"{at_wall_s:.3f} in {took_s:.3f} s: {' '.join(ids)}"
            )
        return sum(len(ids) for _, ids in by_source.values())

    async def _requests_on(self, inst: LiveInstance) -> list[dict[str, Any]]:
        try:
            return await self.gateway.requests_on(inst.url)
        except GatewayError:
            return []

    async def _destination(
        self, cluster: Cluster, sources: Sequence[LiveInstance], target: LiveInstance
    ) -> Destination:
        """`target` as a move destination: its slots, the time left of what it serves and
        the link from each source."""
        reqs = await self._requests_on(target)
        sources_of = [(src.url, src.planned) for src in sources]
        return destination_of(cluster, sources_of, target.url, target.planned, reqs)

    async def _tell(self, inst: LiveInstance, state: str) -> None:
        """The gateway's pool follows the instance's lifecycle (a gateway that lost it, or is
        gone, learns it again from the controller's next tick)."""
        try:
            await self.gateway.set_state(inst.url, state)
        except GatewayError as exc:
            log.warning("gateway: %s %s: %s", inst.url, state, exc)

    async def _stop(self, instances: Sequence[LiveInstance]) -> None:
        await asyncio.gather(*(i.handle.stop() for i in instances), return_exceptions=True)
        for inst in instances:
            with contextlib.suppress(GatewayError):  # out of the pool (if it is there)
                await self.gateway.remove(inst.url)
            self._set(inst, "gone")
