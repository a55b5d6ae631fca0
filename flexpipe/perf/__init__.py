"""The one performance model: memory plans, step times, cold start. Pure functions.

See docs/performance-model.md for the formulas and the defaults.
"""

from flexpipe.perf.efficiency import DEFAULT_EFFICIENCY, Efficiency
from flexpipe.perf.memory import GpuMemory, InfeasibleGear, MemoryPlan, memory_plan
from flexpipe.perf.model import PerfModel, perf_model_for
from flexpipe.perf.step_time import BatchShape, allreduce_s, p2p_s, roofline_s

__all__ = [
    "DEFAULT_EFFICIENCY",
    "BatchShape",
    "Efficiency",
    "GpuMemory",
    "InfeasibleGear",
    "MemoryPlan",
    "PerfModel",
    "allreduce_s",
    "memory_plan",
    "p2p_s",
    "perf_model_for",
    "roofline_s",
]
