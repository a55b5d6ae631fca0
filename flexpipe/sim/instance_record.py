"""`InstanceRecord`: one instance a run launched, from its launch to its release (what the
report's instances, the GPU-hours billed and the controller's running plan read)."""

from __future__ import annotations

from dataclasses import dataclass, field

from flexpipe.engine.sleep import SleepState
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.sim.deployment import Deployment
from flexpipe.sim.instance import SimInstance

__all__ = ["InstanceRecord"]


@dataclass(slots=True)
class InstanceRecord:
    dep: Deployment
    launched_s: float
    ready_s: float
    stopped_s: float = -1.0  # left the plan (drain began); -1: ran to the end
    released_s: float = -1.0  # drained and empty: its GPUs are free again
    num_kv_blocks: int = 0
    max_model_len: int = 0
    instance: SimInstance | None = None
    planned: PlannedInstance | None = None  # the controller's instances: what was planned
    active: bool = False  # in the gateway's pool, taking requests
    died: str = ""  # why its engine died with its GPUs ("" if it did not)
    # sleep mode (docs/controller.md, "Sleep instead of stop"): what is asleep, and each
    # sleep's [start, end, level, GPU bytes, host RAM bytes held asleep] (end -1: asleep
    # still, or until it was released)
    sleep: SleepState | None = None
    asleep_spans: list[list[float]] = field(default_factory=list)

    @property
    def key(self) -> str:
        return instance_key(self.planned) if self.planned is not None else self.dep.name

    @property
    def url(self) -> str:
        return self.instance.url if self.instance is not None else ""

    @property
    def cold_start_s(self) -> float:
        return self.ready_s - self.launched_s
