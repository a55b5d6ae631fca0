"""One instance a policy wants running: a model's gear on concrete GPUs.

The planner's `PlannedInstance` carries the same fields (and more); a baseline that is not
the planner's choice (a fixed tp=4 template) builds one directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexpipe.gears.gear import Gear
from flexpipe.policies.planner import PlannedInstance


@dataclass(frozen=True, slots=True)
class Deployment:
    name: str
    model: str  # served model name
    model_id: str  # model spec id
    gear: Gear
    stages: tuple[tuple[str, ...], ...]  # GPU ids per pipeline stage
    layers_per_stage: tuple[int, ...] = ()  # () = even split
    # Shares its GPU with other engines: its --gpu-memory-utilization (None: the GPU is its own)
    gpu_memory_fraction: float | None = None

    @classmethod
    def of(cls, inst: PlannedInstance) -> Deployment:
        return cls(
            inst.name,
            inst.model,
            inst.model_id,
            inst.gear,
            inst.stages,
            inst.layers_per_stage,
            inst.gpu_memory_fraction,
        )

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        return tuple(g for s in self.stages for g in s)

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_ids)
