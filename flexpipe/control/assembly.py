"""The live controller's wiring, in one place: from its config and its I/O seams (the engine
launcher, the gateway client, the store, the clocks, the cluster source, NVML), every
collaborator the `Controller` runs with, ready-made (`ControllerParts`).

What is built here, in this order (some say what they restored from the store):
the cluster source and the resources (the admin's occupations from before a restart, the
command line's `--occupy`), NVML discovery, the gear table and the planner, the shift policy
(priced at the executor's drain deadline), the tick's core, the rate memory, the shift log,
instance registry, lease, metrics and journal, the takeover of a previous controller's
engines, the executor and the standby models' word to the gateway.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flexpipe.cluster import Cluster
from flexpipe.control.api.controller_metrics import ControllerMetrics
from flexpipe.control.api.gateway_client import GatewayAdmin
from flexpipe.control.core.planner import ControllerPlanner
from flexpipe.control.core.resources import Occupation, Resources
from flexpipe.control.core.sleeping import sleep_mode_on
from flexpipe.control.core.tick import TickCore, TickParams
from flexpipe.control.engines.launching import with_sleep_mode
from flexpipe.control.engines.takeover import Takeover
from flexpipe.control.executor import Executor, LiveInstance
from flexpipe.control.gateway_fleet import GatewayFleet
from flexpipe.control.standby import Note, StandbyModels
from flexpipe.control.state.journal import Journal
from flexpipe.control.state.lease import Lease
from flexpipe.control.state.occupation_memory import OccupationMemory
from flexpipe.control.state.rate_memory import RateMemory
from flexpipe.control.watch.cluster_watch import ClusterWatch
from flexpipe.control.watch.discovery_watch import DISCOVERED_MARK, DiscoveryWatch
from flexpipe.engine_kinds import engine_kind, kv_move_possible
from flexpipe.launch import AdoptingLauncher, EngineSpec
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift import ShiftPolicy
from flexpipe.policies.shift.in_place import MAKE_BEFORE_BREAK
from flexpipe.store import Store
from flexpipe.store.instance_registry import InstanceRegistry
from flexpipe.store.shift_log import ShiftLog

if TYPE_CHECKING:
    from flexpipe.control.controller_config import ClusterSource, ControllerConfig

__all__ = ["DEFAULT_DISCOVER_INTERVAL_S", "ControllerParts", "assemble"]

DEFAULT_DISCOVER_INTERVAL_S = 30.0

OnState = Callable[[LiveInstance, str], None]


@dataclass
class ControllerParts:
    """Everything a `Controller` runs with besides its own state."""

    gateway: GatewayAdmin
    store: Store | None
    clock: Callable[[], float]  # the policy's clock
    wall: Callable[[], float]  # unix time: occupations, the store
    say: Callable[[str], None]
    watch: ClusterSource
    deployment: str  # what its store rows and lease belong to
    occupation_memory: OccupationMemory | None
    resources: Resources
    pinned: dict[str, Occupation]  # --occupy's (the command line's, not kept in the store)
    discovery: DiscoveryWatch | None
    planner: ControllerPlanner
    core: TickCore
    rate_memory: RateMemory | None
    running: dict[str, LiveInstance]  # instance key -> engine of the running plan
    shift_log: ShiftLog | None
    registry: InstanceRegistry | None
    lease: Lease | None
    metrics: ControllerMetrics
    journal: Journal
    takeover: Takeover
    executor: Executor
    standby: StandbyModels


def assemble(
    cfg: ControllerConfig,
    launcher: AdoptingLauncher,
    gateway: GatewayAdmin,
    spec_of: Callable[[PlannedInstance, Cluster], EngineSpec],
    *,
    cluster: Callable[[], Cluster],
    on_state: OnState,
    note: Note,
    store: Store | None = None,
    clock: Callable[[], float] = time.time,
    wall: Callable[[], float] = time.time,
    say: Callable[[str], None] = print,
    watch: ClusterSource | None = None,
    nvml: Any = None,
) -> ControllerParts:
    """The parts of a controller. Its three hooks: `cluster` (the GPUs free to us as the
    controller sees them now: an engine's command is made for them), `on_state` (an engine
    changed state) and `note` (an entry of the shift log, against the running plan).
    `watch`: where the cluster comes from and changes (default: the cluster file); `nvml`:
    NVML for discovery (pynvml by default; tests pass a fake)."""
    source: ClusterSource = watch or ClusterWatch(cfg.cluster_path, cfg.watch_interval_s)
    deployment = cfg.deployment_id or gateway.url
    # the admin's occupations from before a restart, before anything is planned
    occupation_memory = OccupationMemory.of(store, deployment)
    saved = occupation_memory.restore(wall(), say) if occupation_memory else None
    resources = Resources.of(source.cluster, wall(), saved)
    pinned: dict[str, Occupation] = {}
    if cfg.occupied:
        resources, _ = resources.occupy(cfg.occupied, cfg.occupied_owner, None, wall())
        pinned = {g: resources.overrides.occupied[g] for g in cfg.occupied}
    running: dict[str, LiveInstance] = {}
    discovery = _discovery(cfg.discover_interval_s, resources, running, nvml)
    efficiency = store.efficiency() if store is not None else None
    planner = ControllerPlanner(
        GearLookup(store.points() if store is not None else [], efficiency), efficiency, cfg.planner
    )
    # A shift is priced with the drain deadline the executor will keep (one fact, here).
    shift = dataclasses.replace(
        cfg.shift,
        pricing=dataclasses.replace(
            cfg.shift.pricing,
            drain_deadline_s=cfg.drain_deadline_s,
            kv_moves=kv_move_possible(cfg.engine_kind, cfg.engine_kind),
        ),
    )
    policy = ShiftPolicy(shift, planner=planner, efficiency=efficiency)
    params = TickParams(
        cfg.demands, cfg.standby_hold_s, cfg.tick_s, cfg.min_instances_floor, cfg.time_scale
    )
    core = TickCore(params, policy, planner, random.Random(cfg.seed))
    rate_memory = RateMemory.of(store, cfg.shift.forecast.keep_s)  # for a restart
    if rate_memory is not None:  # core.samples: keyed by the models served
        rate_memory.restore(core.rates, core.samples, clock(), wall(), say)
    shift_log = ShiftLog(store, deployment) if store is not None else None
    registry = InstanceRegistry(store, deployment) if store is not None else None
    metrics = ControllerMetrics()
    if isinstance(gateway, GatewayFleet):  # each replica's state, read at a scrape
        metrics.watch_gateways(gateway.view)
    metrics.set_slos((d.name, d.slo.ttft_p99_s, d.slo.tpot_p99_s) for d in cfg.demands)
    takeover = Takeover(
        registry,
        shift_log,
        launcher,
        gateway,
        cfg.engine_kind,
        cfg.engine_admin_token,
        cfg.drain_deadline_s,
        say,
    )
    if registry is not None and hasattr(launcher, "on_spawn"):
        # (the local launcher's hook; not in the Protocol)
        launcher.on_spawn = takeover.spawned
    # sleep instead of stop where the engine kind can (control/core/sleeping.py): its engines
    # are launched able to sleep
    kind_sleep_levels = engine_kind(cfg.engine_kind).sleep_levels
    sleeps = sleep_mode_on(cfg.shift.sleep_mode, kind_sleep_levels)
    # an in-place successor made before the break may wait asleep (policies/shift/in_place.py)
    sleeps |= cfg.shift.pricing.in_place == MAKE_BEFORE_BREAK and bool(kind_sleep_levels)

    def spec_now(p: PlannedInstance) -> EngineSpec:
        spec = spec_of(p, cluster())
        return with_sleep_mode(spec) if sleeps else spec

    executor = Executor(
        launcher,
        gateway,
        spec_now,
        engine_admin_token=cfg.engine_admin_token,
        time_scale=cfg.time_scale,
        drain_deadline_s=cfg.drain_deadline_s,
        rehearsal_tolerance=cfg.rehearsal_tolerance,
        standby_hold_s=cfg.standby_hold_s,
        kv_moves=kv_move_possible(cfg.engine_kind, cfg.engine_kind),
        on_state=on_state,
        on_moves=say,
        clock=clock,
        sleep_mode=cfg.shift.sleep_mode,
        kind_sleep_levels=kind_sleep_levels,
        cluster_now=cluster,
        in_place=cfg.shift.pricing.in_place,
        in_place_drain_s=cfg.shift.pricing.in_place_drain_s,
        loads_beside_awake=engine_kind(cfg.engine_kind).loads_beside_awake,
    )
    standby = StandbyModels(
        gateway,
        core.standby_state,
        lambda: core.standby_models(i.planned.model for i in running.values()),
        cfg.tick_s,
        cfg.standby_hold_s,
        say,
        note,
    )
    return ControllerParts(
        gateway=gateway,
        store=store,
        clock=clock,
        wall=wall,
        say=say,
        watch=source,
        deployment=deployment,
        occupation_memory=occupation_memory,
        resources=resources,
        pinned=pinned,
        discovery=discovery,
        planner=planner,
        core=core,
        rate_memory=rate_memory,
        running=running,
        shift_log=shift_log,
        registry=registry,
        lease=Lease.of(store, deployment, say),
        metrics=metrics,
        journal=Journal(shift_log, metrics, cfg.rehearsal_tolerance),
        takeover=takeover,
        executor=executor,
        standby=standby,
    )


def _discovery(
    interval_s: float | None,
    resources: Resources,
    running: dict[str, LiveInstance],
    nvml: Any,
) -> DiscoveryWatch | None:
    """GPU discovery through NVML while running: `interval_s` None = every 30 s when the
    cluster file was written by `flexpipe discover` (its description says so), else off."""
    if interval_s is None:
        described = resources.file.description or ""
        interval_s = DEFAULT_DISCOVER_INTERVAL_S if DISCOVERED_MARK in described else 0.0
    if interval_s <= 0:
        return None
    return DiscoveryWatch(
        resources.file, interval_s, nvml=nvml, own_pgids=lambda: own_pgids(running.values())
    )


def own_pgids(instances: Iterable[LiveInstance]) -> set[int]:
    """The process groups of our engines (their GPU memory is not another tenant's)."""
    pids = (getattr(i.handle, "pid", None) for i in instances)
    return {p for p in pids if isinstance(p, int) and p > 0}
