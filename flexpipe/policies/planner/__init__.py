"""The topology-aware planner (pure): which instances to run on the free GPUs now.

See docs/planner.md. `plan(cluster, demands)` returns a `Plan`; speed comes from a
`GearPerformance` (flexpipe.gears.lookup.GearLookup: the gear table over the performance
model's prior).
"""

from flexpipe.policies.planner.core import plan, single_group_baseline, usable_gpus
from flexpipe.policies.planner.demand import ModelsFileError, parse_models
from flexpipe.policies.planner.performance import GearPerformance
from flexpipe.policies.planner.types import (
    Alternative,
    Baseline,
    ModelDemand,
    ModelOutcome,
    Plan,
    PlannedInstance,
    PlannerConfig,
    Slo,
    UnusedGpu,
)

__all__ = [
    "Alternative",
    "Baseline",
    "GearPerformance",
    "ModelDemand",
    "ModelOutcome",
    "ModelsFileError",
    "Plan",
    "PlannedInstance",
    "PlannerConfig",
    "Slo",
    "UnusedGpu",
    "parse_models",
    "plan",
    "single_group_baseline",
    "usable_gpus",
]
