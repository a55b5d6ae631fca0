"""Simulator speed against cluster size: events/s and simulated seconds per wall second.

    python -m bench sim_speed                              # 4, 64, 256, 1024 GPUs, 120 s each
    python -m bench sim_speed -- --sizes 256 --duration-s 3600   # the issue's target run
    git archive main | tar -x -C /tmp/base                 # before/after, side by side:
    python -m bench sim_speed -- --baseline /tmp/base

Each size is a generated fragmented cluster (`generate_cluster(gpus / 8, 8, seed=0)`) serving
Llama-3.1-8B with Poisson arrivals at 100 req/s per 256 GPUs (prompts lognormal, mean 512;
outputs exponential, mean 128; `--model` another), planned by the planner (`flexpipe` policy:
it uses only the GPUs the demand needs, the "in plan" column). CPU time of the
process (time.process_time) is measured, so a busy shared machine inflates it less than
wall time would. Each run is its own process (`--baseline`: the other checkout's run of the
same scenario goes just before, so both see the same machine load).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from bench._checkout import run_child


def scenario_doc(
    num_gpus: int, duration_s: float, rate_per_256: float, model: str = "llama-3.1-8b"
) -> dict[str, object]:
    return {
        "name": f"speed-{num_gpus}",
        "duration_s": duration_s,
        "seed": 0,
        "report_interval_s": 60,
        "cluster": {"generate": {"nodes": max(1, num_gpus // 8), "gpus_per_node": min(8, num_gpus),
                                 "seed": 0}},
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


_CHILD = """
import json, sys, time
from pathlib import Path
from flexpipe.sim.scenario import parse_scenario
from flexpipe.sim.simulator import simulate
doc, stretches = json.loads(sys.argv[1]), sys.argv[2] == "1"
sc = parse_scenario(doc, Path("."))
t0 = time.process_time()
result = simulate(sc, "flexpipe", stretches=stretches)
cpu = time.process_time() - t0
print(json.dumps({
    "used": sum(r.dep.num_gpus for r in result.instances),
    "instances": len(result.instances),
    "requests": len(result.requests),
    "events": result.num_events,
    "steps": sum(r.instance.num_steps for r in result.instances if r.instance),
    "cpu_s": cpu,
    "completed": sum(1 for r in result.requests if r.completed),
}))
"""


def run_in(checkout: Path, doc: dict[str, object], stretches: bool) -> dict[str, float]:
    """One run in a fresh process importing `checkout`'s flexpipe (CPU time of the run)."""
    return run_child(checkout, _CHILD, json.dumps(doc), "1" if stretches else "0")


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(prog="python -m bench sim_speed")
    p.add_argument("--sizes", default="4,64,256,1024", help="GPU counts")
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--rate-per-256", type=float, default=100.0)
    p.add_argument("--every-step", action="store_true", help="no closed-form stretches")
    p.add_argument("--model", default="llama-3.1-8b", help="model spec id")
    p.add_argument("--baseline", default=None,
                   help="another checkout (e.g. `git archive main`): each size runs there "
                        "too, in a fresh process, just before this one")  # fmt: skip
    args = p.parse_args(list(argv))
    here = Path(__file__).resolve().parents[1]
    checkouts = [("this", here)]
    if args.baseline:
        checkouts.insert(0, ("baseline", Path(args.baseline).resolve()))
    print(
        "run       GPUs  in plan  instances  requests   events    steps     CPU s  events/s"
        "  sim s/CPU s  completed"
    )
    for n in (int(s) for s in args.sizes.split(",")):
        doc = scenario_doc(n, args.duration_s, args.rate_per_256, args.model)
        for name, checkout in checkouts:
            r = run_in(checkout, doc, not args.every_step)
            cpu = r["cpu_s"]
            print(
                f"{name:8s}  {n:4d}  {r['used']:7.0f}  {r['instances']:9.0f}  "
                f"{r['requests']:8.0f}  {r['events']:7.0f}  {r['steps']:7.0f}  {cpu:8.1f}  "
                f"{r['events'] / cpu:8.0f}  {args.duration_s / cpu:11.1f}  "
                f"{r['completed'] / max(1, r['requests']):9.3f}",
                flush=True,
            )
    return 0
