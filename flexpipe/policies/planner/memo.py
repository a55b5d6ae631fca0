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

`topology(cluster)`: what plans derive from one cluster object: its fast-link domains, the
slowest link of a TP group, the link between two GPUs, each GPU's free memory, and each
candidate's evaluation (per model shape: the same inputs as the memo's key, with the GPU ids
instead of the hardware). A controller's cluster stays one (immutable) object from tick to
tick until its GPUs change, and each re-plan derived all of it again (half of a re-plan on
256 GPUs). Kept for the last few cluster objects planned on; a topology holds its cluster,
so an equal one made later is never mistaken for it, and rebinding (`bind`) forgets them
with the evaluations.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flexpipe.cluster import Cluster
from flexpipe.hardware import LinkSpec
from flexpipe.perf import Efficiency
from flexpipe.policies.planner.performance import GearPerformance
from flexpipe.policies.planner.types import PlannerConfig

if TYPE_CHECKING:
    from flexpipe.policies.planner.candidates import Candidate, Rejection

__all__ = ["EvaluationMemo", "Topology"]

_MAX_TOPOLOGIES = 8  # the cluster, and the derived ones a tick's candidates plan on


@dataclass(slots=True)
class Topology:
    """What plans on `cluster` derive from its links (filled as they ask)."""

    cluster: Cluster
    # min bandwidth -> `cluster.fast_domains(min bandwidth)`
    fast_domains: dict[float, list[tuple[str, ...]]] = field(default_factory=dict)
    tp_links: dict[tuple[str, ...], LinkSpec] = field(default_factory=dict)  # group -> slowest
    pair_links: dict[tuple[str, str], LinkSpec] = field(default_factory=dict)  # (a, b) -> link
    # (model index, model spec, max_model_len, input, output tokens, SLO) ->
    # (stages, dtype) -> that model's evaluation on those GPUs of this cluster
    results: dict[tuple[object, ...], dict[tuple[object, ...], Candidate | Rejection]] = field(
        default_factory=dict
    )

    gpus: dict[str, tuple[str, float]] | None = None  # GPU id -> (type, free bytes)

    def free(self) -> dict[str, tuple[str, float]]:
        """Each GPU's type and free bytes."""
        if self.gpus is None:
            self.gpus = {g.id: (g.type, g.free_bytes) for g in self.cluster.gpus}
        return self.gpus

    def domains(self, min_bandwidth_bytes_per_s: float) -> list[tuple[str, ...]]:
        got = self.fast_domains.get(min_bandwidth_bytes_per_s)
        if got is None:
            got = self.fast_domains[min_bandwidth_bytes_per_s] = self.cluster.fast_domains(
                min_bandwidth_bytes_per_s
            )
        return got


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
        self._topologies: list[Topology] = []  # most recently planned on last

    def topology(self, cluster: Cluster) -> Topology:
        """What plans derive from `cluster` (this very object: see the module docstring)."""
        tops = self._topologies
        for i, topo in enumerate(tops):
            if topo.cluster is cluster:
                if i != len(tops) - 1:
                    tops.append(tops.pop(i))
                return topo
        topo = Topology(cluster)
        tops.append(topo)
        del tops[:-_MAX_TOPOLOGIES]
        return topo

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
            self._topologies.clear()
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
