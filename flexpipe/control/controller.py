"""The controller: an I/O shell around the tick's pure core (control/core/tick.py, the
simulator's too). It owns the engines of the running plan, keeps the gateway's pool in step
with it, and every `tick_s`:

1. notices what changed: an engine that died (an emergency: the gateway already continues
   its streams elsewhere), GPUs that other tenants took or gave back (the cluster file, the
   admin API's occupy/release, occupations running out);
2. sends the core's holds and refusals of the models with no instance to the gateway;
3. reads the gateway (its pool and its Prometheus text) and asks the core, which builds the
   snapshot and asks `ShiftPolicy.decide(snapshot, now, rng)`;
4. logs the decision, taken or not, in the store's shift log, and carries out a shift
   make-before-break (`executor.Executor`), recording its phases, its rehearsal and the
   requests it moved; a shift that fails counts towards the target's blacklist.

Its collaborators are wired in control/assembly.py.

Its admin API (`client.py` has the contract): POST /admin/gpus/occupy, /admin/gpus/release,
GET /admin/status, GET /metrics, GET /sd/engines (the engines as Prometheus HTTP service
discovery targets, control/core/targets.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from flexpipe.cluster import Cluster
from flexpipe.control.api.admin_api import ControllerApi
from flexpipe.control.api.gateway_client import GatewayAdmin, GatewayError
from flexpipe.control.api.status_view import controller_status
from flexpipe.control.api.ui_api import UiApi
from flexpipe.control.assembly import assemble
from flexpipe.control.controller_config import ClusterSource, ControllerConfig
from flexpipe.control.core.observe import RateWindow
from flexpipe.control.core.resources import ResourceEvent, Resources
from flexpipe.control.core.samples import (
    TPOT_HISTOGRAM,
    TTFT_HISTOGRAM,
    gateway_totals,
    parse_histograms,
)
from flexpipe.control.core.shift_outcome import ShiftOutcome, said
from flexpipe.control.core.standby import Renewal
from flexpipe.control.core.tick import Decided, Readings, cold_models
from flexpipe.control.engines.launching import gpu_places
from flexpipe.control.engines.takeover import stub
from flexpipe.control.executor import LiveInstance
from flexpipe.control.standby_live import StandbySleepers
from flexpipe.control.state.journal import first_plan_note
from flexpipe.control.watch.discovery_watch import DiscoveryWatch
from flexpipe.http.server import (
    App,
    HttpServer,
    serve,
)
from flexpipe.launch import AdoptingLauncher, EngineSpec
from flexpipe.lifecycle import DORMANT_STATES, State
from flexpipe.observe.dcgm import gpu_instance_labels
from flexpipe.perf import Efficiency
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner import PlannedInstance, plan
from flexpipe.policies.shift import ShiftPolicy
from flexpipe.policies.shift.candidates import keepable
from flexpipe.policies.shift.decision import ShiftDecision
from flexpipe.policies.shift.snapshot import (
    ShiftRecord,
    instance_key,
)
from flexpipe.store import Store

__all__ = ["Controller"]

log = logging.getLogger("flexpipe.control")


class Controller:
    def __init__(
        self,
        cfg: ControllerConfig,
        launcher: AdoptingLauncher,
        gateway: GatewayAdmin,
        spec_of: Callable[[PlannedInstance, Cluster], EngineSpec],
        store: Store | None = None,
        clock: Callable[[], float] = time.time,
        wall: Callable[[], float] = time.time,
        say: Callable[[str], None] = print,
        watch: ClusterSource | None = None,
        nvml: Any = None,  # NVML for discovery (pynvml by default; tests pass a fake)
    ) -> None:
        """The config and the I/O seams in; every collaborator is wired in one place,
        `assembly.assemble` (`watch`: where the cluster comes from and changes; default: the
        cluster file)."""
        parts = assemble(
            cfg,
            launcher,
            gateway,
            spec_of,
            cluster=lambda: self.cluster,
            on_state=self._on_state,
            note=self.note,
            store=store,
            clock=clock,
            wall=wall,
            say=say,
            watch=watch,
            nvml=nvml,
        )
        self.cfg = cfg
        self.gateway = parts.gateway
        self.store = parts.store
        self.clock = parts.clock
        self.wall = parts.wall
        self.say = parts.say
        self.watch = parts.watch
        self.deployment = parts.deployment
        self.occupation_memory = parts.occupation_memory
        self.resources = parts.resources
        self._pinned = parts.pinned
        self.discovery = parts.discovery
        self.planner = parts.planner
        self.core = parts.core  # the tick (control/core/tick.py)
        self.rate_memory = parts.rate_memory
        self.running = parts.running
        self.shift_log = parts.shift_log
        self.registry = parts.registry
        self.lease = parts.lease
        self.metrics = parts.metrics
        self.journal = parts.journal
        self.takeover = parts.takeover
        self.executor = parts.executor
        self.standby = parts.standby  # models with no instance: held or refused
        self.last_decision: ShiftDecision | None = None
        self.last_outcome: ShiftOutcome | None = None
        self._changed = asyncio.Event()
        self._lock = asyncio.Lock()  # one shift at a time
        self.server: HttpServer | None = None
        self._gone: list[tuple[str, State]] = []  # (model, gone) for the instance gauge
        # standby sleepers beside the shifts (`shift.standby`, off by default)
        self.beside = StandbySleepers(self)

    # ------------------------------------------------------------------ views
    @property
    def cluster(self) -> Cluster:
        """The GPUs as free for us now (other tenants' memory used, ours not)."""
        return self.resources.effective

    @property
    def policy(self) -> ShiftPolicy:
        return self.core.policy

    @property
    def performance(self) -> GearLookup:
        """The gear table the planner reads (the store's points)."""
        return self.planner.performance

    @property
    def efficiency(self) -> Efficiency | None:
        return self.planner.efficiency

    @property
    def history(self) -> list[ShiftRecord]:
        """The policy's record of the shifts carried out (cooldowns, blacklists)."""
        return self.core.history

    @property
    def resources_changed_s(self) -> float | None:
        """When the GPUs last changed, unanswered by a shift (the resource trigger's clock)."""
        return self.core.resources_changed_s

    @property
    def _rates(self) -> RateWindow:
        return self.core.rates

    def _on_state(self, inst: LiveInstance, state: str) -> None:
        p = inst.planned
        if state == "active":
            self.say(
                f"  {p.name} ready at {inst.url} on {'+'.join(p.gpu_ids)} "
                f"({p.gear.key()}, {inst.handle.cold_start_s:.1f} s)"
            )
        if state == "gone":
            self._gone.append((p.model, State.GONE))
        self._gauge()
        self.takeover.record_state(inst, state)

    def _gauge(self) -> None:
        live = [(i.planned.model, State(i.state)) for i in self.running.values()]
        live += [(i.planned.model, State(i.state)) for i in self.executor.sleepers.values()]
        self.metrics.set_instances(live + self._gone[-1000:])
        # which instance holds each GPU, in DCGM's labels: Grafana joins the exporter's
        # per-GPU series to instances with it (docs/observability.md)
        running = list(self.running.values())
        cluster = self.cluster
        placements = {
            i.planned.name: gpu_places(cluster, [g for stage in i.planned.stages for g in stage])
            for i in running
        }
        self.metrics.set_gpu_instances(
            gpu_instance_labels(placements, {i.planned.name: i.planned.model for i in running})
        )

    @property
    def rates_per_s(self) -> dict[str, float]:
        """Each model's arrival rate over the window (requests per modelled second)."""
        return self.core.rates.rates_per_s

    @property
    def expected_rates_per_s(self) -> dict[str, float]:
        """Each model's forecast rate (the last tick's)."""
        return self.core.expected_rates_per_s

    def status(self) -> dict[str, Any]:
        """`GET /admin/status` (control/api/status_view.py)."""
        return controller_status(self)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Serve the admin API, adopt what a previous controller left running, plan for the
        free GPUs and bring up what the plan lacks. A second live controller of the same
        deployment on the same store is refused (RuntimeError, one line)."""
        if self.lease is not None:
            self.lease.acquire(self.wall)  # before anything of the store is touched
        self._keep_occupations()  # those that ran out while stopped are gone from the store
        self.server = await serve(self._app(), self.cfg.host, self.cfg.port)
        first = self.planner(self.cluster, self.cfg.demands, self.clock())
        if not first.instances:
            raise RuntimeError("the planner found nothing to run on the free GPUs")
        resumed = self.takeover.resume_history()
        if resumed is not None:
            self.core.history = resumed
        survivors = await self.takeover.survivors()
        # engines a previous controller left asleep (or waking) are not adopted: they serve
        # nothing and hold their GPUs, so they stop (their GPUs are planned afresh)
        dormant = [r for r in survivors if r.state in DORMANT_STATES]
        await self.takeover.retire(dormant)
        survivors = [r for r in survivors if r not in dormant]
        if survivors:  # what a previous controller left serving stays, where it still pays
            fraction = self.takeover.fraction_of  # (a shared engine keeps its memory share)
            stubs = [stub(r, first.instances, fraction(r, self.cluster)) for r in survivors]
            first = plan(
                self.cluster,
                self.cfg.demands,
                self.planner.performance,
                running=[s for s in stubs if s is not None],
                config=self.cfg.planner,
                now_s=self.clock(),
                efficiency=self.planner.efficiency,
            )
        leftovers = await self.takeover.adopt(first.instances, survivors, self.running)
        adopted = list(self.running)
        if survivors:
            self._gauge()
        targets = list(first.instances)
        if self.cfg.shift.standby.enabled and not survivors:  # the standby set in place
            targets = self.beside.first_plan(targets)
        # what a new instance needs the GPUs of goes first; the rest once the plan serves
        wanted = {g for p in targets if instance_key(p) not in self.running for g in p.gpu_ids}
        in_way = [r for r in leftovers if wanted & set(r.gpu_ids)]
        await self.takeover.retire(in_way)
        # While the first engines load, the gateway queues their models' requests instead of
        # answering 404 (a newcomer's first request waits for the cold start, then is served).
        cold = cold_models(targets, [i.planned for i in self.running.values()])
        held = await self._hold_all(cold, self.cfg.standby_hold_s)
        try:
            # a cold start may outlast the hold. (Unlike the simulator's first plan, a
            # resource change meanwhile stays unanswered: its watches start after this.)
            async with self._renewing(held):
                outcome = await self.executor.shift(
                    self.cluster,
                    self.running,
                    targets,
                    rehearse=False,
                    all_or_nothing=False,
                )
        finally:
            await self._hold_all(held, 0)
        self.takeover.sweep_spawned()
        await self.takeover.retire([r for r in leftovers if r not in in_way])
        why, notes = first_plan_note(adopted, leftovers, outcome)
        self.note(
            "plan",
            why,
            notes,
            outcome="succeeded" if self.running else "failed",
            trigger="restart" if survivors else "start",
        )
        if outcome.reason:
            self.say(f"error: {outcome.reason}")
        if not self.running:
            raise RuntimeError("no instance started; see the errors above")
        self.say(f"controller: {len(self.running)} instance(s) serving")
        await self.beside.sleep_first()  # (standbys: those nothing waits for sleep now)

    async def _hold_all(self, models: Sequence[str], seconds: float) -> list[str]:
        """Hold `models` in the gateway for `seconds` (0: release); the models it took."""
        done = []
        for model in models:
            try:
                await self.gateway.hold(model, seconds)
                done.append(model)
            except GatewayError as exc:
                log.warning("gateway: hold %s: %s", model, exc)
        return done

    async def run(self, stop: asyncio.Event) -> None:
        """Tick until `stop` is set."""
        watches = [
            asyncio.create_task(self._watch_file()),
            asyncio.create_task(self.standby.watch_demand(self._changed)),
        ]
        if self.discovery is not None:
            watches.append(asyncio.create_task(self._watch_discovery(self.discovery)))
        beside = []  # standby sleepers (`shift.standby`): started, woken, put to sleep
        if self.cfg.shift.standby.enabled:
            beside.append(asyncio.create_task(self.beside.loop()))
        watches += beside
        try:
            while not stop.is_set():
                self._changed.clear()
                await self.tick()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.cfg.tick_s):
                        await self._wait_any(stop)
        finally:
            for w in watches:
                w.cancel()
            # a standby loading beside is stopped by its cancelled shift before `close`
            await asyncio.gather(*beside, return_exceptions=True)

    async def _wait_any(self, stop: asyncio.Event) -> None:
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._changed.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def close(self, stop_engines: bool = True) -> None:
        if stop_engines:
            wait_s = min(5.0, self.cfg.drain_deadline_s)
            await asyncio.gather(
                *(self.gateway.drain(i.url, wait_s) for i in self.running.values()),
                return_exceptions=True,  # a gateway that is gone: stop the engines anyway
            )
            await asyncio.gather(
                *(i.handle.stop() for i in self.running.values()), return_exceptions=True
            )
            for inst in self.running.values():
                inst.state = "gone"
                self._on_state(inst, "gone")
            await self.executor.stop_sleepers(list(self.executor.sleepers.values()))
        await self.executor.close()
        await self.gateway.close()
        if self.server is not None:
            await self.server.close()
        if self.lease is not None:
            await self.lease.release()

    # ------------------------------------------------------------------ one tick
    async def tick(self) -> ShiftDecision | None:
        """The core's steps in its order (control/core/tick.py), the gateway awaited between
        them; the simulator's `_tick` calls the same steps at one instant of its clock. A
        shift is awaited inside the tick (the simulator's ticks again when it ends)."""
        core = self.core
        now_s = self.clock()
        await self._reap_dead(now_s)
        self._resource_events(*self.resources.tick(self.wall()), now_s)
        await self._release_taken_sleepers()
        serving = {i.planned.model for i in self.running.values()}
        try:
            commands = core.standby(serving, self.resources, self.wall(), now_s)
            await self.standby.carry_out(commands, serving)
            readings = await self._read_gateway()
            standby = self.cfg.shift.standby.enabled
            # a burst's sleepers wake beside first; the policy decides on what that left
            queued = readings.queued_by_model
            if standby and await self.beside.wake_aside(readings.instances, queued):
                readings = await self._read_gateway()
        except GatewayError as exc:
            log.warning("no sample this tick: %s", exc)
            return None
        core.observe(now_s, readings)
        if self.rate_memory is not None:
            self.rate_memory.keep(core.rates, now_s, self.wall())
        cluster = self.cluster
        if standby:
            cluster = self.beside.observe(now_s, readings)
        # (a holder asleep while a standby loads on its GPUs is the standby shell's until
        # it wakes: `StandbySleepers.yield_for`; the policy does not see it meanwhile)
        asleep = [
            (i.planned, i.sleep_level)
            for k, i in self.executor.sleepers.items()
            if k not in self.beside.yield_keys
        ]
        running = [i.planned for i in self.running.values()]
        decided = core.decide(now_s, cluster, running, asleep)
        self.last_decision = decided.decision
        if not decided.shift:
            self.journal.decision(decided.decision, decided.snapshot.running)
            return decided.decision
        await self._carry_out(decided)
        return decided.decision

    async def _carry_out(self, decided: Decided) -> None:
        async with self._lock:
            decision = decided.decision
            entry = self.journal.decision(decision, decided.snapshot.running)
            self.say(f"controller: shift ({decision.trigger}): {decision.reason}")
            assert decision.target is not None
            # what the shift uses: no wake or sleep beside touches it
            beside = self.beside
            beside.main_keys = {instance_key(t) for t in decision.target} | set(self.running)
            beside.main_gpus = {g for t in decision.target for g in t.gpu_ids} | {
                g for i in self.running.values() for g in i.planned.gpu_ids
            }
            try:
                async with self._keeping(decided.renewal):
                    outcome = await self.executor.shift(self.cluster, self.running, decision.target)
            finally:
                beside.main_gpus, beside.main_keys = set(), set()
            if not beside.aside_gpus:  # (a standby loading beside is no engine that failed)
                self.takeover.sweep_spawned()
            self.core.shift_finished(outcome, self.clock())
            self.last_outcome = outcome
            self.journal.finish(entry, outcome)
            self.say(
                f"controller: shift {said(outcome)} "
                f"{outcome.reason} phases "
                + ", ".join(f"{k} {v:.1f}s" for k, v in outcome.phases_s.items())
            )

    def _renewing(self, shift_holds: Iterable[str]) -> contextlib.AbstractAsyncContextManager[None]:
        """`_keeping` the core's renewal of the last tick's holds and refusals and
        `shift_holds`, the holds the shift makes itself."""
        return self._keeping(self.core.renewal(shift_holds))

    @contextlib.asynccontextmanager
    async def _keeping(self, kept: Renewal | None) -> AsyncIterator[None]:
        """While a shift runs the tick waits, and with it the renewal of the gateway's
        holds and refusals: `kept` is renewed meanwhile by a task beside the shift, until the
        shift ends whichever way (done, rolled back, raised, cancelled by a stop)."""
        if kept is None:
            yield
            return
        over = asyncio.Event()
        renewing = asyncio.create_task(self.standby.keep(kept, over))
        try:
            yield
        finally:
            over.set()
            try:
                await asyncio.wait([renewing])  # a renewal under way finishes first
            finally:
                renewing.cancel()  # (if this wait was cancelled itself; else a no-op)
            if not renewing.cancelled() and renewing.exception() is not None:
                log.warning("renewal of holds: %s", renewing.exception())

    async def _read_gateway(self) -> Readings:
        """What the core reads: the gateway's pool and its Prometheus text, parsed."""
        instances = await self.gateway.instances()
        await self._register_missing(instances)
        text = await self.gateway.metrics()
        totals = gateway_totals(text)
        return Readings(
            instances,
            parse_histograms(text, (TTFT_HISTOGRAM, TPOT_HISTOGRAM)),
            totals.num_queued,
            totals.queued_by_model,
            totals.done_by_model,
        )

    async def _register_missing(self, instances: Sequence[dict[str, Any]]) -> None:
        """A gateway that restarted has lost its pool: give it the running instances back.
        One whose state there lags (a lifecycle call that failed) is set active again."""
        known = {i["url"]: i.get("state") for i in instances}
        for inst in self.running.values():
            if inst.state != "active" or self._lock.locked():
                continue  # a shift in progress moves its instances itself
            if inst.url not in known:
                await self.gateway.add(
                    inst.url,
                    inst.planned.model,
                    inst.planned.gear.max_num_seqs,
                    admin_token=self.cfg.engine_admin_token,
                )
                self.say(f"controller: {inst.planned.name} registered again in the gateway")
            elif known[inst.url] in (State.STARTING.value, State.REHEARSING.value):
                await self.gateway.set_state(inst.url, State.ACTIVE.value)

    async def _reap_dead(self, now_s: float) -> None:
        """An engine that exited: out of the running plan (the core), out of the gateway (its
        streams continue elsewhere); the policy sees the GPUs again and re-plans (an
        emergency). The simulator is told of a death when it happens instead."""
        for inst in self.executor.dead_sleepers():  # asleep: nothing served, nothing re-planned
            with contextlib.suppress(GatewayError):
                await self.gateway.remove(inst.url)
            inst.state = "gone"
            self._on_state(inst, "gone")
            self.say(f"controller: sleeping instance {inst.planned.name} exited")
        dead = [i for i in self.running.values() if i.handle.returncode is not None]
        for key, inst in self.core.drop_dead(self.running, dead, now_s):
            with contextlib.suppress(GatewayError):
                await self.gateway.remove(inst.url)
            inst.state = "gone"
            self._on_state(inst, "gone")
            why = f"{key} exited ({inst.handle.returncode}); its GPUs are re-planned"
            self.note("emergency", why, outcome="succeeded", trigger="lost")
            self.say(f"controller: instance {inst.planned.name} exited; re-planning")

    async def _release_taken_sleepers(self) -> None:
        """A sleeping engine on a GPU that is gone, or that another tenant took whole since
        it fell asleep, stops (`keepable`, as the sleep levels decide; the simulator's engines
        die with such GPUs): a later target for its model cold-starts elsewhere."""
        cluster = self.cluster
        taken = [
            i for i in self.executor.sleepers.values() if not keepable(cluster, i.planned.gpu_ids)
        ]
        for inst in taken:
            self.say(f"controller: sleeping {inst.planned.name} stopped: its GPU was taken")
        if taken:
            await self.executor.stop_sleepers(taken)

    def _keep_occupations(self) -> None:
        if self.occupation_memory is not None:
            self.occupation_memory.keep(self.resources.overrides, self._pinned)

    def _resource_events(
        self, resources: Resources, events: list[ResourceEvent], now_s: float
    ) -> list[ResourceEvent]:
        self.resources = resources
        self._keep_occupations()
        self.core.resources_changed(events, now_s)
        if events:
            self.note("resources", "; ".join(e.why for e in events), notes=[e.why for e in events])
            self._changed.set()
        return events

    async def _watch_file(self) -> None:
        async for cluster, _ in self.watch.changes():
            if self.discovery is not None:
                self.discovery.rebase(cluster)
            self._resource_events(*self.resources.file_changed(cluster, self.wall()), self.clock())

    async def _watch_discovery(self, watch: DiscoveryWatch) -> None:
        """NVML asked again every interval: its changes are resource events like the file's."""
        async for cluster, _ in watch.changes():
            self.discovered(cluster)

    def discovered(self, cluster: Cluster) -> list[ResourceEvent]:
        """A cluster from discovery: the GPUs' memory as NVML sees it now."""
        return self._resource_events(
            *self.resources.file_changed(cluster, self.wall()), self.clock()
        )

    def note(
        self,
        kind: Any,
        reason: str,
        notes: Sequence[str] = (),
        outcome: Any = "noted",
        trigger: str = "none",
    ) -> None:
        running = [i.planned for i in self.running.values()]
        self.journal.note(kind, reason, running, notes, outcome, trigger)

    # ------------------------------------------------------------------ admin API
    def _app(self) -> App:
        app = App()
        ControllerApi(self).add_routes(app)
        UiApi(self).add_routes(app)  # read-only views for the dashboard
        return app

    def change_resources(
        self, call: Callable[[], tuple[Resources, list[ResourceEvent]]]
    ) -> list[ResourceEvent]:
        """An admin occupation or release: the new resources and their events, as if the
        cluster file had changed (a tick follows at once)."""
        resources, events = call()
        self._resource_events(resources, events, self.clock())
        return events
