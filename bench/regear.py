"""The seed's in-place re-gear in the simulator: rolling against make-before-break
(policies/shift/in_place.py; docs/controller.md, "In place").

The same setting as `python -m bench shift` (its live twin: `--in-place make_before_break`):
the seed's fragmented 4-GPU cluster (examples/clusters/fragmented-4gpu.yaml), llama-7b as
examples/models/llama-7b.yaml with a 60 ms TPOT SLO, Poisson arrivals (prompt and output
within the model's 4096 tokens); the other tenant leaves gpu1 and the TP2 on gpu1+gpu2 is
re-geared in place (here into two tp1 instances, as live).
For each `shift.pricing.in_place` it prints how long the in-place step kept the TP2's
capacity away (its phases but the pre-start, which runs while the TP2 still serves), the
phases, moves, failed requests and SLO attainment, and output tokens/s before the tenant
leaves and while the shift runs.

    python -m bench regear [-- --rate-per-s 3 --seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flexpipe.policies.shift.in_place import IN_PLACE_MODES
from flexpipe.sim import report, simulate
from flexpipe.sim.scenario import parse_scenario

ROOT = Path(__file__).resolve().parents[1]
TENANT_LEAVES_S = 60.0


def scenario_doc(in_place: str, rate_per_s: float, seed: int) -> dict[str, Any]:
    return {
        "name": f"seed-regear-{in_place}", "duration_s": 200, "seed": seed,
        "report_interval_s": 30,
        "cluster": {"file": str(ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml")},
        "models": [{"name": "llama-7b", "model": "llama-2-7b",
                    "demand": {"request_rate_per_s": 8, "input_tokens": 2048,
                               "output_tokens": 256},
                    "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 60}, "dtypes": ["bf16", "fp8"]}],
        "workloads": [{"model": "llama-7b", "arrivals": {"rate_per_s": rate_per_s, "start_s": 30},
                       "prompt_tokens": {"dist": "lognormal", "mean": 2048, "cv": 0.5,
                                         "max": 3000},
                       "output_tokens": {"dist": "exponential", "mean": 256, "max": 1000}}],
        "resources": [{"at_s": TENANT_LEAVES_S, "release": ["gpu1"]}],
        "controller": {"shift": {"pricing": {"in_place": in_place}}},
    }  # fmt: skip


def in_place_phases_s(phases_s: dict[str, float]) -> float:
    """The in-place step's phases but its pre-start: the time the model lacked the capacity
    it replaces (what the live procedure measures as "capacity away")."""
    return sum(v for k, v in phases_s.items() if "_in_place" in k and "_prestart" not in k)


def tokens_per_s(requests: Sequence[Any], start_s: float, end_s: float) -> float:
    """Output tokens/s of requests that ended in [start_s, end_s)."""
    n = sum(r.num_generated_tokens for r in requests if start_s <= r.finish_s < end_s)
    return n / (end_s - start_s) if end_s > start_s else 0.0


def one_run(in_place: str, rate_per_s: float, seed: int) -> dict[str, Any]:
    sc = parse_scenario(scenario_doc(in_place, rate_per_s, seed), ROOT)
    result = simulate(sc, "flexpipe")
    rep = report(result)
    shift = next(s for s in result.shifts if s["trigger"] == "resource")
    reqs = [r for r in result.requests if r.completed]
    return {
        "in_place": in_place,
        "seed": seed,
        "capacity_away_s": round(in_place_phases_s(shift["phases_s"]), 3),
        "shift_s": round(shift["finished_s"] - shift["at_s"], 1),
        "phases_s": {k: round(v, 2) for k, v in shift["phases_s"].items() if "in_place" in k},
        "migrated": shift["migrated"],
        "failed": rep["num_failed"],
        "slo_attainment": rep["slo_attainment"],
        "tokens_per_s_before": round(tokens_per_s(reqs, 30.0, TENANT_LEAVES_S), 1),
        "tokens_per_s_during": round(tokens_per_s(reqs, shift["at_s"], shift["finished_s"]), 1),
    }


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench regear")
    ap.add_argument("--rate-per-s", type=float, default=3.0)
    ap.add_argument("--seeds", default="0")
    args = ap.parse_args(list(argv))
    seeds = [int(s) for s in args.seeds.split(",")]
    print("| in_place | seed | capacity away s | shift s | in-place phases s | moved | failed "
          "| SLO attainment | tok/s before / during |")  # fmt: skip
    print("|" + " --- |" * 9)
    away: dict[str, list[float]] = {}
    for mode in IN_PLACE_MODES:
        for seed in seeds:
            r = one_run(mode, args.rate_per_s, seed)
            away.setdefault(mode, []).append(r["capacity_away_s"])
            phases = ", ".join(f"{k} {v}" for k, v in r["phases_s"].items())
            print(f"| {mode} | {seed} | {r['capacity_away_s']} | {r['shift_s']} | {phases} "
                  f"| {r['migrated']} | {r['failed']} | {r['slo_attainment']:.4f} "
                  f"| {r['tokens_per_s_before']} / {r['tokens_per_s_during']} |")  # fmt: skip
    for mode, values in away.items():
        print(f"{mode}: capacity away median {statistics.median(values):.2f} s")
    ok = max(away["make_before_break"]) <= 5.0
    print(f"regear: make_before_break {'meets' if ok else 'misses'} the 5 s target")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
