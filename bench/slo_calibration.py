"""The SLO-capacity model (flexpipe.perf.slo_capacity) against the simulator: one instance on
one GPU, arrivals at fractions of its steady-state throughput `mu`; per rate the simulator's
SLO attainment and misses beside the model's. docs/planner.md "Sized at the SLO".

python -m bench slo_calibration                       # every case, the default fractions
python -m bench slo_calibration -- --cases 0,2 --fractions 0.7,0.85,0.9
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from flexpipe.cluster import placement_on
from flexpipe.model_spec import load_model_spec
from flexpipe.perf.gear_lookup import GearLookup, GearQuery
from flexpipe.perf.slo_capacity import SloShape, miss_share, slo_rate_per_s
from flexpipe.policies.planner import PlannerConfig, plan
from flexpipe.sim import simulate
from flexpipe.sim.arrivals import generate_requests, model_demands
from flexpipe.sim.scenario import parse_scenario

# model, GPU, prompt, output, TTFT ms, TPOT ms, gap cv (None: Poisson)
CASES: list[tuple[str, str, int, int, int, int, float | None]] = [
    ("llama-2-7b", "A100-80G-SXM", 1024, 256, 2000, 60, None),
    ("llama-2-7b", "L4", 512, 128, 3000, 100, None),
    ("llama-2-7b", "A100-80G-SXM", 1024, 256, 2000, 60, 2.0),
    ("llama-2-13b", "A100-80G-SXM", 1024, 256, 2000, 50, None),
    ("llama-2-7b", "A100-80G-SXM", 1024, 256, 2000, 60, 3.0),
]
WARM_S = 120.0  # arrivals start once the instance is ready
SPAN_S = 1200.0


def _doc(case: tuple[Any, ...], rate_per_s: float) -> dict[str, Any]:
    model, gpu, prompt, output, ttft_ms, tpot_ms, gap_cv = case
    arrivals: dict[str, Any] = {"process": "poisson", "rate_per_s": rate_per_s, "start_s": WARM_S}
    if gap_cv is not None:
        arrivals = {**arrivals, "process": "gamma", "cv": gap_cv}
    demand = {"request_rate_per_s": 0.01, "input_tokens": prompt, "output_tokens": output}
    return {
        "name": "slo-calibration",
        "duration_s": WARM_S + SPAN_S,
        "policy": "static",
        "cluster": {"inline": {"name": "c", "nodes": [{"name": "n0", "gpus": [{"type": gpu}]}]}},
        "models": [
            {
                "name": "m",
                "model": model,
                "demand": demand,
                "slo": {"ttft_p99_ms": ttft_ms, "tpot_p99_ms": tpot_ms},
            }
        ],
        "workloads": [
            {
                "model": "m",
                "arrivals": arrivals,
                "prompt_tokens": {
                    "dist": "lognormal",
                    "mean": prompt,
                    "cv": 0.5,
                    "max": 3 * prompt,
                },
                "output_tokens": {"dist": "exponential", "mean": output, "max": 4 * output},
            }
        ],
    }


def _shape(case: tuple[Any, ...]) -> SloShape:
    """The planner's one instance for `case` (throughput sizing picks the largest batch that
    meets the SLOs), its figures at that batch and at batch 1."""
    sc = parse_scenario(_doc(case, 1.0), Path("."))
    demands, _ = model_demands(sc, generate_requests(sc))
    inst = plan(sc.cluster, demands, None, config=PlannerConfig()).instances[0]
    spec = load_model_spec(case[0])
    placement = placement_on(sc.cluster, inst.stages, spec.num_layers, inst.layers_per_stage)
    one = GearLookup().estimate(
        GearQuery.of(spec, replace(inst.gear, max_num_seqs=1), placement), demands[0].workload
    )
    est = inst.estimate
    return SloShape(est.batch, est.requests_per_s, est.ttft_s, est.tpot_s, one.tpot_s, case[3])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench slo_calibration")
    p.add_argument("--cases", default=",".join(str(i) for i in range(len(CASES))))
    p.add_argument("--fractions", default="0.5,0.7,0.8,0.85,0.9")
    args = p.parse_args(argv)
    for i in (int(c) for c in args.cases.split(",")):
        case = CASES[i]
        _, _, _, _, ttft_ms, tpot_ms, gap_cv = case
        cv2 = 1.0 if gap_cv is None else gap_cv * gap_cv
        shape = _shape(case)
        mu = shape.requests_per_s
        rate = slo_rate_per_s(shape, ttft_ms / 1e3, tpot_ms / 1e3, cv2)
        print(
            f"case {i} {case}: batch {shape.batch}, mu {mu:.3f} req/s; "
            f"SLO rate {rate:.3f} = {rate / mu:.3f} mu (throughput sizing: 0.85 mu)"
        )
        for frac in (float(f) for f in args.fractions.split(",")):
            result = simulate(parse_scenario(_doc(case, frac * mu), Path(".")))
            reqs = result.requests
            good = sum(
                r.completed and r.ttft_s <= ttft_ms / 1e3 and r.tpot_s <= tpot_ms / 1e3
                for r in reqs
            )
            predicted = miss_share(shape, frac * mu, ttft_ms / 1e3, tpot_ms / 1e3, cv2)
            print(
                f"  {frac:.2f} mu: attainment {good / len(reqs):.4f} "
                f"(model {1 - predicted:.4f}), {len(reqs)} requests"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
