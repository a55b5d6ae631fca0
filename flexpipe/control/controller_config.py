"""What a controller is started with (`ControllerConfig`, from the CLI's flags or a test), and
where its cluster comes from (`ClusterSource`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from flexpipe.cluster import Cluster
from flexpipe.control.core.resources import ResourceEvent
from flexpipe.gateway.core.holds import STANDBY_HOLD_S
from flexpipe.policies.planner import ModelDemand, PlannerConfig
from flexpipe.policies.shift import ShiftParams

__all__ = ["ClusterSource", "ControllerConfig"]


class ClusterSource(Protocol):
    """The cluster file (ClusterWatch) or a Ray cluster (RayWatch): the cluster as last read
    and its changes, as resource events."""

    @property
    def cluster(self) -> Cluster: ...

    def changes(self) -> AsyncIterator[tuple[Cluster, list[ResourceEvent]]]: ...


@dataclass
class ControllerConfig:
    cluster_path: Path
    demands: tuple[ModelDemand, ...]
    host: str = "127.0.0.1"
    port: int = 8100
    token: str | None = None  # bearer token of the controller's admin API
    tick_s: float = 10.0  # one sample and one decision per tick (seed 000: ~10 s)
    watch_interval_s: float = 2.0
    # GPU discovery through NVML while running: None = every 30 s when the cluster file was
    # written by `flexpipe discover` (its description says so), else off; 0 = off.
    discover_interval_s: float | None = None
    drain_deadline_s: float = 30.0
    rehearsal_tolerance: float = 2.0
    time_scale: float = 1.0  # sim engines: wall seconds per modelled second
    engine_admin_token: str | None = None  # given to engines it starts (KV moves)
    engine_kind: str = "sim"
    # The floor under every model's min_instances: 1 keeps every model warm; 0 (--scale-to-zero)
    # lets a model whose minimum is 0 drop to no instance when idle, the gateway then holding
    # its next request while an instance cold-starts.
    min_instances_floor: int = 1
    # How long (wall s) a model with no instance stays held in the gateway: renewed every
    # tick, so it only has to outlast a cold start and a rehearsal.
    standby_hold_s: float = STANDBY_HOLD_S
    shift: ShiftParams = field(default_factory=ShiftParams)
    # the planner's knobs (`--share-gpus`: small models share GPUs in memory)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    seed: int = 0
    # GPUs another tenant holds from the start, as if `flexpipe cluster occupy` had taken them
    # (until released through the admin API): the demo's tenant on gpu1 (flexpipe/demo.py)
    occupied: tuple[str, ...] = ()
    occupied_owner: str = "another tenant"
    # What the store's instances, shift log, occupations and lease belong to: one id per
    # deployment (two `flexpipe up` on one store never adopt each other's engines). None: the
    # URL of the gateway it serves.
    deployment_id: str | None = None
