"""Pipeline partitioning over unequal GPUs (seed 002): split a model's layers into contiguous
pipeline stages so that the slowest stage is as fast as possible.

A pipeline runs at the pace of its slowest stage, so the partitioner minimises
`max_k stage_time_k`, where stage k (an ordered list of GPUs or TP groups) spends
`fixed_s + handoff_s + time_per_layer_s * (sum of its layers' weights)` per step and may hold
at most `max_layers` layers (what its memory fits). Two exact methods:

* `partition_layers` with uniform layer weights (every transformer layer costs the same,
  which is what the performance model says): a threshold search. For a bottleneck T, stage k
  can take at most `a_k(T) = min(max_layers_k, floor((T - fixed_k - handoff_k) / t_k))`
  layers; T is feasible iff every `a_k >= 1` and `sum a_k >= L`. The optimum is one of the
  S*L values `fixed_k + handoff_k + n * t_k`, so a binary search over them is exact and takes
  O(S L log(S L)).
* `partition_weighted_layers`: the seed's dynamic program for arbitrary per-layer costs
  (measured per-layer latencies), O(S L^2): `best[k][i] = min_j max(best[k-1][j],
  cost_k(j..i))`.

`brute_force_partition` enumerates every composition; the tests check both against it.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "InfeasiblePartition",
    "Partition",
    "StageCost",
    "brute_force_partition",
    "partition_layers",
    "partition_weighted_layers",
]

# Relative slack when comparing float stage times (equal bottlenecks from different splits).
_REL_EPS = 1e-12


class InfeasiblePartition(ValueError):
    """No split fits: too few layers for the stages, or not enough memory in total."""


@dataclass(frozen=True, slots=True)
class StageCost:
    """One pipeline stage as the partitioner sees it.

    time_per_layer_s: the stage's time for one (weight-1) layer at the batch being balanced.
    fixed_s: time that does not depend on its layers (the lm_head on the last stage).
    handoff_s: sending the hidden states to the next stage (0 for the last).
    max_layers: the most layers its memory holds (with the KV the demand needs).
    """

    name: str
    time_per_layer_s: float
    max_layers: int
    fixed_s: float = 0.0
    handoff_s: float = 0.0

    def __post_init__(self) -> None:
        if self.time_per_layer_s <= 0 or self.fixed_s < 0 or self.handoff_s < 0:
            raise ValueError(f"stage {self.name}: times must be positive (per layer) / >= 0")

    def time_s(self, layer_weight: float) -> float:
        return self.fixed_s + self.handoff_s + self.time_per_layer_s * layer_weight


@dataclass(frozen=True, slots=True)
class Partition:
    layers_per_stage: tuple[int, ...]
    stage_times_s: tuple[float, ...]

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_times_s)

    @property
    def imbalance(self) -> float:
        """Slowest over fastest stage time (1.0: perfectly balanced)."""
        return max(self.stage_times_s) / max(min(self.stage_times_s), 1e-300)


def _check(num_layers: int, stages: Sequence[StageCost]) -> None:
    if not stages:
        raise InfeasiblePartition("a pipeline needs at least one stage")
    if num_layers < len(stages):
        raise InfeasiblePartition(
            f"{num_layers} layers cannot fill {len(stages)} stages (each needs at least one)"
        )
    room = sum(max(0, s.max_layers) for s in stages)
    short = [s.name for s in stages if s.max_layers < 1]
    if short:
        raise InfeasiblePartition(f"stage(s) {', '.join(short)} cannot hold even one layer")
    if room < num_layers:
        raise InfeasiblePartition(
            f"the stages hold at most {room} layers together; the model has {num_layers}"
        )


def _layers_within(stage: StageCost, bottleneck_s: float, num_layers: int) -> int:
    """Most layers `stage` can take without exceeding `bottleneck_s`."""
    room_s = bottleneck_s - stage.fixed_s - stage.handoff_s
    n = math.floor(room_s / stage.time_per_layer_s * (1 + _REL_EPS) + _REL_EPS)
    return max(0, min(n, stage.max_layers, num_layers))


def partition_layers(num_layers: int, stages: Sequence[StageCost]) -> Partition:
    """Exact min-bottleneck split of `num_layers` equal layers over `stages` (in order)."""
    _check(num_layers, stages)
    lo = max(s.time_s(1) for s in stages)  # every stage holds at least one layer
    values = sorted(
        {
            v
            for s in stages
            for n in range(1, min(s.max_layers, num_layers) + 1)
            if (v := s.time_s(n)) >= lo
        }
    )

    def feasible(t: float) -> bool:
        return sum(_layers_within(s, t, num_layers) for s in stages) >= num_layers

    # The largest value is always feasible (_check: total room >= L, each stage >= 1 layer).
    index = bisect.bisect_left(range(len(values)), True, key=lambda i: feasible(values[i]))
    bottleneck = values[index]
    caps = [_layers_within(s, bottleneck, num_layers) for s in stages]
    # Give every stage one layer, then fill up to each cap in order; any fill within the caps
    # keeps the bottleneck. Filling the fastest stages first keeps the others light.
    layers = [1] * len(stages)
    left = num_layers - len(stages)
    order = sorted(range(len(stages)), key=lambda k: (stages[k].time_per_layer_s, k))
    for k in order:
        take = min(left, caps[k] - 1)
        layers[k] += take
        left -= take
    assert left == 0
    times = tuple(s.time_s(n) for s, n in zip(stages, layers, strict=True))
    return Partition(tuple(layers), times)


def partition_weighted_layers(
    layer_weights: Sequence[float], stages: Sequence[StageCost]
) -> Partition:
    """Seed 002's dynamic program for layers of unequal cost (weights, e.g. measured
    per-layer latencies relative to a reference layer), exact, O(S L^2)."""
    num_layers = len(layer_weights)
    _check(num_layers, stages)
    prefix = [0.0, *itertools.accumulate(layer_weights)]
    inf = math.inf
    num_stages = len(stages)
    # best[k][i]: the smallest bottleneck putting layers [0, i) on stages 0..k
    best = [[inf] * (num_layers + 1) for _ in range(num_stages)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages)]
    for i in range(1, min(stages[0].max_layers, num_layers) + 1):
        best[0][i] = stages[0].time_s(prefix[i])
    for k in range(1, num_stages):
        st = stages[k]
        for i in range(k + 1, num_layers + 1):
            lo_j = max(k, i - st.max_layers)
            for j in range(lo_j, i):
                if best[k - 1][j] == inf:
                    continue
                value = max(best[k - 1][j], st.time_s(prefix[i] - prefix[j]))
                if value < best[k][i]:
                    best[k][i] = value
                    cut[k][i] = j
    if best[-1][num_layers] == inf:
        raise InfeasiblePartition("no split fits the stages' memory")
    layers: list[int] = []
    i = num_layers
    for k in range(num_stages - 1, 0, -1):
        j = cut[k][i]
        layers.append(i - j)
        i = j
    layers.append(i)
    layers.reverse()
    return _partition_of(layer_weights, stages, layers)


def _partition_of(
    layer_weights: Sequence[float], stages: Sequence[StageCost], layers: Sequence[int]
) -> Partition:
    times = []
    start = 0
    for s, n in zip(stages, layers, strict=True):
        times.append(s.time_s(sum(layer_weights[start : start + n])))
        start += n
    return Partition(tuple(layers), tuple(times))


def brute_force_partition(
    layer_weights: Sequence[float], stages: Sequence[StageCost]
) -> Partition | None:
    """Try every composition (small cases only: C(L-1, S-1) of them); None if none fits."""
    num_layers = len(layer_weights)
    num_stages = len(stages)
    if num_stages == 0 or num_layers < num_stages:
        return None
    best: Partition | None = None
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        layers = [b - a for a, b in itertools.pairwise(bounds)]
        if any(n > s.max_layers for n, s in zip(layers, stages, strict=True)):
            continue
        candidate = _partition_of(layer_weights, stages, layers)
        if best is None or candidate.bottleneck_s < best.bottleneck_s:
            best = candidate
    return best
