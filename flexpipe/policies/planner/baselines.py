"""Baselines a plan is compared with: one group of GPUs as a static deployment would use it
(`single_group_baseline`), and seed 000 §4.1's "four identical GPUs, fully connected" wait.
Pure.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from flexpipe.cluster import Cluster
from flexpipe.model_spec import load_model_spec
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner.candidates import Candidate, Evaluator, Rejection, describe
from flexpipe.policies.planner.greedy import GreedyPlanner
from flexpipe.policies.planner.performance import GearPerformance
from flexpipe.policies.planner.types import (
    Baseline,
    ModelDemand,
    PlannerConfig,
)

__all__ = ["baselines", "single_group_baseline"]


def _factorisations(n: int, num_heads: int) -> list[tuple[int, int]]:
    return [(tp, n // tp) for tp in range(1, n + 1) if n % tp == 0 and num_heads % tp == 0]


def single_group_baseline(
    planner_or_cluster: GreedyPlanner | Cluster,
    demands: Sequence[ModelDemand] | None,
    gpu_ids: Sequence[str],
    model_index: int = 0,
    performance: GearPerformance | None = None,
    config: PlannerConfig | None = None,
) -> Candidate | Rejection:
    """The best single instance over exactly `gpu_ids`, TP allowed across any link (the
    "forced one big group" a fixed deployment template builds). Tries every tp x pp and stage
    order; small groups only."""
    if isinstance(planner_or_cluster, GreedyPlanner):
        evaluator = planner_or_cluster.evaluator
        demand = planner_or_cluster.demands[model_index]
    else:
        assert demands is not None
        cfg = config or PlannerConfig()
        demands = tuple(demands)
        specs = tuple(load_model_spec(d.model) for d in demands)
        evaluator = Evaluator(planner_or_cluster, demands, specs, performance or GearLookup(), cfg)
        demand = demands[model_index]
    ids = list(gpu_ids)
    best: Candidate | Rejection | None = None
    spec = evaluator.specs[model_index]
    for tp, pp in _factorisations(len(ids), spec.num_heads):
        for order in itertools.permutations(ids):
            stages = tuple(tuple(order[k * tp : (k + 1) * tp]) for k in range(pp))
            for dtype in demand.dtypes:
                result = evaluator.evaluate(model_index, stages, dtype)
                if isinstance(result, Candidate):
                    if not isinstance(best, Candidate) or (
                        result.capacity_tokens_per_s > best.capacity_tokens_per_s
                    ):
                        best = result
                elif best is None:
                    best = result
    assert best is not None
    return best


def baselines(planner: GreedyPlanner, used: list[str]) -> list[Baseline]:
    out: list[Baseline] = []
    m = 0
    demand = planner.demands[m]
    group = single_group_baseline(planner, None, used, m)
    if isinstance(group, Candidate):
        goodput = min(demand.demand_tokens_per_s, group.capacity_tokens_per_s)
        detail = f"{describe(group.stages, group.gear)}, batch {group.estimate.batch}"
    else:
        goodput = 0.0
        detail = group.reason
    out.append(
        Baseline(
            "one-group",
            f"one {demand.name} instance over all {len(used)} GPUs the plan uses "
            "(TP allowed across any link)",
            goodput,
            detail,
        )
    )
    out.append(_wait_for_identical(planner, m, 4))
    return out


def _wait_for_identical(planner: GreedyPlanner, m: int, n: int) -> Baseline:
    """A fixed template: tp=n on n identical, fully free GPUs joined by fast links."""
    demand = planner.demands[m]
    name = f"wait-for-{n}-identical"
    description = f"a fixed tp={n} template that needs {n} identical, fully free, fast-linked GPUs"
    for domain in planner.cluster.fast_domains(planner.config.fast_link_bytes_per_s):
        by_type: dict[str, list[str]] = {}
        for gid in domain:
            gpu = planner.cluster.gpu(gid)
            if gpu.used_bytes == 0 and gid in planner.free_bytes:
                by_type.setdefault(gpu.type, []).append(gid)
        for ids in by_type.values():
            if len(ids) >= n:
                result = planner.evaluator.evaluate(m, (tuple(ids[:n]),), demand.dtypes[0])
                if isinstance(result, Candidate):
                    return Baseline(
                        name,
                        description,
                        min(demand.demand_tokens_per_s, result.capacity_tokens_per_s),
                        describe(result.stages, result.gear),
                    )
    return Baseline(
        name, description, 0.0, f"no {n} such GPUs are free now: it serves nothing until they are"
    )
