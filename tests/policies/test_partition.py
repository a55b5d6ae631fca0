"""The pipeline partitioner against brute force (seed 002's dynamic program)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.policies.partition import (
    InfeasiblePartition,
    StageCost,
    brute_force_partition,
    partition_layers,
    partition_weighted_layers,
)


def stage_strategy(index: int) -> st.SearchStrategy[StageCost]:
    return st.builds(
        StageCost,
        name=st.just(f"s{index}"),
        time_per_layer_s=st.floats(0.1, 10.0),
        max_layers=st.integers(1, 14),
        fixed_s=st.sampled_from([0.0, 0.0, 0.5, 3.0]),
        handoff_s=st.sampled_from([0.0, 0.1, 2.0]),
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, list[StageCost]]:
    num_stages = draw(st.integers(1, 4))
    stages = [draw(stage_strategy(i)) for i in range(num_stages)]
    num_layers = draw(st.integers(1, 14))
    return num_layers, stages


@settings(max_examples=300, deadline=None)
@given(cases())
def test_uniform_partition_matches_brute_force(case: tuple[int, list[StageCost]]) -> None:
    num_layers, stages = case
    expected = brute_force_partition([1.0] * num_layers, stages)
    if expected is None:
        with pytest.raises(InfeasiblePartition):
            partition_layers(num_layers, stages)
        return
    got = partition_layers(num_layers, stages)
    assert sum(got.layers_per_stage) == num_layers
    assert all(1 <= n <= s.max_layers for n, s in zip(got.layers_per_stage, stages, strict=True))
    assert math.isclose(got.bottleneck_s, expected.bottleneck_s, rel_tol=1e-9)


@settings(max_examples=300, deadline=None)
@given(cases(), st.data())
def test_weighted_dp_matches_brute_force(
    case: tuple[int, list[StageCost]], data: st.DataObject
) -> None:
    num_layers, stages = case
    weights = data.draw(st.lists(st.floats(0.2, 5.0), min_size=num_layers, max_size=num_layers))
    expected = brute_force_partition(weights, stages)
    if expected is None:
        with pytest.raises(InfeasiblePartition):
            partition_weighted_layers(weights, stages)
        return
    got = partition_weighted_layers(weights, stages)
    assert sum(got.layers_per_stage) == num_layers
    assert all(1 <= n <= s.max_layers for n, s in zip(got.layers_per_stage, stages, strict=True))
    assert math.isclose(got.bottleneck_s, expected.bottleneck_s, rel_tol=1e-9)


def test_faster_gpu_gets_more_layers() -> None:
    # A GPU twice as fast takes twice the layers; the slow-link hand-off costs the first stage.
    fast = StageCost("a100", time_per_layer_s=1.0, max_layers=32)
    slow = StageCost("a10g", time_per_layer_s=2.0, max_layers=32)
    got = partition_layers(30, [fast, slow])
    assert got.layers_per_stage == (20, 10)
    assert got.bottleneck_s == 20.0
    with_handoff = partition_layers(30, [StageCost("a100", 1.0, 32, handoff_s=3.0), slow])
    assert with_handoff.layers_per_stage == (19, 11)
    assert with_handoff.bottleneck_s == 22.0


def test_memory_cap_moves_layers_to_the_slower_stage() -> None:
    fast = StageCost("small-memory", time_per_layer_s=1.0, max_layers=8)
    slow = StageCost("big-memory", time_per_layer_s=3.0, max_layers=40)
    got = partition_layers(32, [fast, slow])
    assert got.layers_per_stage == (8, 24)
    assert got.bottleneck_s == 72.0


def test_infeasible_cases_say_why() -> None:
    with pytest.raises(InfeasiblePartition, match="hold at most 10 layers"):
        partition_layers(12, [StageCost("a", 1.0, 5), StageCost("b", 1.0, 5)])
    with pytest.raises(InfeasiblePartition, match="cannot fill 3 stages"):
        partition_layers(2, [StageCost(f"s{i}", 1.0, 5) for i in range(3)])
    with pytest.raises(InfeasiblePartition, match="cannot hold even one layer"):
        partition_weighted_layers([1.0] * 4, [StageCost("a", 1.0, 0), StageCost("b", 1.0, 8)])


def test_weighted_dp_balances_unequal_layers() -> None:
    # The seed's example: layer latencies differ; two equal GPUs.
    weights = [1.0, 1.0, 1.0, 1.0, 1.0, 4.0, 4.0]
    stages = [StageCost("g0", 1.0, 7), StageCost("g1", 1.0, 7)]
    got = partition_weighted_layers(weights, stages)
    assert got.layers_per_stage == (5, 2)
    assert got.bottleneck_s == 8.0
