"""The exact reference: every candidate instance of a small cluster, and an ILP over them.

Used by the tests and bench/planner_scale.py to measure the greedy planner's optimality gap;
never by the planner itself (highspy is a dev dependency). Candidates are a superset of the
greedy's: every TP group inside every fast domain (all subsets, not just the best), and every
ordered pipeline chain of disjoint groups up to `max_pp` stages, across nodes too.

ILP (HiGHS, branch and bound; see docs/planner.md for why HiGHS): the planner's own program
(relaxation.build_program: priority-weighted SLO-meeting requests/s, minimums, one instance per
GPU) with x integral, so the gap the tests measure is a gap in the objective the planner
optimises:

    maximise   sum_m p_m s_m  -  eps * sum_c gpus_c x_c
    subject to s_m <= rate_m,   s_m <= sum_{c of m} cap_c x_c,   sum_{c of m} x_c >= min_m
               sum_{c using g} x_c <= 1             for every GPU g
               x_c in {0, 1},  s_m >= 0
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from flexpipe.cluster import Cluster
from flexpipe.model_spec import load_model_spec
from flexpipe.perf import Efficiency
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner.candidates import Candidate, Evaluator
from flexpipe.policies.planner.greedy import usable_gpus
from flexpipe.policies.planner.performance import GearPerformance
from flexpipe.policies.planner.relaxation import build_program, mark_integral
from flexpipe.policies.planner.types import ModelDemand, PlannerConfig

__all__ = ["ExactResult", "all_candidates", "node_pool_candidates", "solve_exact"]

_TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class ExactResult:
    objective: float  # sum_m priority_m x served requests/s: compare with Plan.weighted_goodput
    served_requests_per_s: tuple[float, ...]  # per model
    goodput_tokens_per_s: float  # served requests x output tokens, summed (for reports)
    num_gpus: int
    chosen: tuple[Candidate, ...]
    num_candidates: int


def all_candidates(
    cluster: Cluster,
    demands: Sequence[ModelDemand],
    performance: GearPerformance | None = None,
    config: PlannerConfig | None = None,
    now_s: float = 0.0,
    efficiency: Efficiency | None = None,
    max_gpus: int = 12,
) -> list[Candidate]:
    """Every feasible candidate instance (small clusters only: exponential)."""
    config = config or PlannerConfig()
    demands = tuple(demands)
    usable, _ = usable_gpus(cluster, now_s, config)
    if len(usable) > max_gpus:
        raise ValueError(f"{len(usable)} usable GPUs; the exact reference handles <= {max_gpus}")
    specs = tuple(load_model_spec(d.model) for d in demands)
    evaluator = Evaluator(
        cluster,
        demands,
        specs,
        performance or GearLookup(efficiency=efficiency),
        config,
        efficiency,
    )
    allowed = set(usable)
    domains: list[list[str]] = []
    for domain in cluster.fast_domains(config.fast_link_bytes_per_s):
        per_node: dict[str, list[str]] = {}
        for gid in domain:
            if gid in allowed:
                per_node.setdefault(cluster.gpu(gid).node, []).append(gid)
        domains.extend(per_node.values())
    out: list[Candidate] = []
    for m, demand in enumerate(demands):
        for tp in _TP_SIZES:
            if specs[m].num_heads % tp:
                continue
            groups = [g for d in domains for g in itertools.combinations(d, tp)]
            for pp in range(1, config.max_pp + 1):
                for chain in itertools.permutations(groups, pp):
                    flat = [g for grp in chain for g in grp]
                    if len(set(flat)) != len(flat):
                        continue
                    for dtype in demand.dtypes:
                        result = evaluator.evaluate(m, tuple(chain), dtype)
                        if isinstance(result, Candidate):
                            out.append(result)
    return out


def solve_exact(
    candidates: Sequence[Candidate],
    demands: Sequence[ModelDemand],
    min_counts: Sequence[int] | None = None,
) -> ExactResult:
    """The ILP optimum over `candidates` (HiGHS). `min_counts` as in `build_program` (default:
    every demand's `min_instances`); raises ValueError when the minimums cannot all be met."""
    import highspy

    demands = tuple(demands)
    num_c = len(candidates)
    h = build_program(highspy, candidates, demands, min_counts)
    h.setOptionValue("mip_rel_gap", 1e-9)
    mark_integral(highspy, h, num_c)
    h.run()
    solution = h.getSolution()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal or not solution.value_valid:
        raise ValueError(f"no optimum: {h.modelStatusToString(h.getModelStatus())}")
    values = list(solution.col_value)
    chosen = tuple(c for j, c in enumerate(candidates) if values[j] > 0.5)
    served = tuple(max(0.0, v) for v in values[num_c:])
    return ExactResult(
        objective=sum(d.priority * s for d, s in zip(demands, served, strict=True)),
        served_requests_per_s=served,
        goodput_tokens_per_s=sum(d.output_tokens * s for d, s in zip(demands, served, strict=True)),
        num_gpus=sum(c.num_gpus for c in chosen),
        chosen=chosen,
        num_candidates=num_c,
    )


def node_pool_candidates(
    cluster: Cluster,
    demands: Sequence[ModelDemand],
    performance: GearPerformance | None = None,
    config: PlannerConfig | None = None,
    now_s: float = 0.0,
) -> list[Candidate]:
    """A large-cluster reference pool: per node, every model x precision x tp x pp on aligned
    blocks of the node's GPUs (sorted by free memory inside each fast domain): TP groups are
    consecutive `tp` GPUs of a domain, chains consecutive `pp` groups. Disjoint copies let the
    ILP mix shapes like a buddy allocator (a tp=4 block, a tp=2 pair and two singles)."""
    config = config or PlannerConfig()
    demands = tuple(demands)
    usable, _ = usable_gpus(cluster, now_s, config)
    allowed = set(usable)
    specs = tuple(load_model_spec(d.model) for d in demands)
    evaluator = Evaluator(cluster, demands, specs, performance or GearLookup(), config)
    node_domains: dict[str, list[list[str]]] = {}
    for domain in cluster.fast_domains(config.fast_link_bytes_per_s):
        per_node: dict[str, list[str]] = {}
        for gid in domain:
            if gid in allowed:
                per_node.setdefault(cluster.gpu(gid).node, []).append(gid)
        for node, ids in per_node.items():
            ids.sort(key=lambda g: (-cluster.gpu(g).free_bytes, g))
            node_domains.setdefault(node, []).append(ids)
    out: list[Candidate] = []
    for domains in node_domains.values():
        for m, demand in enumerate(demands):
            for tp in _TP_SIZES:
                if specs[m].num_heads % tp:
                    continue
                groups = [
                    tuple(d[i * tp : (i + 1) * tp]) for d in domains for i in range(len(d) // tp)
                ]
                for pp in range(1, config.max_pp + 1):
                    for start in range(0, len(groups) - pp + 1, pp):
                        chain = tuple(groups[start : start + pp])
                        for dtype in demand.dtypes:
                            result = evaluator.evaluate(m, chain, dtype)
                            if isinstance(result, Candidate):
                                out.append(result)
    return out
