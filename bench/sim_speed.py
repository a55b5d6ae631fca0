"""Simulator speed against cluster size: events/s and simulated seconds per wall second.

    python -m bench sim_speed                              # 16, 64, 256 GPUs, 120 s each
    python -m bench sim_speed -- --sizes 256 --duration-s 3600   # the issue's target run

Each size is a generated fragmented cluster (`generate_cluster(gpus / 8, 8, seed=0)`) serving
Llama-3.1-8B with Poisson arrivals at 100 req/s per 256 GPUs (prompts lognormal, mean 512;
outputs exponential, mean 128; `--model` another), planned by the planner (`flexpipe` policy:
it uses only the GPUs the demand needs, the "in plan" column). CPU time of the
process (time.process_time) is measured, so a busy shared machine inflates it less than
wall time would; the planner's share is reported apart.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from flexpipe.sim.scenario import parse_scenario
from flexpipe.sim.simulator import simulate


def scenario_doc(
    num_gpus: int, duration_s: float, rate_per_256: float, model: str = "llama-3.1-8b"
) -> dict[str, object]:
    return {
        "name": f"speed-{num_gpus}",
        "duration_s": duration_s,
        "seed": 0,
        "report_interval_s": 60,
        "cluster": {"generate": {"nodes": max(1, num_gpus // 8), "gpus_per_node": 8, "seed": 0}},
        "models": [
            {"name": "llama-8b", "model": model,
             "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 80}, "max_model_len": 8192},
        ],
        "workloads": [
            {"model": "llama-8b",
             "arrivals": {"process": "poisson", "rate_per_s": rate_per_256 * num_gpus / 256},
             "prompt_tokens": {"dist": "lognormal", "mean": 512, "cv": 1.0, "max": 6000},
             "output_tokens": {"dist": "exponential", "mean": 128, "max": 1024}},
        ],
    }  # fmt: skip


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(prog="python -m bench sim_speed")
    p.add_argument("--sizes", default="16,64,256", help="GPU counts")
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--rate-per-256", type=float, default=100.0)
    p.add_argument("--every-step", action="store_true", help="no closed-form stretches")
    p.add_argument("--model", default="llama-3.1-8b", help="model spec id")
    args = p.parse_args(list(argv))
    print(
        "GPUs  in plan  instances  requests  events   steps      CPU s   events/s  sim s/CPU s"
        "  completed"
    )
    for n in (int(s) for s in args.sizes.split(",")):
        doc = scenario_doc(n, args.duration_s, args.rate_per_256, args.model)
        sc = parse_scenario(doc, Path("."))
        t0 = time.process_time()
        result = simulate(sc, "flexpipe", stretches=not args.every_step)
        cpu = time.process_time() - t0
        steps = sum(r.instance.num_steps for r in result.instances if r.instance)
        done = sum(1 for r in result.requests if r.completed)
        used = sum(r.dep.num_gpus for r in result.instances)
        print(
            f"{n:4d}  {used:7d}  {len(result.instances):9d}  {len(result.requests):8d}  "
            f"{result.num_events:7d}  {steps:9d}  {cpu:7.1f}  {result.num_events / cpu:9.0f}  "
            f"{sc.duration_s / cpu:11.1f}  {done / max(1, len(result.requests)):9.3f}",
            flush=True,
        )
    return 0
