"""The exact reference: every candidate instance of a small cluster, and an ILP over them.

Used by the tests and bench/planner_scale.py to measure the greedy planner's optimality gap;
never by the planner itself (highspy is a dev dependency). Candidates are a superset of the
greedy's: every TP group inside every fast domain (all subsets, not just the best), and every
ordered pipeline chain of disjoint groups up to `max_pp` stages, across nodes too.

ILP (HiGHS, branch and bound; see docs/planner.md for why HiGHS):

    maximise   sum_m s_m  -  eps * sum_c gpus_c x_c
    subject to s_m <= demand_m,   s_m <= sum_{c of m} capacity_c x_c
               sum_{c using g} x_c <= 1             for every GPU g
               x_c in {0, 1},  s_m >= 0
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from flexpipe.cluster import Cluster
from flexpipe.gears.lookup import GearLookup
from flexpipe.model_spec import load_model_spec
from flexpipe.perf import Efficiency
from flexpipe.policies.planner.candidates import Candidate, Evaluator
from flexpipe.policies.planner.core import usable_gpus
from flexpipe.policies.planner.performance import GearPerformance
from flexpipe.policies.planner.relaxation import quiet_highs
from flexpipe.policies.planner.types import ModelDemand, PlannerConfig

__all__ = ["ExactResult", "all_candidates", "node_pool_candidates", "solve_exact"]

_TP_SIZES = (1, 2, 4, 8)
# Tie-break weight per GPU, relative to one token/s: "fewest GPUs" without trading goodput.
_GPU_EPS = 1e-3


@dataclass(frozen=True, slots=True)
class ExactResult:
    goodput_tokens_per_s: float
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


def solve_exact(candidates: Sequence[Candidate], demands: Sequence[ModelDemand]) -> ExactResult:
    """The ILP optimum over `candidates` (HiGHS)."""
    import highspy
    import numpy as np

    h = quiet_highs(highspy)
    h.setOptionValue("mip_rel_gap", 1e-9)
    inf = highspy.kHighsInf
    num_c = len(candidates)
    for c in candidates:
        h.addCol(-_GPU_EPS * c.num_gpus, 0.0, 1.0, 0, np.array([], np.int32), np.array([]))
    for d in demands:
        h.addCol(1.0, 0.0, d.demand_tokens_per_s, 0, np.array([], np.int32), np.array([]))
    if num_c:
        h.changeColsIntegrality(
            num_c,
            np.arange(num_c, dtype=np.int32),
            np.array([highspy.HighsVarType.kInteger] * num_c),
        )
    # s_m - sum capacity_c x_c <= 0
    for m in range(len(demands)):
        idx = [j for j, c in enumerate(candidates) if c.model_index == m]
        vals = [-candidates[j].capacity_tokens_per_s for j in idx]
        h.addRow(
            -inf,
            0.0,
            len(idx) + 1,
            np.array([*idx, num_c + m], np.int32),
            np.array([*vals, 1.0]),
        )
    by_gpu: dict[str, list[int]] = {}
    for j, c in enumerate(candidates):
        for g in c.gpu_ids:
            by_gpu.setdefault(g, []).append(j)
    for idx in by_gpu.values():
        h.addRow(-inf, 1.0, len(idx), np.array(idx, np.int32), np.ones(len(idx)))
    h.changeObjectiveSense(highspy.ObjSense.kMaximize)
    h.run()
    values = list(h.getSolution().col_value)
    chosen = tuple(c for j, c in enumerate(candidates) if values[j] > 0.5)
    goodput = sum(values[num_c + m] for m in range(len(demands)))
    return ExactResult(
        goodput_tokens_per_s=goodput,
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
