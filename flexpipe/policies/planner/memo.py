"""Candidate evaluations remembered across plans: `EvaluationMemo`.

A controller re-plans every tick (10 s) on a cluster that mostly did not change, and each
plan evaluates the same few hundred hardware shapes again (memory plan, layer split, the
batch ladder against the SLOs: ~95% of a re-plan's time). An evaluation depends on the
model, the demand's shape and SLOs (not its rate), the precision and the hardware (per stage
its GPUs' types and free memory, its TP link; the links between stages), and on the
performance lookup, planner config and efficiency it was made with. The memo is keyed on the
first, and bound to the second: a plan made with another lookup, config or efficiency
clears it. So a controller keeps one memo for its life and passes it to every `plan()`;
plans come out the same with or without it.

Bounded: least recently used entries go beyond `max_entries` (a cluster whose free memory
keeps changing makes new shapes; old ones stop being asked for).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from flexpipe.perf import Efficiency
from flexpipe.policies.planner.performance import GearPerformance
from flexpipe.policies.planner.types import PlannerConfig

if TYPE_CHECKING:
    from flexpipe.policies.planner.candidates import Candidate, Rejection

__all__ = ["EvaluationMemo"]


class EvaluationMemo:
    def __init__(self, max_entries: int = 8192) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        # (model spec, max_model_len, input, output tokens, SLO, dtype, hardware) -> result
        self._entries: OrderedDict[tuple[object, ...], Candidate | Rejection] = OrderedDict()
        self._bound: tuple[GearPerformance, PlannerConfig, Efficiency] | None = None
        self.num_hits = 0
        self.num_misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def bind(
        self, performance: GearPerformance, config: PlannerConfig, efficiency: Efficiency
    ) -> None:
        """The evaluations to come are made with these: forget any made with others."""
        bound = self._bound
        if bound is None or not (
            bound[0] is performance and bound[1] == config and bound[2] == efficiency
        ):
            self._entries.clear()
            self._bound = (performance, config, efficiency)

    def get(self, key: tuple[object, ...]) -> Candidate | Rejection | None:
        hit = self._entries.get(key)
        if hit is None:
            self.num_misses += 1
            return None
        self.num_hits += 1
        self._entries.move_to_end(key)
        return hit

    def put(self, key: tuple[object, ...], result: Candidate | Rejection) -> None:
        self._entries[key] = result
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
