"""The planner's memo of candidate evaluations across plans: the same plans, made faster."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from flexpipe.cluster import Cluster, load_cluster
from flexpipe.cluster.generate import generate_cluster
from flexpipe.perf.gear_lookup import GearEstimate, GearLookup, GearQuery
from flexpipe.perf.steady_state import Workload
from flexpipe.policies.planner import ModelDemand, PlannerConfig, parse_models, plan
from flexpipe.policies.planner.memo import EvaluationMemo

ROOT = Path(__file__).resolve().parents[2]
FOUR = ROOT / "examples" / "models" / "four-models.yaml"


def four_models() -> tuple[ModelDemand, ...]:
    return parse_models(yaml.safe_load(FOUR.read_text()), str(FOUR))


def ticks(cluster: Cluster, demands: tuple[ModelDemand, ...]) -> list[tuple[Cluster, tuple]]:
    """What a controller re-plans over: rates that move every tick, tenants that take and
    give back memory, a tier of the models alone (the shift policy's priority-first)."""
    out: list[tuple[Cluster, tuple]] = []
    gpus = [g.id for g in cluster.gpus]
    for k in range(4):
        c = cluster
        for j, gid in enumerate(gpus[k : k + 5]):
            share = (0.2 + 0.15 * j + 0.03 * k) % 1.0
            c = c.with_used(gid, share * c.gpu(gid).capacity_bytes, owner="tenant")
        rates = tuple(replace(d, request_rate_per_s=d.request_rate_per_s * (0.6 + 0.3 * k))
                      for d in demands)  # fmt: skip
        out.append((c, rates))
        out.append((c, rates[1:3]))
        out.append((cluster, rates))
    return out


def test_plans_with_a_memo_equal_plans_without() -> None:
    cluster = generate_cluster(6, 8, seed=2)
    demands = four_models()
    lookup = GearLookup()
    memo = EvaluationMemo()
    for c, ds in ticks(cluster, demands):
        fresh = plan(c, ds, now_s=0.0)
        memoised = plan(c, ds, lookup, now_s=0.0, memo=memo)
        assert memoised == fresh
        assert memoised.to_dict() == fresh.to_dict()
    assert memo.num_hits > memo.num_misses > 0  # it did the work of the later plans


def test_rejections_that_name_their_gpus_are_evaluated_again() -> None:
    # The seed's fragmented cluster: some GPUs too full for a model (reasons name the GPU).
    cluster = load_cluster(ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml")
    demands = four_models()
    memo = EvaluationMemo()
    lookup = GearLookup()
    for gid in ("gpu0", "gpu1", "gpu2", "gpu3", "gpu0"):
        c = cluster.with_used(gid, cluster.gpu(gid).capacity_bytes * 0.7, owner="tenant")
        assert plan(c, demands, lookup, memo=memo) == plan(c, demands)


class _Doubled:
    """A gear table that measures everything twice as fast as the prior."""

    def __init__(self) -> None:
        self.lookup = GearLookup()

    def estimate(self, query: GearQuery, workload: Workload) -> GearEstimate:
        e = self.lookup.estimate(query, workload)
        return replace(e, requests_per_s=2 * e.requests_per_s,
                       output_tokens_per_s=2 * e.output_tokens_per_s)  # fmt: skip


def test_another_lookup_or_config_clears_the_memo() -> None:
    cluster = generate_cluster(2, 8, seed=1)
    demands = four_models()
    memo = EvaluationMemo()
    plan(cluster, demands, GearLookup(), memo=memo)
    assert len(memo) > 0
    doubled = _Doubled()
    assert plan(cluster, demands, doubled, memo=memo) == plan(cluster, demands, doubled)
    config = PlannerConfig(target_utilization=0.5)
    assert plan(cluster, demands, doubled, config=config, memo=memo) == plan(
        cluster, demands, doubled, config=config
    )


def test_the_memo_is_bounded() -> None:
    cluster = generate_cluster(4, 8, seed=0)
    demands = four_models()
    memo = EvaluationMemo(max_entries=5)
    lookup = GearLookup()
    for c, ds in ticks(cluster, demands)[:6]:
        assert plan(c, ds, lookup, memo=memo) == plan(c, ds)
        assert len(memo) <= 5
    with pytest.raises(ValueError, match="max_entries"):
        EvaluationMemo(max_entries=0)


def test_a_topology_belongs_to_one_cluster_object() -> None:
    # A controller's cluster is one object from tick to tick: what plans derive from it is
    # kept with it; an equal cluster made later is another object, planned afresh.
    cluster = generate_cluster(2, 8, seed=1)
    demands = four_models()
    memo = EvaluationMemo()
    lookup = GearLookup()
    plan(cluster, demands, lookup, memo=memo)
    topo = memo.topology(cluster)
    assert topo.fast_domains and topo.results
    busier = tuple(replace(d, request_rate_per_s=3 * d.request_rate_per_s) for d in demands)
    assert plan(cluster, busier, lookup, memo=memo) == plan(cluster, busier)
    assert memo.topology(cluster) is topo
    first = cluster.gpu_ids[0]
    same = cluster.with_used(first, cluster.gpu(first).used_bytes, cluster.gpu(first).owner)
    assert same == cluster and memo.topology(same) is not topo
    plan(cluster, demands, GearLookup(), memo=memo)  # another lookup: evaluated again
    assert memo.topology(cluster) is not topo
