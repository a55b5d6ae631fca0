"""`simulate(scenario)`: the scenario's workload through the same gateway router and engine
cores as the live system, on a virtual clock, under one policy.

Order of a run: requests are generated (pure, seeded), the policy decides the first plan at
t = 0, each instance cold-starts for its modelled load time (none for the first plan under
`start: {warm: true}`: flexpipe.sim.start) and joins the gateway's pool,
arrivals are routed as they come, and after `duration_s` no new request arrives; the run
goes on until every accepted request has ended (at most `max_drain_s` more: whatever is still
running then fails as "unfinished"). Every request ends completed or failed.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from flexpipe.cluster import Cluster
from flexpipe.control.core.instance_names import unique_name
from flexpipe.engine.request import EngineRequest
from flexpipe.engine.sleep import SleepState
from flexpipe.gateway.core.cut_over import fence_until_s
from flexpipe.lifecycle import State
from flexpipe.policies.planner import (
    ModelDemand,
    PlannedInstance,
    plan,
)
from flexpipe.sim.arrivals import generate_requests, model_demands
from flexpipe.sim.colocation import Colocation
from flexpipe.sim.controller import SimController
from flexpipe.sim.deployment import Deployment
from flexpipe.sim.engine_factory import engine_config
from flexpipe.sim.gateway import SimGateway
from flexpipe.sim.instance import SimInstance
from flexpipe.sim.instance_record import InstanceRecord
from flexpipe.sim.loop import ARRIVAL, CONTROL, EventLoop, relaxed_gc
from flexpipe.sim.moves import MoveRecord, Moves
from flexpipe.sim.policy import Policy, PolicyView, ShiftingPolicy, create_policy
from flexpipe.sim.request import SimRequest
from flexpipe.sim.scenario import Scenario
from flexpipe.sim.start import start_demands
from flexpipe.sim.timeline import apply_event
from flexpipe.sim.unplaced import explain_unplaced
from flexpipe.sim.usage import Usage

MAX_DRAIN_S = 3600.0


@dataclass
class SimResult:
    scenario: Scenario
    policy: str
    routing: str
    demands: tuple[ModelDemand, ...]
    requests: list[SimRequest]
    instances: list[InstanceRecord]
    usage: Usage
    end_s: float = 0.0
    num_events: int = 0
    notes: list[str] = field(default_factory=list)
    shifts: list[dict[str, Any]] = field(default_factory=list)  # shifts carried out
    decisions: list[dict[str, Any]] = field(default_factory=list)  # taken, or held on a trigger
    num_decisions: int = 0
    resource_events: list[dict[str, Any]] = field(default_factory=list)  # the controller's
    failovers: dict[str, int] = field(default_factory=dict)  # requests moved off dead engines
    num_moves: dict[int, int] = field(default_factory=dict)  # request id -> times moved
    peak_gpus: int = 0  # GPUs of the plan sized for the peak (the peak-provisioning baseline)
    wall_s: float = 0.0  # not in the byte-identical reports
    warm_ups: dict[str, int] = field(default_factory=dict)  # outcome -> pre-copies of moves
    moves: list[MoveRecord] = field(default_factory=list)  # in the order they cut over


class _Run:
    def __init__(
        self, scenario: Scenario, policy: Policy, stretches: bool, requests: list[SimRequest]
    ) -> None:
        self.scenario = scenario
        self.policy = policy
        self.stretches = stretches
        self.loop = EventLoop()
        self.rng = random.Random(scenario.seed)
        gw_cfg = scenario.gateway
        if policy.routing is not None and policy.routing != gw_cfg.policy:
            gw_cfg = replace(gw_cfg, policy=policy.routing, policy_params={})
        self.routing = gw_cfg.policy
        self.gateway = SimGateway(gw_cfg, self.loop, random.Random(gw_cfg.seed), self._ended)
        self.requests = requests
        self.demands, self.peaks = model_demands(scenario, requests)
        self.usage = Usage(scenario.duration_s, scenario.report_interval_s)
        self.colocation = Colocation()  # engines sharing a GPU slow each other (sim/colocation.py)
        self.file = scenario.cluster  # the cluster file as the timeline has changed it
        self.records: list[InstanceRecord] = []  # every instance launched, in order
        self.live: dict[str, InstanceRecord] = {}  # deployment name -> record, in the plan
        self.draining: list[InstanceRecord] = []
        self.notes: list[str] = []
        self.num_open = 0  # requests submitted and not ended
        self.shifts: list[dict[str, Any]] = []
        self.failovers: dict[str, int] = {}
        self._names: set[str] = set()
        self._failed_over: set[int] = set()  # requests whose engine died under them
        self._num_events_applied = 0  # resource timeline events that happened (in time order)
        self.moves = Moves(self.loop, self.gateway, self._check_empty)
        self._empty_waits: list[tuple[tuple[InstanceRecord, ...], Callable[[float], None]]] = []
        self.controller: SimController | None = None
        if isinstance(policy, ShiftingPolicy):
            # The controller plans for the rate it measures over a short window: the
            # burstiness that matters is the one within such a window (the busiest report
            # interval's), not the run's, which counts the bursts themselves.
            within = tuple(
                replace(d, arrival_cv2=p.arrival_cv2)
                for d, p in zip(self.demands, self.peaks, strict=True)
            )
            start = scenario.start
            self.controller = SimController(
                self,
                scenario.cluster,
                within,
                lambda: [i.as_dict() for i in self.gateway.pool.instances.values()],
                lambda: self.gateway.num_waiting,
                self.gateway.queued_by_model,
                replace(policy.params or scenario.controller, planner=scenario.planner),
                random.Random(f"{scenario.seed}:controller"),
                self.shifts.append,
                start_demands(within, requests, start.expected_window_s),
            )

    # --- the static policies ----------------------------------------------------------
    def _decide(self, now: float) -> None:
        running = tuple(r.dep for r in self.live.values())
        view = PolicyView(self.file, self.demands, self.peaks, running, *self._observed())
        wanted = self.policy.decide(view, now, self.rng)
        if wanted is not None:
            self._apply_plan(list(wanted), now)
        if getattr(self.policy, "buffers_at_zero", False):
            self._buffer_at_zero(now)
        if self.policy.interval_s is not None:
            self.loop.at(now + self.policy.interval_s, CONTROL, self._decide)

    def _observed(self) -> tuple[dict[str, int], frozenset[str], frozenset[str]]:
        """What a reactive policy observes (`PolicyView`): requests in flight per model (on
        its engines, and waiting at the gateway), the deployments taking requests, and the
        GPUs still held by draining instances."""
        in_flight = dict(self.gateway.queued_by_model())
        for inst in self.gateway.pool.instances.values():
            if inst.model is not None:
                in_flight[inst.model] = in_flight.get(inst.model, 0) + inst.num_in_flight
        ready = frozenset(n for n, r in self.live.items() if r.active)
        draining = frozenset(g for r in self.draining for g in r.dep.gpu_ids)
        return in_flight, ready, draining

    def _buffer_at_zero(self, now: float) -> None:
        """Knative's activator: a model with no instance in the pool is held (its requests
        wait for one) until the next decision, and then again while it has none."""
        assert self.policy.interval_s is not None
        for demand in self.demands:
            if not self.gateway.pool.has_model(demand.name):
                self.gateway.hold(demand.name, 2 * self.policy.interval_s, now)

    def _apply_plan(self, wanted: list[Deployment], now: float) -> None:
        names = {d.name for d in wanted}
        for name in [n for n in self.live if n not in names]:
            self._stop(self.live.pop(name), now)
        for dep in wanted:
            if dep.name in self.live:
                continue
            rec = self._new_record(dep, now)
            if isinstance(rec, str):
                self.notes.append(f"{dep.name} cannot run: {rec}")
                continue
            self.live[dep.name] = rec
            self.loop.at(rec.ready_s, CONTROL, functools.partial(self._ready, rec))

    def _new_record(
        self, dep: Deployment, now: float, planned: PlannedInstance | None = None
    ) -> InstanceRecord | str:
        max_len = {d.name: d.max_model_len for d in self.demands}
        try:
            cfg = engine_config(dep, self.cluster, max_len.get(dep.model))
        except ValueError as exc:
            return str(exc)
        inst = SimInstance(
            dep,
            cfg,
            self.loop,
            self._engine_done,
            self.usage.on_busy(dep.gpu_ids, dep.gpu_memory_fraction is not None),
            stretches=self.stretches,
            on_first_token=self._first_token,
            colocation=self.colocation,
        )
        # deployed before the traffic (`start: {warm: true}`): loaded by t = 0
        warm = self.scenario.start.warm and now <= 0.0
        rec = InstanceRecord(
            dep,
            now,
            now if warm else now + cfg.load_time_s,
            num_kv_blocks=cfg.num_kv_blocks,
            max_model_len=cfg.max_model_len,
            instance=inst,
            planned=planned,
        )
        self.records.append(rec)
        self._names.add(dep.name)
        return rec

    def _ready(self, rec: InstanceRecord, now: float) -> None:
        if rec.stopped_s < 0 and rec.released_s < 0:  # still wanted once loaded
            assert rec.instance is not None
            rec.active = True
            self.gateway.add_instance(rec.instance, now)

    def _stop(self, rec: InstanceRecord, now: float) -> None:
        """Drain: out of routing now; the GPUs are held until its last request ends."""
        self.stop_routing(rec, now)
        self.draining.append(rec)
        self._release_drained(now)

    def _release_drained(self, now: float) -> None:
        for rec in [r for r in self.draining if r.instance and not r.instance.requests]:
            self.draining.remove(rec)
            self.release(rec, now)

    # --- the controller's world (shift_run.World) -------------------------------------
    @property
    def cluster(self) -> Cluster:
        return self.controller.cluster if self.controller is not None else self.file

    def launch(self, planned: PlannedInstance, now: float) -> InstanceRecord | str:
        dep = replace(Deployment.of(planned), name=unique_name(planned.name, self._names))
        return self._new_record(dep, now, planned)

    def set_state(self, rec: InstanceRecord, state: State, now: float) -> None:
        """The executor's word to the gateway's admin API: starting registers the loaded
        engine (with its gear's max_num_seqs, not routed), then rehearsing, active."""
        assert rec.instance is not None
        url = rec.instance.url
        if state is State.STARTING:
            self.gateway.add_instance(rec.instance, now, rec.dep.gear.max_num_seqs, state)
            return
        if state is State.DRAINING:
            self.stop_routing(rec, now)
        elif state is State.GONE:
            self.release(rec, now)
        else:
            rec.active = state is State.ACTIVE
            self.gateway.set_state(url, state, now)

    def sleep(self, rec: InstanceRecord, level: int, now: float) -> float:
        """Put a drained engine to sleep (the gateway lists it asleep; its GPUs stay held,
        with what vLLM keeps of them asleep: `SleepState.gpu_memory_bytes`); the modelled
        seconds it takes."""
        assert rec.instance is not None
        state = rec.sleep or SleepState(rec.instance.cfg.pm)
        tags, duration_s = state.sleep_plan(level)
        state.apply_sleep(level, tags, duration_s)
        rec.sleep = state
        rec.active = False
        self.gateway.set_state(rec.instance.url, State.ASLEEP, now)
        held = [state.gpu_memory_bytes, state.host_memory_bytes]
        rec.asleep_spans.append([now, -1.0, float(level), *held])
        return duration_s

    def wake(self, rec: InstanceRecord, now: float) -> float | str:
        """Wake a sleeping engine: the modelled seconds it takes (waking meanwhile), or why
        it cannot (its engine died with its GPUs)."""
        if rec.released_s >= 0 or rec.instance is None or rec.sleep is None:
            return f"instance {rec.dep.name} cannot wake: {rec.died or 'it was released'}"
        tags, duration_s = rec.sleep.wake_plan(None)
        rec.sleep.apply_wake(tags, duration_s)
        rec.asleep_spans[-1][1] = now
        self.gateway.set_state(rec.instance.url, State.WAKING, now)
        return duration_s

    def hold(self, model: str, seconds: float, now: float) -> None:
        self.gateway.hold(model, seconds, now)

    def refuse(self, model: str, reason: str, seconds: float, now: float) -> None:
        self.gateway.refuse(model, reason, seconds, now)

    def stop_routing(self, rec: InstanceRecord, now: float) -> list[SimRequest]:
        rec.stopped_s = now
        rec.active = False
        assert rec.instance is not None
        if rec.instance.url in self.gateway.pool.instances:
            self.gateway.drain_instance(rec.instance.url)
        return self.requests_on(rec)

    def requests_on(self, rec: InstanceRecord) -> list[SimRequest]:
        """The requests `rec`'s engine serves for the gateway (its warm-ups are not)."""
        if rec.instance is None:
            return []
        reqs = rec.instance.requests
        warming = self.moves.warming
        if warming:
            return [r for k, r in reqs.items() if k not in warming]
        return list(reqs.values())

    def warm_up(
        self,
        req: SimRequest,
        source: InstanceRecord,
        target: InstanceRecord,
        timeout_s: float,
        now: float,
        done: Callable[[str, float], None],
    ) -> None:
        self.moves.warm_up(req, source, target, timeout_s, now, done)

    def awaits_first_token(self, rec: InstanceRecord) -> bool:
        return self.moves.awaits_first_token(rec)

    def fence(self, req: SimRequest, rec: InstanceRecord, wait_s: float, now: float) -> None:
        """New requests keep off `rec` while `req`'s move cuts over to it (the gateway's
        `gateway.moves.fence_target`: until its first token there, `_first_token`; at most
        the wait, then two of its steps)."""
        inst = rec.instance
        pool = self.gateway.pool
        if inst is None or inst.url not in pool.instances:
            return
        speed = pool.instances[inst.url].speed_tokens_per_s
        root = self.moves.roots.get(req.request_id, req)
        pool.fence(inst.url, root.request_id, fence_until_s(now, wait_s, speed), now)

    def _engine_done(
        self, inst: SimInstance, req: SimRequest, ereq: EngineRequest, now: float
    ) -> None:
        """An engine ended a request: a warm-up's end goes to its move, the rest to the
        gateway."""
        if not self.moves.warm_up_ended(ereq, now):
            self.gateway.done(inst, req, ereq, now)

    def _first_token(
        self, inst: SimInstance, req: SimRequest, ereq: EngineRequest, now: float
    ) -> None:
        """A first token: the client's TTFT, observed now, as the live gateway observes it
        when the token streams out (not when the request ends: the controller's latency
        window would lag by the request's decode). Not a warm-up's, nor a continuation's
        when its client had a token before the move. A move's continuation lifts its fence
        on the instance (`fence`)."""
        if ereq.request_id in self.moves.warming:
            return
        root = self.moves.roots.get(req.request_id, req)
        if root is not req:  # a move's continuation: its fence there is through
            self.gateway.pool.unfence(inst.url, root.request_id)
        if self.controller is None:
            return
        if root.first_token_s < 0:
            self.controller.first_token(root.model, now - root.arrival_s)

    def when_empty(self, recs: Sequence[InstanceRecord], callback: Callable[[float], None]) -> None:
        self._empty_waits.append((tuple(recs), callback))

    def release(self, rec: InstanceRecord, now: float) -> None:
        if rec.released_s >= 0:
            return
        rec.released_s = now
        rec.active = False
        if rec.stopped_s < 0:
            rec.stopped_s = now
        assert rec.instance is not None
        self.colocation.leave(rec.instance)
        if rec.instance.url in self.gateway.pool.instances:
            self.gateway.remove_instance(rec.instance.url)

    def context_tokens(self, req: SimRequest, rec: InstanceRecord) -> tuple[int, int]:
        """(prompt, output so far) of `req` on `rec`'s engine."""
        assert rec.instance is not None
        rec.instance.sync(self.loop.now_s)
        rid = str(req.request_id)
        s = rec.instance.core.scheduler
        ereq = next((r for r in (*s.running, *s.waiting) if r.request_id == rid), None)
        if ereq is None:
            return req.num_prompt_tokens, 0
        s.materialize(ereq)
        return req.num_prompt_tokens, ereq.num_output_tokens

    def move(
        self,
        req: SimRequest,
        source: InstanceRecord,
        target: InstanceRecord | None,
        method: str,
        delay_s: float,
        now: float,
        warm: str | None = None,
    ) -> None:
        self.moves.move(req, source, target, method, delay_s, now, warm)

    # --- the resource timeline ---------------------------------------------------------
    def _resources(self, index: int, now: float) -> None:
        event = self.scenario.resources[index]
        self._num_events_applied += 1
        self.file = apply_event(self.file, event)
        if self.controller is not None:
            self.controller.file_changed(self.file, now)
        # engines on GPUs gone or taken whole die with them
        for rec in self.records:
            if rec.released_s >= 0 or rec.instance is None:
                continue
            why = self._lost(rec)
            if why:
                self._kill(rec, now, why)

    def _lost(self, rec: InstanceRecord) -> str:
        ids = set(self.file.gpu_ids)
        for g in rec.dep.gpu_ids:
            if g not in ids:
                return f"{g} failed"
            gpu = self.file.gpu(g)
            if gpu.free_bytes <= 0:
                return f"{g} taken by {gpu.owner or 'another tenant'}"
        return ""

    def _kill(self, rec: InstanceRecord, now: float, why: str) -> None:
        """The engine died with its GPUs: the gateway continues its streams elsewhere by
        recompute (or sends them again when nothing was answered yet)."""
        rec.died = why
        reqs = self.requests_on(rec)
        assert rec.instance is not None
        url = rec.instance.url
        if url in self.gateway.pool.instances:
            self.gateway.remove_instance(url)  # out of routing first: nothing new lands there
        for req in reqs:
            _, n = self.context_tokens(req, rec)
            method = "recomputed" if n else "rerun"
            self.failovers[method] = self.failovers.get(method, 0) + 1
            self._failed_over.add((self.moves.roots.get(req.request_id, req)).request_id)
            self.move(req, rec, None, method, 0.0, now)
        self.moves.target_died(rec, now)
        self.release(rec, now)
        self.live.pop(rec.dep.name, None)
        if rec in self.draining:
            self.draining.remove(rec)
        if self.controller is not None:
            self.controller.instance_died(rec, now)
        self._check_empty(now)

    # --- work ----------------------------------------------------------------------------
    def _ended(self, req: SimRequest) -> None:
        root = self.moves.roots.pop(req.request_id, None)
        if root is not None:  # a continuation ended: so did the client's request
            if root.first_token_s < 0 and req.first_token_s >= 0:
                root.first_token_s = req.first_token_s
            if req.num_generated_tokens:
                root.last_token_s = req.last_token_s
            root.num_generated_tokens += req.num_generated_tokens
            root.num_cached_tokens += req.num_cached_tokens
            root.num_preemptions += req.num_preemptions
            root.finish_s = req.finish_s
            root.instance = req.instance
            if req.failed:
                lost = " (its instance was lost)" if root.request_id in self._failed_over else ""
                root.failed = f"{req.failed}{lost}"
            req = root
        self.num_open -= 1
        if self.controller is not None:
            self.controller.request_ended(req)
        if self.draining:
            self._release_drained(req.finish_s)
        if self._empty_waits:
            self._check_empty(req.finish_s)

    def _check_empty(self, now: float) -> None:
        for wait in list(self._empty_waits):
            recs, callback = wait
            if all(not self.requests_on(r) for r in recs):
                self._empty_waits.remove(wait)
                callback(now)

    def _arrive(self, index: int, now: float) -> None:
        req = self.requests[index]
        self.num_open += 1
        self.gateway.submit(req, now)
        if index + 1 < len(self.requests):
            nxt = self.requests[index + 1]
            self.loop.at(nxt.arrival_s, ARRIVAL, functools.partial(self._arrive, index + 1))

    def run(self, progress: Callable[[float], None] | None) -> SimResult:
        scenario = self.scenario
        if self.controller is not None:
            self.loop.at(0.0, CONTROL, self.controller.start)
        else:
            self.loop.at(0.0, CONTROL, self._decide)
        for i, ev in enumerate(scenario.resources):
            self.loop.at(ev.at_s, CONTROL, functools.partial(self._resources, i))
        if self.requests:
            first = self.requests[0].arrival_s
            self.loop.at(first, ARRIVAL, functools.partial(self._arrive, 0))
        t = 0.0
        step = scenario.report_interval_s
        while t < scenario.duration_s:
            t = min(scenario.duration_s, t + step)
            self.loop.run(t)
            if progress is not None:
                progress(t)
        end = scenario.duration_s
        while self.num_open > 0 and end < scenario.duration_s + MAX_DRAIN_S:
            end += step
            self.loop.run(end)
        for req in self.requests:
            if req.finish_s < 0:
                req.failed = "unfinished: still running when the run ended"
                req.finish_s = end
        # the run ends with the last thing that happened in it (the last request's end, a
        # release, a step), at the duration at the earliest: GPUs held until then are
        # billed, as is every step computed
        run_end_s = max(
            [
                scenario.duration_s,
                self.usage.last_busy_s,
                *(r.finish_s for r in self.requests),
                *(r.released_s for r in self.records),
            ]
        )
        for rec in self.records:
            stop = rec.released_s if rec.released_s >= 0 else run_end_s
            start = rec.launched_s
            shared = rec.dep.gpu_memory_fraction is not None  # (a shared GPU billed once)
            for t0, t1, _, gpu_bytes, host_bytes in rec.asleep_spans:  # awake apart from asleep
                end = t1 if t1 >= 0 else stop
                self.usage.hold(rec.dep.gpu_ids, shared, start, t0)
                self.usage.asleep(rec.dep.num_gpus, t0, end, gpu_bytes, host_bytes)
                start = end
            self.usage.hold(rec.dep.gpu_ids, shared, start, stop)
        self.usage.close(run_end_s)
        for ev in scenario.resources[self._num_events_applied :]:  # (sorted by time)
            self.notes.append(
                f"resources: {ev.describe()} at {ev.at_s:g} s did not happen: the run ended at "
                f"{run_end_s:g} s"
            )
        ctl = self.controller
        if ctl is not None and ctl.shifting_since is not None:
            self.notes.append(
                f"a shift started at {ctl.shifting_since:.1f} s was still in progress at the end"
            )
        peak = plan(scenario.cluster, self.peaks, now_s=0.0)
        placed = [r.dep.model for r in self.records]
        self.notes += explain_unplaced(self.policy.name, self.demands, placed, self.requests, peak)
        if not self.records and not self.notes:
            self.notes.append(f"policy {self.policy.name} runs no instance on this cluster")
        return SimResult(
            scenario,
            self.policy.name,
            self.routing,
            self.demands,
            self.requests,
            list(self.records),
            self.usage,
            max((r.finish_s for r in self.requests), default=0.0),
            self.loop.num_events,
            self.notes,
            self.shifts,
            ctl.decisions if ctl else [],
            ctl.num_decisions if ctl else 0,
            ctl.resource_events if ctl else [],
            dict(sorted(self.failovers.items())),
            self.moves.num_moves,
            sum(i.num_gpus for i in peak.instances),
            warm_ups=dict(sorted(self.moves.warm_ups.items())),
            moves=self.moves.log,
        )


def simulate(
    scenario: Scenario,
    policy: str | Policy | None = None,
    *,
    stretches: bool = True,
    progress: Callable[[float], None] | None = None,
    log: list[tuple[float, str, str]] | None = None,
) -> SimResult:
    """Run `scenario` under `policy` (default: the scenario's). `stretches=False` steps every
    engine iteration as its own event (the reference the closed form is checked against).
    `log`: a list that receives the gateway's events (time, event, detail) in order."""
    pol = policy if policy is not None and not isinstance(policy, str) else None
    pol = pol or create_policy(policy if isinstance(policy, str) else scenario.policy, scenario)
    requests = generate_requests(scenario)
    run = _Run(scenario, pol, stretches, requests)
    run.gateway.log = log  # the gateway's events, in order, when a list is given
    t0 = time.perf_counter()
    with relaxed_gc():
        result = run.run(progress)
    result.wall_s = time.perf_counter() - t0
    return result


__all__ = ["InstanceRecord", "SimResult", "generate_requests", "model_demands", "simulate"]
