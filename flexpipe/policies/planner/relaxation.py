"""The LP relaxation of candidate selection, solved with HiGHS (docs/planner.md).

Over a pool of candidate instances `c` (model `m_c`, GPUs, capacity `cap_c` SLO-meeting
requests/s), with each model's priority `p_m`, request rate `rate_m` and minimum `min_m`:

    maximise   sum_m p_m s_m  -  eps * sum_c gpus_c x_c
    subject to s_m <= rate_m,   s_m <= sum_{c of m} cap_c x_c
               sum_{c of m} x_c >= min_m                for every model with a minimum
               sum_{c using g} x_c <= 1                 for every GPU g
               0 <= x_c <= 1,  s_m >= 0

`build_program` writes this program once; the exact reference (`exact.py`) solves the same
program with x integral, so the planner and its reference optimise one objective. Relaxed, it
takes milliseconds (1,024 GPUs: ~5,000 columns, 30 ms) and its solution is nearly integral:
the GPU rows pack each node, and only the few demand rows couple the nodes, so few columns
are fractional. The planner rounds it (`core.py`): whole columns first, then fractional ones
by value, then the greedy fills what is left.

HiGHS's simplex is deterministic (no time limit), so the planner stays pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flexpipe.policies.planner.candidates import Candidate
from flexpipe.policies.planner.types import ModelDemand

__all__ = [
    "GPU_EPS",
    "Relaxation",
    "build_program",
    "mark_integral",
    "quiet_highs",
    "solve_relaxation",
]

# Tie-break weight per GPU, relative to one priority-weighted request/s: "fewest GPUs" without
# trading goodput (a request/s of a 256-token answer is 256 tok/s; this was 1e-3 per tok/s).
GPU_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class Relaxation:
    x: tuple[float, ...]  # per pool candidate, in [0, 1]
    objective: float  # the optimum's sum_m p_m s_m: an upper bound for the pool
    served_requests_per_s: tuple[float, ...]  # per model: s_m
    model_prices: tuple[float, ...]  # per model: the dual of its capacity row


def quiet_highs(highspy: Any) -> Any:
    """A HiGHS instance that prints nothing. `highspy.Highs()` enables callbacks in its
    constructor, which prints the "Running HiGHS ..." banner to stdout before `output_flag`
    can be cleared (it would corrupt `flexpipe plan --json`); its pybind base class does not
    (HiGHS logs nothing once `output_flag` is false before any other call)."""
    cls = getattr(getattr(highspy, "_core", None), "_Highs", None) or highspy.Highs
    h = cls()
    h.setOptionValue("output_flag", False)
    return h


def build_program(
    highspy: Any,
    candidates: Sequence[Candidate],
    demands: Sequence[ModelDemand],
    min_counts: Sequence[int] | None = None,
) -> Any:
    """The program of the module docstring in a fresh, quiet HiGHS instance (x continuous;
    the caller marks it integral). Columns: candidates, then one `s_m` per model. Rows: one
    capacity row per model, then the minimum rows, then one row per GPU. `min_counts`:
    per model the minimum to enforce (default: each demand's `min_instances`); a caller that
    knows a minimum cannot be met passes what can."""
    import numpy as np

    h = quiet_highs(highspy)
    # (Not `threads`: HiGHS's thread pool is process-wide, and asking for another size after
    # a first solve makes every later run fail. The dual simplex it uses for LPs is serial.)
    inf = highspy.kHighsInf
    num_c, num_m = len(candidates), len(demands)
    upper = np.array([1.0] * num_c + [d.request_rate_per_s for d in demands])
    h.addVars(num_c + num_m, np.zeros(num_c + num_m), upper)
    cost = np.array([-GPU_EPS * c.num_gpus for c in candidates] + [d.priority for d in demands])
    h.changeColsCost(num_c + num_m, np.arange(num_c + num_m, dtype=np.int32), cost)
    by_model: list[list[int]] = [[] for _ in range(num_m)]
    by_gpu: dict[str, list[int]] = {}
    for j, c in enumerate(candidates):
        by_model[c.model_index].append(j)
        for g in c.gpu_ids:
            by_gpu.setdefault(g, []).append(j)
    for m, idx in enumerate(by_model):  # s_m - sum cap_c x_c <= 0
        vals = [-candidates[j].capacity_requests_per_s for j in idx]
        h.addRow(
            -inf, 0.0, len(idx) + 1, np.array([*idx, num_c + m], np.int32), np.array([*vals, 1.0])
        )
    minimums = list(min_counts) if min_counts is not None else [d.min_instances for d in demands]
    for m, idx in enumerate(by_model):  # sum x_c >= min_m
        if minimums[m] > 0:
            h.addRow(float(minimums[m]), inf, len(idx), np.array(idx, np.int32), np.ones(len(idx)))
    for idx in by_gpu.values():
        h.addRow(-inf, 1.0, len(idx), np.array(idx, np.int32), np.ones(len(idx)))
    h.changeObjectiveSense(highspy.ObjSense.kMaximize)
    return h


def mark_integral(highspy: Any, h: Any, num_candidates: int) -> None:
    import numpy as np

    if num_candidates:
        h.changeColsIntegrality(
            num_candidates,
            np.arange(num_candidates, dtype=np.int32),
            np.array([highspy.HighsVarType.kInteger] * num_candidates),
        )


def solve_relaxation(
    candidates: Sequence[Candidate],
    demands: Sequence[ModelDemand],
    integral: bool = False,
    max_nodes: int = 20_000,
    min_counts: Sequence[int] | None = None,
) -> Relaxation | None:
    """The LP optimum over `candidates`; None when highspy is not installed or HiGHS found
    no optimum (the planner then keeps the greedy's plan and says so). `integral`: the ILP
    instead (small pools: branch and bound, at most `max_nodes` nodes — a deterministic
    limit, unlike a time limit — keeping the best solution found)."""
    try:
        import highspy
        import numpy  # noqa: F401
    except ImportError:
        return None
    num_c, num_m = len(candidates), len(demands)
    h = build_program(highspy, candidates, demands, min_counts)
    if integral and num_c:
        h.setOptionValue("mip_rel_gap", 1e-6)
        h.setOptionValue("mip_max_nodes", max_nodes)
        mark_integral(highspy, h, num_c)
    h.run()
    status = h.getModelStatus()
    limits = (highspy.HighsModelStatus.kSolutionLimit, highspy.HighsModelStatus.kIterationLimit)
    solution = h.getSolution()
    if not solution.value_valid or not (
        status == highspy.HighsModelStatus.kOptimal or (integral and status in limits)
    ):
        return None
    values = list(solution.col_value)
    duals = list(solution.row_dual) if not integral else [0.0] * num_m
    served = [max(0.0, v) for v in values[num_c:]]
    return Relaxation(
        x=tuple(min(1.0, max(0.0, v)) for v in values[:num_c]),
        objective=float(sum(d.priority * s for d, s in zip(demands, served, strict=True))),
        served_requests_per_s=tuple(served),
        model_prices=tuple(float(abs(v)) for v in duals[:num_m]),
    )
