"""Which leaving instances sleep, and how deep (control/core/sleeping.py, pure): level 1 where
the node's host RAM still holds the weights, level 2 (auto) or a stop (level1) where it does
not, nothing with sleep mode off or an engine kind that cannot sleep, and a stop for an
instance on a GPU that is gone or that another tenant holds whole."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import yaml

from flexpipe.cluster import Cluster, load_cluster
from flexpipe.control.core.sleeping import host_ram_by_node, sleep_levels, sleep_mode_on
from flexpipe.perf import PerfModel
from flexpipe.policies.planner import PlannedInstance, parse_models, plan
from flexpipe.policies.shift.migration import perf_model_of
from flexpipe.policies.shift.snapshot import instance_key

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = load_cluster(ROOT / "examples/clusters/fragmented-4gpu.yaml")
(DEMAND,) = parse_models(yaml.safe_load((ROOT / "examples/models/llama-7b.yaml").read_text()), "m")
PAIR, L40S, L4 = plan(CLUSTER, [DEMAND]).instances


def pm(cluster: Cluster) -> Callable[[PlannedInstance], PerfModel]:
    return lambda p: perf_model_of(cluster, p)


def with_host_ram(cluster: Cluster, node: str, num_bytes: float) -> Cluster:
    nodes = tuple(
        replace(n, host_ram_bytes=num_bytes) if n.name == node else n for n in cluster.nodes
    )
    return replace(cluster, nodes=nodes)


def levels(
    mode: str,
    cluster: Cluster,
    leaving: list[PlannedInstance],
    asleep: Sequence[PlannedInstance] = (),
) -> dict[str, int]:
    return sleep_levels(mode, (1, 2), cluster, leaving, asleep, pm(cluster))


def test_level_one_where_the_nodes_host_ram_holds_the_weights_else_two_or_a_stop() -> None:
    node = CLUSTER.gpu("gpu3").node
    weights = host_ram_by_node(CLUSTER, perf_model_of(CLUSTER, L40S))[node]
    assert weights > 0
    assert levels("auto", CLUSTER, [L40S]) == {instance_key(L40S): 1}
    small = with_host_ram(CLUSTER, node, weights - 1)
    assert levels("auto", small, [L40S]) == {instance_key(L40S): 2}
    assert levels("level1", small, [L40S]) == {}
    assert levels("off", CLUSTER, [L40S]) == {}
    # room for one copy: the second leaving instance on that node sleeps deeper
    one = with_host_ram(CLUSTER, node, weights * 1.5)
    assert levels("auto", one, [L40S, L40S]) == {instance_key(L40S): 2}
    # a level-1 sleeper there already holds the room
    assert levels("auto", one, [L40S], [L40S]) == {instance_key(L40S): 2}


def test_a_kind_without_sleep_levels_never_sleeps_and_a_taken_gpu_is_stopped() -> None:
    assert not sleep_mode_on("auto", ())
    assert sleep_mode_on("level1", (1, 2)) and not sleep_mode_on("level1", (2,))
    assert sleep_levels("auto", (), CLUSTER, [L4], (), pm(CLUSTER)) == {}
    taken = CLUSTER.with_used("gpu0", CLUSTER.gpu("gpu0").capacity_bytes, owner="tenant-b")
    assert levels("auto", taken, [L4, L40S]) == {instance_key(L40S): 1}
