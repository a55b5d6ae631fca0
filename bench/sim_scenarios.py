"""The built-in simulator scenarios' headline numbers, policy against policy (BENCHMARKS.md).

    python -m bench sim_scenarios                                   # every scenario below
    python -m bench sim_scenarios -- --only seed-fragmented --duration-s 600
    python -m bench sim_scenarios -- --out runs/                    # + each run's reports

Prints one markdown table per scenario: requests, failed, goodput, SLO attainment, time to the
first served request, output tokens/s (over the duration and over the busy span), GPU-hours
reserved, reservation as a share of peak provisioning, shifts by kind, moved requests, and
the CPU seconds of the run (time.process_time: a busy shared machine inflates it less than
wall time). Figures are the simulator's: the same scenario and seed give the same numbers.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from flexpipe.sim.report import report, write_reports
from flexpipe.sim.scenario import load_scenario, resolve
from flexpipe.sim.simulator import simulate

RUNS: dict[str, tuple[str, ...]] = {
    "seed-fragmented": ("flexpipe", "static", "peak", "wait-for-ideal", "round_robin"),
    "seed-3way": ("tp2-fast-pair", "forced-3way"),
    "bursty-serverless": ("peak-slo", "static", "autoscaler", "flexpipe"),
    "bursty-serverless-small": ("flexpipe", "static", "peak"),
    "multi-model-diurnal": ("flexpipe", "static", "peak"),
    "cluster-1024": ("flexpipe",),
}


def _row(rep: dict[str, Any], cpu_s: float) -> list[str]:
    first = rep["first_served_s"]
    models = rep["models"].values()
    return [
        rep["policy"],
        f"{rep['num_requests']:,}",
        f"{rep['num_failed']:,}",
        f"{rep['goodput_requests_per_s']:.3f}",
        f"{rep['slo_attainment']:.3f}",
        "never" if first is None else f"{first:.1f}",
        f"{sum(m['throughput_tokens_per_s'] for m in models):,.0f}",
        f"{sum(m['span_throughput_tokens_per_s'] for m in models):,.0f}",
        f"{rep['gpu_hours_reserved']:.2f}",
        f"{rep['reservation']['share_of_peak']:.2f}",
        ", ".join(f"{k} {v}" for k, v in rep["shifts_by_kind"].items()) or "-",
        ", ".join(f"{k} {v}" for k, v in rep["requests_migrated_by_method"].items()) or "-",
        ", ".join(f"{k} {v}" for k, v in rep.get("move_warm_ups", {}).items()) or "-",
        f"{cpu_s:.0f}",
    ]


HEAD = ["policy", "requests", "failed", "goodput req/s", "SLO att.", "first served s",
        "tok/s", "tok/s (span)", "GPU-h reserved", "of peak", "shifts", "moved",
        "warm-ups", "CPU s"]  # fmt: skip


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench sim_scenarios")
    ap.add_argument("--only", help="comma-separated scenario names")
    ap.add_argument("--policies", help="comma-separated policies (default: per scenario)")
    ap.add_argument("--duration-s", type=float, help="override every scenario's duration")
    ap.add_argument("--out", type=Path, help="write each run's reports under OUT/SCENARIO/POLICY")
    args = ap.parse_args(list(argv))
    names = args.only.split(",") if args.only else list(RUNS)
    for name in names:
        sc = load_scenario(resolve(name))
        if args.duration_s:
            sc = replace(sc, duration_s=args.duration_s)
        policies = args.policies.split(",") if args.policies else RUNS.get(name, ("flexpipe",))
        print(f"\n### {name} ({sc.duration_s:g} s, seed {sc.seed})\n")
        print("| " + " | ".join(HEAD) + " |")
        print("|" + "---|" * len(HEAD))
        reps: dict[str, dict[str, Any]] = {}
        for policy in policies:
            t0 = time.process_time()
            result = simulate(sc, policy)
            cpu_s = time.process_time() - t0
            rep = reps[policy] = report(result)
            print("| " + " | ".join(_row(rep, cpu_s)) + " |", flush=True)
            if args.out is not None:
                write_reports(result, args.out / name / policy)
        if "flexpipe" in reps and len(reps["flexpipe"]["phases"]) > 1:
            print("\nthroughput per phase (flexpipe):")
            for p in reps["flexpipe"]["phases"]:
                print(f"- {p['start_s']:.0f}-{p['end_s']:.0f} s ({p['after']}): "
                      f"{p['tokens_per_s']:,.0f} tok/s, {p['goodput_requests_per_s']:.2f} "
                      "good req/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
