"""The topology-aware planner (pure): which instances to run on the free GPUs now.

See docs/planner.md. `plan(cluster, demands)` returns a `Plan`; speed comes from a
`GearPerformance` (the gear table, or the performance model as the prior).
"""

from flexpipe.policies.planner.core import plan, single_group_baseline, usable_gpus
from flexpipe.policies.planner.demand import ModelsFileError, parse_models
from flexpipe.policies.planner.performance import (
    GearEstimate,
    GearKey,
    GearPerformance,
    PerfModelPerformance,
    Workload,
    steady_state,
)
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
    "GearEstimate",
    "GearKey",
    "GearPerformance",
    "ModelDemand",
    "ModelOutcome",
    "ModelsFileError",
    "PerfModelPerformance",
    "Plan",
    "PlannedInstance",
    "PlannerConfig",
    "Slo",
    "UnusedGpu",
    "Workload",
    "parse_models",
    "plan",
    "single_group_baseline",
    "steady_state",
    "usable_gpus",
]
