"""The topology-aware planner (pure): which instances to run on the free GPUs now.

See docs/planner.md. `plan(cluster, demands, running=...)` returns a `Plan` that maximises
priority-weighted goodput (SLO-meeting requests/s x priority) with every model at its
minimum where the GPUs allow, keeping the running plan's instances unless replacing them
pays; speed comes from a `GearPerformance` (flexpipe.perf.gear_lookup.GearLookup: the gear table
over the performance model's prior).
"""

from flexpipe.policies.planner.baselines import single_group_baseline
from flexpipe.policies.planner.core import plan, usable_gpus
from flexpipe.policies.planner.demand import ModelsFileError, parse_models
from flexpipe.policies.planner.performance import GearPerformance
from flexpipe.policies.planner.types import (
    Alternative,
    Baseline,
    Checkpoint,
    InstanceChange,
    ModelDemand,
    ModelOutcome,
    Plan,
    PlannedInstance,
    PlannerConfig,
    Slo,
    UnusedGpu,
    num_gpus_held,
)

__all__ = [
    "Alternative",
    "Baseline",
    "Checkpoint",
    "GearPerformance",
    "InstanceChange",
    "ModelDemand",
    "ModelOutcome",
    "ModelsFileError",
    "Plan",
    "PlannedInstance",
    "PlannerConfig",
    "Slo",
    "UnusedGpu",
    "num_gpus_held",
    "parse_models",
    "plan",
    "single_group_baseline",
    "usable_gpus",
]
