"""Carrying out one shift on the virtual clock: the simulator's driver of the shift procedure
(`flexpipe/control/core/shift_procedure.py`, the same one the live executor drives; it decides
every step, docs/controller.md). Here each of its commands is carried out on the event loop:

- warm: the new instances start; they are loaded after the performance model's cold start
  (as the sim engine sleeps it); an engine dies with its GPUs meanwhile;
- rehearse: one probe per new instance, run on a copy of its engine core (`rehearse`); its
  modelled time is how long the rehearsal takes;
- the gateway's pool follows the lifecycle the procedure sets (starting, rehearsing, active,
  draining, gone);
- a drain waits until the instances are empty or the deadline, while the early waves of moves
  go out at their times; a wave is the simulated gateway's moves (`sim.moves.GatewayMoves`:
  a KV move fenced until its KV is across, a recompute pre-copied and cut over at its
  source's next token), answered once its pre-copies cut over;
- release: their GPUs are free;
- sleep: drained engines (their requests finished first, as vLLM's `mode=wait`) sleep for
  the performance model's sleep time and keep their GPUs; wake: a sleeping engine is back
  after the modelled wake time (`World.sleep`, `World.wake`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, Protocol

from flexpipe.cluster import Cluster
from flexpipe.control.core.shift_commands import (
    AwaitReady,
    Command,
    Continue,
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
    Survey,
    Surveyed,
    Wait,
    Wake,
    Wave,
)
from flexpipe.control.core.shift_outcome import ShiftOutcome
from flexpipe.control.core.shift_plan import probe_tokens, rehearsal_check
from flexpipe.control.core.shift_procedure import InPlaceChooser, ShiftParams, ShiftProcedure
from flexpipe.engine.request import EngineRequest, SamplingParams
from flexpipe.gateway.core.holds import STANDBY_HOLD_S
from flexpipe.lifecycle import State
from flexpipe.model_spec import load_model_spec
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.sim.engine_factory import engine_core
from flexpipe.sim.loop import CONTROL, EventLoop
from flexpipe.sim.moves import GatewayMoves
from flexpipe.sim.request import SimRequest
from flexpipe.sim.stretch import SIM_GEN_IDS

__all__ = ["ShiftOutcome", "ShiftRun", "World", "rehearse"]

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

    def sleep(self, rec: Any, level: int, now: float) -> float: ...  # modelled seconds

    def wake(self, rec: Any, now: float) -> float | str: ...  # modelled seconds, or why not

    def hold(self, model: str, seconds: float, now: float) -> None: ...  # the admin API's

    def refuse(self, model: str, reason: str, seconds: float, now: float) -> None: ...  # admin

    def context_tokens(self, req: SimRequest, rec: Any) -> tuple[int, int]: ...


def _as_gateway(req: SimRequest, num_prompt: int, num_out: int) -> dict[str, Any]:
    """`req` as the gateway's `GET /admin/requests` lists it (what the executor reads)."""
    return {
        "id": req.request_id,
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_out,
        "max_tokens": req.num_output_tokens,
    }


class _Drain:
    """A drain under way: its early waves carry out until it is over."""

    over = False  # the drain ended (empty, or its deadline): no early wave starts after
    kv_across_s = 0.0  # when the last KV moved before the deadline is across


class ShiftRun:
    """One shift from `running` (key -> record, updated in place) to `target`: the shift
    procedure's commands carried out on the world's event loop; `on_done(outcome, t)` at
    the end."""

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
        standby_hold_s: float = STANDBY_HOLD_S,
        sleepers: dict[str, Any] | None = None,
        sleep_levels: Mapping[str, int] | None = None,
        in_place: InPlaceChooser | None = None,
        in_place_drain_s: float = 2.0,
    ) -> None:
        self.world = world
        self.on_done = on_done
        self.rehearsal_tolerance = rehearsal_tolerance
        params = ShiftParams(
            drain_deadline_s=drain_deadline_s,
            standby_hold_s=standby_hold_s,
            time_scale=1.0,
            warm_moves=warm_moves,
            rehearse=rehearse,
            all_or_nothing=all_or_nothing,
            in_place_drain_s=in_place_drain_s,
        )
        asleep = [r.planned for r in (sleepers or {}).values()]
        planned = [*(r.planned for r in running.values()), *target, *asleep]
        specs = {p.model_id: load_model_spec(p.model_id) for p in planned}
        # the world names its engines (World.launch): the planner's names are kept here
        self.procedure = ShiftProcedure(
            running, target, params, None, specs, sleepers, sleep_levels, in_place
        )
        self._gen: Generator[Command, Reply, ShiftOutcome] | None = None
        self._token = 0  # which wait may resume the procedure (a drain has two ends)
        self._moves = GatewayMoves(world, self._moved, specs)
        self._outcomes: list[str] = []  # of the moves since the last reply
        self._num_moved = 0
        self._requests: dict[int, SimRequest] = {}  # the requests surveyed, by id

    def start(self, now: float) -> None:
        self._gen = self.procedure.run(now)
        self._step(None)

    def _moved(self, method: str) -> None:
        self._outcomes.append(method)
        self._num_moved += 1

    def _take_moved(self, busy_until_s: float = 0.0) -> Moved:
        moved = Moved(tuple(self._outcomes), self._num_moved, busy_until_s)
        self._outcomes, self._num_moved = [], 0
        return moved

    def _step(self, reply: Reply | None) -> None:
        """Run the procedure until a command that takes time; its end resumes it."""
        assert self._gen is not None
        while True:
            try:
                command = next(self._gen) if reply is None else self._gen.send(reply)
            except StopIteration as stop:
                self.on_done(stop.value, self.world.loop.now_s)
                return
            self._token += 1
            value = self._carry_out(command)
            if value is _LATER:
                return
            reply = Reply(self.world.loop.now_s, value)

    def _resume_at(self, time_s: float, value: Any = None) -> None:
        """Resume the procedure with `value` at `time_s` (on the loop)."""
        self.world.loop.at(time_s, CONTROL, self._resumer(lambda: value))

    def _resumer(self, value_of: Callable[[], Any]) -> Callable[[float], None]:
        token = self._token

        def resume(now: float) -> None:
            if token == self._token:  # not a drain wait already resumed by its other end
                self._token += 1
                self._step(Reply(now, value_of()))

        return resume

    def _carry_out(self, command: Command) -> Any:
        world = self.world
        now = world.loop.now_s
        match command:
            case Hold(model, seconds):
                world.hold(model, seconds, now)
                return ""
            case Launch(planned):
                launched = [world.launch(p, now) for p in planned]
                return [Failed(r) if isinstance(r, str) else r for r in launched]
            case AwaitReady(recs):
                ready_s = max(r.ready_s for r in recs)  # (alive: as it is when loaded)
                world.loop.at(
                    now + max(0.0, ready_s - now),
                    CONTROL,
                    self._resumer(lambda: [_alive(r) for r in recs]),
                )
                return _LATER
            case NextReady(recs):
                ready_s = min(r.ready_s for r in recs)
                world.loop.at(
                    now + max(0.0, ready_s - now),
                    CONTROL,
                    self._resumer(lambda: [(r, _alive(r)) for r in recs if r.ready_s == ready_s]),
                )
                return _LATER
            case Join(recs):
                for rec in recs:  # loaded: in the gateway's pool, not routed
                    world.set_state(rec, State.STARTING, now)
                return [""] * len(recs)
            case SetState(recs, state):
                for rec in recs:
                    world.set_state(rec, State(state), now)
                return None
            case Rehearse(recs):
                checks = [
                    rehearse(r.planned, world.cluster, self.rehearsal_tolerance) for r in recs
                ]
                self._resume_at(now + max(c["measured_s"] for c in checks), checks)
                return _LATER
            case StillAlive(recs):
                return [_alive(r) for r in recs]
            case Release(recs):
                for rec in recs:
                    world.release(rec, now)
                return None
            case Wait(seconds):
                self._resume_at(now + seconds)
                return _LATER
            case StopRouting(recs):
                return sum(len(world.stop_routing(rec, now)) for rec in recs)
            case Survey(sources, candidates):
                return self._survey(sources, candidates)
            case Drain(recs, deadline_s, waves):
                return self._drain(recs, deadline_s, waves, now)
            case Move(wave):
                end_s = self._moves.carry(self._orders(wave), now)
                return self._after_moves(lambda: self._take_moved(end_s))
            case Sleep(recs, level):
                return self._sleep(recs, level, now)
            case Wake(recs):
                took = [world.wake(r, now) for r in recs]
                woken = [
                    Failed(t) if isinstance(t, str) else r for r, t in zip(recs, took, strict=True)
                ]
                wake_s = max((t for t in took if not isinstance(t, str)), default=0.0)
                self._resume_at(now + wake_s, woken)
                return _LATER
            case Continue(requests):
                for src, record in requests:  # the gateway continues them wherever it can
                    world.move(self._requests[int(record["id"])], src, None, "recomputed", 0.0, now)
                    self._outcomes.append("recomputed")
                return self._take_moved().outcomes
        raise TypeError(f"not a shift command: {command!r}")

    def _after_moves(self, value_of: Callable[[], Any]) -> Any:
        """The gateway answers once the pre-copies under way cut over."""
        if not self._moves.num_pre_copying:
            return value_of()
        self._moves.when_cut_over(self._resumer(value_of))
        return _LATER

    def _survey(self, sources: Sequence[Any], candidates: Sequence[Any]) -> Surveyed:
        """The requests on `sources` and on the active `candidates` as the gateway's
        `GET /admin/requests` lists them."""
        world = self.world
        found = []
        for src in sources:
            reqs = world.requests_on(src)
            self._requests.update((q.request_id, q) for q in reqs)
            found.append(tuple(_as_gateway(q, *world.context_tokens(q, src)) for q in reqs))
        targets = [c for c in candidates if c.active]
        theirs = [
            (t, tuple(_as_gateway(q, *world.context_tokens(q, t)) for q in world.requests_on(t)))
            for t in targets
        ]
        return Surveyed(world.cluster, tuple(found), tuple(theirs))

    def _orders(self, wave: Wave) -> list[tuple[Any, SimRequest]]:
        return [(m, self._requests[m.id]) for m in wave.moves]

    def _drain(
        self, recs: Sequence[Any], deadline_s: float, waves: Sequence[Wave], now: float
    ) -> Any:
        """Until `recs` are empty or the deadline, the early waves going out meanwhile; then
        until their pre-copies cut over."""
        world = self.world
        drain = _Drain()
        for wave in waves:
            world.loop.at(
                now + wave.at_s, CONTROL, functools.partial(self._early, drain, self._orders(wave))
            )

        def drained() -> Drained:
            empty = tuple(not world.requests_on(r) for r in recs)
            return Drained(empty, self._take_moved(drain.kv_across_s))

        def over() -> Any:
            drain.over = True
            return self._after_moves(drained)

        if not any(world.requests_on(r) for r in recs):
            return over()
        token = self._token

        def end(t: float) -> None:  # empty, or the deadline: whichever comes first
            if token != self._token:
                return
            self._token += 1
            value = over()
            if value is not _LATER:
                self._step(Reply(t, value))

        world.when_empty(recs, end)
        world.loop.at(now + deadline_s, CONTROL, end)
        return _LATER

    def _sleep(self, recs: Sequence[Any], level: int, now: float) -> Any:
        """Once `recs` run nothing (what is left of their requests finishes first, as
        vLLM's `POST /sleep?mode=wait`), they sleep; the procedure resumes when they are."""
        world = self.world
        token = self._token

        def sleep_all(t: float) -> None:
            if token != self._token:
                return
            sleep_s = max(world.sleep(r, level, t) for r in recs)
            self._resume_at(t + sleep_s, list(recs))

        if any(world.requests_on(r) for r in recs):
            world.when_empty(recs, sleep_all)
        else:
            sleep_all(now)
        return _LATER

    def _early(self, drain: _Drain, orders: Sequence[tuple[Any, SimRequest]], now: float) -> None:
        if not drain.over:  # no wave starts after the deadline (what is left moves then)
            drain.kv_across_s = max(drain.kv_across_s, self._moves.carry(orders, now))


_LATER = object()  # a command that takes time: the procedure is resumed when it is done


def _alive(rec: Any) -> Any:
    """`rec`, or why its engine died with its GPUs."""
    if rec.released_s >= 0:
        return Failed(f"instance {rec.dep.name} died starting: {rec.died}")
    return rec


def rehearse(planned: PlannedInstance, cluster: Cluster, tolerance: float) -> dict[str, Any]:
    """The executor's probe, on a fresh copy of the instance's engine core: its modelled time
    against the gear table's prediction (TTFT + TPOT per further token at the full batch)."""
    from flexpipe.sim.deployment import Deployment
    from flexpipe.sim.engine_factory import engine_config

    est = planned.estimate
    n = probe_tokens(est.ttft_s, est.tpot_s, 1.0, PROBE_OVERHEAD_S)
    core = engine_core(engine_config(Deployment.of(planned), cluster))
    probe = EngineRequest(
        "probe", list(range(PROBE_PROMPT_TOKENS)), SamplingParams(max_tokens=n), n, SIM_GEN_IDS
    )
    core.add(probe, 0.0)
    t = 0.0
    while not probe.finished_s and core.has_work:
        plan = core.step(t)
        t += plan.duration_s
        core.complete(plan, t)
    predicted_s = est.ttft_s + est.tpot_s * (n - 1)
    return rehearsal_check(instance_key(planned), probe.finished_s, predicted_s, tolerance)
