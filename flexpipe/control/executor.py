"""Carrying out a shift on the real clock: the live driver of the shift procedure
(`flexpipe/control/core/shift_procedure.py`, which decides every step: make-before-break,
rehearsal, drain and moves, in-place steps, holds, rollback, the outcome).

Here each of its commands is carried out through the launcher and the gateway's admin API:
engines start side by side; the early moves of a drain run at their planned times while the
gateway waits for the drain; a recompute move is pre-copied by the gateway. Cancelled
part-way (the controller stops while engines load), every engine the shift launched that does
not serve yet is stopped before the cancellation goes on: nothing is left for
PR_SET_PDEATHSIG.

Sleep and wake go to the engine's own HTTP endpoints (vLLM's sleep mode, mounted with
`VLLM_SERVER_DEV_MODE=1`): `POST /sleep?level=N&mode=wait` (the requests still on it finish
first, none is lost), `POST /wake_up`. Sleeping instances are kept in `Executor.sleepers`
between shifts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from flexpipe.cluster import Cluster
from flexpipe.control import rehearsal
from flexpipe.control.api.gateway_client import GatewayAdmin, GatewayError
from flexpipe.control.core.instance_names import gather_names
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
from flexpipe.control.core.shift_procedure import (
    ShiftParams,
    ShiftProcedure,
)
from flexpipe.control.core.sleeping import in_place_chooser, leaving_of, sleep_levels
from flexpipe.http.client import ClientPool, Timeouts, UpstreamError
from flexpipe.launch import EngineHandle, EngineSpec, Launcher
from flexpipe.model_spec import load_model_spec
from flexpipe.perf import PerfModel
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.in_place import ROLLING
from flexpipe.policies.shift.migration import link_between, perf_model_of
from flexpipe.policies.shift.snapshot import instance_key

__all__ = ["Executor", "LiveInstance"]

log = logging.getLogger("flexpipe.control")


@dataclass
class LiveInstance:
    """An instance the controller runs: the plan's view and the engine's."""

    planned: PlannedInstance
    handle: EngineHandle
    state: str = "starting"  # a lifecycle state (flexpipe/lifecycle.py)
    store_id: int | None = None
    sleep_level: int = 0  # the level it sleeps at (0: awake)

    @property
    def key(self) -> str:
        return instance_key(self.planned)

    @property
    def url(self) -> str:
        return self.handle.endpoint

    @property
    def cold_start_s(self) -> float:
        return self.handle.cold_start_s


def _print_line(line: str) -> None:
    print(line, flush=True)


SpecOf = Callable[[PlannedInstance], EngineSpec]
OnState = Callable[[LiveInstance, str], None]
Start = asyncio.Future[EngineHandle]
T = TypeVar("T")


class Executor:
    def __init__(
        self,
        launcher: Launcher,
        gateway: GatewayAdmin,
        spec_of: SpecOf,
        *,
        engine_admin_token: str | None = None,
        time_scale: float = 1.0,
        drain_deadline_s: float = 30.0,
        rehearsal_tolerance: float = 2.0,
        probe_overhead_s: float = 0.05,
        standby_hold_s: float = 600.0,
        warm_moves: bool = True,
        kv_moves: bool = True,
        on_state: OnState | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_moves: Callable[[str], None] | None = None,
        sleep_mode: str = "off",
        kind_sleep_levels: tuple[int, ...] = (),
        sleep_timeout_s: float = 600.0,
        cluster_now: Callable[[], Cluster] | None = None,
        in_place: str = ROLLING,
        in_place_drain_s: float = 2.0,
        loads_beside_awake: bool = True,
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
        # both ends can hand a request's KV over (the engine kind's declaration)
        self.kv_moves = kv_moves
        self.on_state = on_state or (lambda inst, state: None)
        self.clock = clock
        # one line per batch of moves (which requests left which instance, how): the
        # controller's output by default, as its other lines
        self.on_moves = on_moves or _print_line
        self._probe_pool = ClientPool(max_idle_per_backend=2)
        # every instance name this deployment had: a new instance gets a name none had
        self.names: set[str] = set()
        # sleep instead of stop (control/core/sleeping.py): the mode, the engine kind's levels
        self.sleep_mode = sleep_mode
        self.kind_sleep_levels = kind_sleep_levels
        self.sleep_timeout_s = sleep_timeout_s  # one sleep or wake-up, wall s
        self.sleepers: dict[str, LiveInstance] = {}  # instance key -> sleeping instance
        # the engine kind starts beside another engine loading on its GPU: else engines that
        # share a GPU launch in waves (control/core/standby_aside.py, `launch_waves`)
        self.loads_beside_awake = loads_beside_awake
        # the GPUs as free to us now (a wake checks nobody took its GPUs since the decision)
        self.cluster_now = cluster_now
        # how an in-place step re-gears (policies/shift/in_place.py); its short drain, in
        # modelled s (scaled to wall s as the drain deadline is)
        self.in_place = in_place
        self.in_place_drain_s = in_place_drain_s

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
        sleepers: dict[str, LiveInstance] | None = None,
    ) -> ShiftOutcome:
        """Move from `running` (updated in place) to `target`. `all_or_nothing` False (the
        first plan): instances that start serve even when others could not. `sleepers`: the
        sleepers the shift may wake or stop (default: all, `self.sleepers`)."""
        sleepers = self.sleepers if sleepers is None else sleepers
        params = ShiftParams(
            drain_deadline_s=self.drain_deadline_s,
            standby_hold_s=self.standby_hold_s,
            time_scale=self.time_scale,
            warm_moves=self.warm_moves,
            kv_moves=self.kv_moves,
            rehearse=rehearse,
            all_or_nothing=all_or_nothing,
            in_place_drain_s=self.in_place_drain_s * self.time_scale,
            loads_beside_awake=self.loads_beside_awake,
        )
        self.names |= gather_names(running)  # (adopted after a restart)
        asleep = [i.planned for i in self.sleepers.values()]
        planned = [*(i.planned for i in running.values()), *target, *asleep]
        specs = {p.model_id: load_model_spec(p.model_id) for p in planned}

        def perf_model(p: PlannedInstance) -> PerfModel:
            return perf_model_of(cluster, p, spec=specs[p.model_id])

        level1 = [i.planned for i in self.sleepers.values() if i.sleep_level == 1]
        levels = sleep_levels(
            self.sleep_mode,
            self.kind_sleep_levels,
            cluster,
            leaving_of({k: i.planned for k, i in running.items()}, target),
            level1,
            perf_model,
        )
        chooser = in_place_chooser(
            self.in_place, self.kind_sleep_levels, cluster, level1, perf_model
        )
        procedure = ShiftProcedure(
            running, target, params, self.names, specs, sleepers, levels, chooser
        )
        return await _LiveShift(self, cluster, running).drive(procedure.run(self.clock()))

    async def stop_sleepers(self, asleep: Sequence[LiveInstance]) -> None:
        """Stop these sleeping engines (the controller stops, or another tenant took a GPU
        of theirs)."""
        for inst in asleep:
            self.sleepers.pop(inst.key, None)
        await self._stop(list(asleep))

    def dead_sleepers(self) -> list[LiveInstance]:
        """Sleeping engines that exited: out of `sleepers` (a later target cold-starts)."""
        dead = [i for i in self.sleepers.values() if i.handle.returncode is not None]
        for inst in dead:
            del self.sleepers[inst.key]
        return dead

    # ------------------------------------------------------------------ the gateway
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

    async def _drain(self, inst: LiveInstance, wait_s: float) -> bool:
        try:
            return await self.gateway.drain(inst.url, wait_s)
        except GatewayError as exc:
            log.warning("drain of %s: %s", inst.url, exc)
            return False

    async def _requests_on(self, inst: LiveInstance) -> list[dict[str, Any]]:
        try:
            return await self.gateway.requests_on(inst.url)
        except GatewayError:
            return []

    # ------------------------------------------------------------------ sleep mode
    async def _engine_post(self, inst: LiveInstance, path: str) -> str:
        """POST `path` to the engine; "" once it answered 200, else why not."""
        if inst.handle.returncode is not None:
            return f"its engine exited ({inst.handle.returncode})"
        timeouts = Timeouts(3.0, self.sleep_timeout_s, self.sleep_timeout_s)
        try:
            resp = await self._probe_pool.request(inst.url, "POST", path, b"", {}, timeouts)
            body = await resp.read()
            resp.release()
        except UpstreamError as exc:
            return f"{path}: {exc}"
        if resp.status != 200:
            return f"{path} answered {resp.status}: {body[:200].decode(errors='replace')}"
        return ""

    async def _sleep(self, inst: LiveInstance, level: int) -> LiveInstance | Failed:
        """Asleep once its requests finished (mode=wait) and its weights are offloaded."""
        why = await self._engine_post(inst, f"/sleep?level={level}&mode=wait")
        if why:
            log.warning("instance %s did not sleep (it stops): %s", inst.planned.name, why)
            return Failed(f"instance {inst.planned.name} did not sleep: {why}")
        inst.sleep_level = level
        await self._tell(inst, "asleep")
        self._set(inst, "asleep")
        return inst

    async def _wake(self, inst: LiveInstance, cluster: Cluster) -> LiveInstance | Failed:
        """Waking, then awake (the procedure sets it active). Its GPUs taken by another
        tenant meanwhile, or its engine gone: Failed (the procedure cold-starts instead)."""
        now = self.cluster_now() if self.cluster_now is not None else cluster
        for g in inst.planned.gpu_ids:
            then_gpu, now_gpu = cluster.gpu(g), now.gpu(g)
            if now_gpu.used_bytes > then_gpu.used_bytes:
                why = f"its GPU {g} was taken by {now_gpu.owner or 'another tenant'} meanwhile"
                return Failed(f"instance {inst.planned.name}: {why}")
        await self._tell(inst, "waking")
        self._set(inst, "waking")
        why = await self._engine_post(inst, "/wake_up")
        if why:
            return Failed(f"instance {inst.planned.name} did not wake: {why}")
        inst.sleep_level = 0
        return inst


class _LiveShift:
    """One shift's commands carried out on the real clock (the engines it launched, the
    stream ids its moves are logged by)."""

    def __init__(self, ex: Executor, cluster: Cluster, running: dict[str, LiveInstance]) -> None:
        self.ex = ex
        self.cluster = cluster
        self.running = running
        self.starts: dict[Start, PlannedInstance] = {}  # every engine start of this shift
        self.launched: dict[Start, LiveInstance] = {}  # those loaded, as instances
        self.stream_ids: dict[int, Any] = {}  # gateway request id -> the client's stream id

    async def drive(self, procedure: Generator[Command, Reply, T]) -> T:
        """Carry out each command and send the procedure its result. A command that raises
        (the controller cancels the shift) is thrown into the procedure, which undoes what
        it must (its holds) and raises it again; then every engine launched that does not
        serve is stopped."""
        try:
            command = next(procedure)
            while True:
                try:
                    value = await self._carry_out(command)
                except BaseException as exc:
                    command = procedure.throw(exc)
                    continue
                command = procedure.send(Reply(self.ex.clock(), value))
        except StopIteration as stop:
            result: T = stop.value
            return result
        except BaseException:
            await self._stop_orphans()
            raise

    async def _stop_orphans(self) -> None:
        for task in self.starts:  # each start stops the engine it was waiting for
            task.cancel()
        await asyncio.gather(*self.starts, return_exceptions=True)
        urls = {i.url for i in self.running.values()}
        orphans: dict[str, LiveInstance] = {}
        for task, p in self.starts.items():
            inst = self.launched.get(task)
            if inst is None and task.done() and not task.cancelled() and task.exception() is None:
                inst = LiveInstance(p, task.result())
            if inst is not None and inst.url not in urls and inst.state != "gone":
                orphans.setdefault(inst.url, inst)
        await self.ex._stop(list(orphans.values()))

    async def _carry_out(self, command: Command) -> Any:
        ex = self.ex
        match command:
            case Hold(model, seconds):
                try:
                    await ex.gateway.hold(model, seconds)
                except GatewayError as exc:
                    return str(exc) or "refused"
                return ""
            case Launch(planned):
                tasks = [asyncio.ensure_future(ex.launcher.start(ex.spec_of(p))) for p in planned]
                self.starts.update(zip(tasks, planned, strict=True))
                return tasks
            case AwaitReady(tokens):
                results = await asyncio.gather(*tokens, return_exceptions=True)
                return [self._loaded(t, r) for t, r in zip(tokens, results, strict=True)]
            case NextReady(tokens):
                done, _ = await asyncio.wait(tokens, return_when=asyncio.FIRST_COMPLETED)
                return [
                    (t, self._loaded(t, t.exception() or t.result())) for t in tokens if t in done
                ]
            case Join(instances):
                return [await self._join(i) for i in instances]
            case SetState(instances, state):
                for inst in instances:
                    await ex._tell(inst, state)
                    if state == "active":  # serving: the controller's gauge counts it
                        self.running[inst.key] = inst
                    ex._set(inst, state)
                return None
            case Rehearse(instances):
                return await asyncio.gather(
                    *(
                        rehearsal.rehearse(
                            ex._probe_pool,
                            i.planned,
                            i.url,
                            ex.time_scale,
                            ex.probe_overhead_s,
                            ex.rehearsal_tolerance,
                        )
                        for i in instances
                    )
                )
            case StillAlive(instances):
                return list(instances)  # an engine that exits is the controller's to notice
            case Release(instances):
                await ex._stop(list(instances))
                return None
            case Wait(seconds):
                await asyncio.sleep(seconds)
                return None
            case StopRouting(instances):
                for inst in instances:
                    ex._set(inst, "draining")
                return sum(await asyncio.gather(*(self._in_flight(i) for i in instances)))
            case Survey(sources, candidates):
                found = await asyncio.gather(*(ex._requests_on(i) for i in sources))
                targets = [c for c in candidates if c.state == "active"]
                theirs = await asyncio.gather(*(ex._requests_on(t) for t in targets))
                for reqs in found:
                    self.stream_ids.update((int(r["id"]), r.get("request_id")) for r in reqs)
                return Surveyed(
                    self.cluster,
                    tuple(tuple(r) for r in found),
                    tuple((t, tuple(r)) for t, r in zip(targets, theirs, strict=True)),
                )
            case Drain(instances, deadline_s, waves):
                return await self._drain(instances, deadline_s, waves)
            case Move(wave):
                return await self._move_wave(wave, "at the deadline")
            case Continue():
                return []  # the gateway continues them when their instance stops
            case Sleep(instances, level):
                return list(await asyncio.gather(*(ex._sleep(i, level) for i in instances)))
            case Wake(instances):
                return list(await asyncio.gather(*(ex._wake(i, self.cluster) for i in instances)))
        raise TypeError(f"not a shift command: {command!r}")

    def _loaded(self, task: Start, result: EngineHandle | BaseException) -> LiveInstance | Failed:
        p = self.starts[task]
        if isinstance(result, BaseException):
            return Failed(f"instance {p.name} did not start: {result}")
        inst = LiveInstance(p, result)
        self.launched[task] = inst
        return inst

    async def _join(self, inst: LiveInstance) -> str:
        """A loaded engine into the gateway's pool as `starting` (not routed until active);
        why not, with the engine stopped, when the gateway refuses."""
        ex = self.ex
        p = inst.planned
        ex._set(inst, "starting")
        try:
            await ex.gateway.add(
                inst.url,
                p.model,
                p.gear.max_num_seqs,
                admin_token=ex.engine_admin_token,
                state="starting",
            )
        except GatewayError as exc:
            await ex._stop([inst])
            return f"instance {p.name}: the gateway refused it: {exc}"
        return ""

    async def _in_flight(self, inst: LiveInstance) -> int:
        """Stop routing to `inst` and count the requests it still runs (0 if unknown)."""
        await self.ex._drain(inst, 0.0)
        try:
            return len(await self.ex.gateway.requests_on(inst.url))
        except GatewayError:
            return 0

    async def _drain(
        self, instances: Sequence[LiveInstance], deadline_s: float, waves: Sequence[Wave]
    ) -> Drained:
        """The gateway waits for `instances` to empty (at most `deadline_s`) while the early
        waves go out at their times; none starts after the drain ended."""
        stop = asyncio.Event()
        early = asyncio.ensure_future(self._early_waves(waves, stop))
        drained = await asyncio.gather(
            *(self.ex._drain(i, deadline_s) for i in instances), return_exceptions=True
        )
        stop.set()  # no wave starts after the deadline: what is left moves then
        return Drained(tuple(ok is True for ok in drained), await early)

    async def _early_waves(self, waves: Sequence[Wave], stop: asyncio.Event) -> Moved:
        t0 = self.ex.clock()
        outcomes: list[str] = []
        num_moved = 0
        for wave in waves:
            wait_s = wave.at_s - (self.ex.clock() - t0)
            if wait_s > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await stop.wait()
            if stop.is_set():
                break
            moved = await self._move_wave(wave, "before the drain deadline")
            outcomes += moved.outcomes
            num_moved += moved.num_moved
        return Moved(tuple(outcomes), num_moved)

    async def _move_wave(self, wave: Wave, when: str) -> Moved:
        """One batch of moves through the gateway; one line per source says what moved, and
        per request (by the stream id its client sees) the pause it was priced at, how it
        moved, the warm-up's outcome for a recompute and where it went:
        `chatcmpl-1=42ms:recompute:warmed@http://127.0.0.1:4321`."""
        moves = []
        for m in wave.moves:
            move: dict[str, Any] = {"id": m.id, "method": m.method, "target": m.destination.url}
            if m.method == "recompute":  # the gateway's pre-copy: bounded, in wall s
                move["warm_timeout_s"] = m.warm_timeout_s
            link = link_between(self.cluster, m.source.planned, m.destination.planned)
            if link is not None:
                move["bandwidth_bytes_per_s"] = link.bandwidth_bytes_per_s
                move["latency_s"] = link.latency_s
            moves.append(move)
        t0 = self.ex.clock()
        at_wall_s = time.time()  # in the line: its readers see it later than it happened
        try:
            results = await self.ex.gateway.move(moves)
        except GatewayError as exc:
            log.warning("moves: %s", exc)
            return Moved((), len(moves))
        took_s = self.ex.clock() - t0
        by_id = {m.id: m for m in wave.moves}
        outcomes: list[str] = []
        by_source: dict[str, tuple[dict[str, int], list[str]]] = {}
        for r in results:
            outcome = str(r.get("outcome"))
            if outcome == "not_running":
                continue
            outcomes.append(outcome)
            m = by_id[int(r["id"])]
            counts, ids = by_source.setdefault(m.source.url, ({}, []))
            counts[outcome] = counts.get(outcome, 0) + 1
            if r.get("warmed"):
                counts["warmed"] = counts.get("warmed", 0) + 1
            how = outcome if r.get("warm") is None else f"{outcome}:{r['warm']}"
            ids.append(
                f"{self.stream_ids.get(m.id) or '-'}={m.pause_s * 1e3:.0f}ms:"
                f"{how}@{m.destination.url}"
            )
        for url, (counts, ids) in by_source.items():
            self.ex.on_moves(
                f"controller: moved {len(ids)} request(s) off {url} {when} "
                f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}) at "
                f"{at_wall_s:.3f} in {took_s:.3f} s: {' '.join(ids)}"
            )
        return Moved(tuple(outcomes), len(outcomes))
