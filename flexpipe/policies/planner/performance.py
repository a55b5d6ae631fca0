"""What the planner asks about speed: the `GearPerformance` protocol.

The implementation is the one lookup, flexpipe.perf.gear_lookup.GearLookup: the gear table's
measured curves, interpolated between batch sizes and calibrating the performance model's
steady state (flexpipe.perf.steady_state) elsewhere, and saying which in the estimate's
`basis`. Tests plug in their own.
"""

from __future__ import annotations

from typing import Protocol

from flexpipe.perf.gear_lookup import GearEstimate, GearQuery
from flexpipe.perf.steady_state import Workload

__all__ = ["GearPerformance"]


class GearPerformance(Protocol):
    """Speed of a gear at a concurrency (`query.batch`) for requests of `workload`'s shape."""

    def estimate(self, query: GearQuery, workload: Workload) -> GearEstimate:
        """Raise flexpipe.perf.InfeasibleGear when the gear cannot run on that hardware."""
        ...
