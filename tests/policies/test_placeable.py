"""The pure check of a model with no instance: can the planner place one instance of it,
alone, on the GPUs free to us (flexpipe/policies/shift/placeable.py)? Exact, on the seed's
fragmented 4-GPU cluster with the real planner."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path

from test_shift_policy import (
    CLUSTER,
    Sample,
    ShiftRecord,
    cached_planner,
    decide,
    demand,
    instance_key,
    policy,
    snap,
)

from flexpipe.cluster import Cluster, load_cluster
from flexpipe.policies.planner import ModelDemand, Plan, Slo, plan
from flexpipe.policies.shift import ModelState, ShiftParams, ShiftPolicy, ShiftSnapshot
from flexpipe.policies.shift.placeable import placement, unplaceable

WAKE = ShiftParams().wake_request_rate_per_s  # the rate a wake plans a model at


def taken(cluster: Cluster, *gpus: str, owner: str = "batch job") -> Cluster:
    for g in gpus:
        cluster = cluster.with_used(g, cluster.gpu(g).capacity_bytes, owner=owner)
    return cluster


ONLY_GPU2 = taken(CLUSTER, "gpu0", "gpu1", "gpu3")  # other tenants hold the rest


def test_a_model_too_big_for_every_free_gpu_is_unplaceable_with_the_planners_reason() -> None:
    big = demand(1.0, "big", "llama-2-70b")
    p = placement(CLUSTER, big, 0.0, cached_planner, WAKE)
    assert not p.placeable
    assert p.reason.startswith("no GPU free to us can place big (llama-2-70b): ")
    assert "minimum of 1 instance(s) not met" in p.reason  # the planner's own words
    # the same model fits a small one's GPUs: placeable, and where is said
    small = placement(CLUSTER, demand(1.0, "small", "llama-2-7b"), 0.0, cached_planner, WAKE)
    assert small.placeable and small.reason.startswith("one instance fits on ")


def test_every_gpu_held_by_other_tenants_makes_any_model_unplaceable() -> None:
    p = placement(taken(CLUSTER, *CLUSTER.gpu_ids), demand(), 0.0, cached_planner, WAKE)
    assert not p.placeable
    assert "gpu2 fully held by batch job" in p.reason


def test_a_gpu_our_own_instance_holds_counts_as_free() -> None:
    """llama-2-13b fits only gpu2, which our own instance of another model runs on: the
    cluster free to us shows gpu2 free (ours is re-planned), so it is placeable; were gpu2
    counted as taken (the reverted attempt's mistake), it would be refused for good."""
    m = demand(1.0, "mid", "llama-2-13b")
    assert placement(ONLY_GPU2, m, 0.0, cached_planner, WAKE).placeable
    assert not placement(
        taken(ONLY_GPU2, "gpu2", owner="flexpipe"), m, 0.0, cached_planner, WAKE
    ).placeable


def test_placeable_although_a_blacklist_stops_the_wake() -> None:
    """The wake's only target failed twice: the policy holds (blacklisted), the model stays
    placeable (held, not refused): the blacklist expires and the wake comes."""
    waiting = [Sample(40, 3, 100, None, None, 0.0)]
    woken = decide(policy(), snap((), waiting, rate=0.0, cluster=ONLY_GPU2), 40)
    assert woken.action == "shift" and woken.target is not None
    keys = tuple(instance_key(i) for i in woken.target)
    failed = (ShiftRecord(0.0, 10.0, False, keys), ShiftRecord(20.0, 30.0, False, keys))
    held = decide(policy(), snap((), waiting, rate=0.0, cluster=ONLY_GPU2, history=failed), 40)
    assert (held.action, held.trigger) == ("hold", "wake")
    assert any("blacklisted" in a.reason for a in held.alternatives)
    assert placement(ONLY_GPU2, demand(0.0), 40, cached_planner, WAKE).placeable


def test_a_gpu_reclaimed_within_the_planners_lease_does_not_count() -> None:
    """gpu2 free only 60 s more (< the planner's min_lease_s): 13b is unplaceable now."""
    m = demand(1.0, "mid", "llama-2-13b")
    soon = ONLY_GPU2.with_gpu("gpu2", free_until_s=60.0)
    p = placement(soon, m, 0.0, cached_planner, WAKE)
    assert not p.placeable and "gpu2 free only 60 s more" in p.reason


TWO_NODES = """
name: two-l4
defaults: {network: eth100, intra_node_link: cpu}
nodes:
  - {name: n0, gpus: [{id: g0, type: L4, index: 0}]}
  - {name: n1, gpus: [{id: g1, type: L4, index: 0}]}
"""


def test_a_model_the_wake_chains_across_two_nodes_is_placeable(tmp_path: Path) -> None:
    """llama-2-13b in bf16 fits no single L4; a wake places it as two pipeline stages, one
    per node (the planner's LP round, tried only for demand left uncovered: at no load it
    never runs). The check plans at the wake's rate, so it agrees with the wake."""
    (tmp_path / "c.yaml").write_text(TWO_NODES)
    cluster = load_cluster(tmp_path / "c.yaml")
    m = ModelDemand("m", "llama-2-13b", 1.0, 2048, 256, Slo(5.0, 0.2), ("bf16",))

    def planner(c: Cluster, ds: Sequence[ModelDemand], now_s: float) -> Plan:
        return plan(c, ds, now_s=now_s)

    waiting = (Sample(40, 3, 100, None, None, 0.0),)
    woken = ShiftPolicy(ShiftParams(), planner=planner).decide(
        ShiftSnapshot.of(cluster, (), [ModelState(m, waiting)]), 40.0, random.Random(7)
    )
    assert woken.action == "shift" and woken.trigger == "wake"
    assert woken.target is not None and {g for i in woken.target for g in i.gpu_ids} == {"g0", "g1"}
    idle = dataclasses.replace(m, request_rate_per_s=0.0)  # scaled to zero: no rate measured
    p = placement(cluster, idle, 40.0, planner, WAKE)
    assert p.placeable, p.reason
    assert not placement(cluster, idle, 40.0, planner, 0.0).placeable  # no load: no LP round


def test_unplaceable_refuses_only_with_no_gpu_due_back_within_the_hold() -> None:
    """The rule both controllers call: the models with no instance `placement` finds no room
    for, unless a GPU is due back (an occupation's end) within the hold: then they wait."""
    big, small = demand(1.0, "big", "llama-2-70b"), demand(1.0, "small", "llama-2-7b")
    args = (CLUSTER, (big, small), {"big", "small"}, 0.0, cached_planner, WAKE)
    refused = unplaceable(*args, next_change_in_s=None, hold_s=600.0)
    assert set(refused) == {"big"} and refused["big"].startswith("no GPU free to us can place big")
    assert unplaceable(*args, next_change_in_s=900.0, hold_s=600.0) == refused  # not in time
    assert unplaceable(*args, next_change_in_s=300.0, hold_s=600.0) == {}  # due back: wait
    assert unplaceable(CLUSTER, (big, small), set(), 0.0, cached_planner, WAKE, None, 600.0) == {}
