"""The rate forecast (policies/shift/forecast.py) on and off in the simulator (BENCHMARKS.md,
"The rate forecast"): flexpipe on multi-model-diurnal, forecast off (`horizon_s` 0) against
the defaults, seed by seed; then two simulated days, where "yesterday" (one period: the
scenario's day is 3600 s) exists on the second.

    python -m bench forecast                          # seeds 0,1,2 and the two days (~10 CPU min)
    python -m bench forecast -- --seeds 0 --no-two-days

Figures are the simulator's: the same scenario and seed give the same numbers.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import replace

from flexpipe.policies.shift.forecast import ForecastParams
from flexpipe.sim.report import report
from flexpipe.sim.scenario import Scenario, load_scenario, resolve
from flexpipe.sim.simulator import simulate

SCENARIO = "multi-model-diurnal"
HEAD = ["forecast", "seed", "duration s", "requests", "failed", "failed after 3600 s",
        "goodput req/s", "SLO att.", "GPU-h reserved", "shifts", "CPU s"]  # fmt: skip


def _with(sc: Scenario, forecast: ForecastParams, seed: int, duration_s: float) -> Scenario:
    shift = replace(sc.controller.shift, forecast=forecast)
    controller = replace(sc.controller, shift=shift)
    return replace(sc, controller=controller, seed=seed, duration_s=duration_s)


def _row(label: str, sc: Scenario) -> list[str]:
    t0 = time.process_time()
    result = simulate(sc, "flexpipe")
    cpu_s = time.process_time() - t0
    rep = report(result)
    late = [r for r in result.requests if r.arrival_s >= 3600]
    return [
        label,
        str(sc.seed),
        f"{sc.duration_s:g}",
        f"{rep['num_requests']:,}",
        f"{rep['num_failed']:,}",
        f"{sum(1 for r in late if r.failed):,}" if late else "-",
        f"{rep['goodput_requests_per_s']:.3f}",
        f"{rep['slo_attainment']:.3f}",
        f"{rep['gpu_hours_reserved']:.2f}",
        ", ".join(f"{k} {v}" for k, v in rep["shifts_by_kind"].items()) or "-",
        f"{cpu_s:.0f}",
    ]


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench forecast")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds of the one-day runs")
    ap.add_argument("--two-days", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args(list(argv))
    base = load_scenario(resolve(SCENARIO))
    runs: list[tuple[str, Scenario]] = []
    for seed in (int(s) for s in args.seeds.split(",") if s):
        for label, fp in (("off", ForecastParams(horizon_s=0)), ("on", ForecastParams())):
            runs.append((label, _with(base, fp, seed, base.duration_s)))
    if args.two_days:
        day = ForecastParams(period_s=base.duration_s)  # "yesterday" = one scenario day ago
        variants = (
            ("off", ForecastParams(horizon_s=0)),
            ("trend only", ForecastParams(period_s=0)),
            (f"trend + yesterday ({base.duration_s:g} s)", day),
        )
        for label, fp in variants:
            runs.append((label, _with(base, fp, base.seed, 2 * base.duration_s)))
    print(f"\n### {SCENARIO}, flexpipe, rate forecast off and on\n")
    print("| " + " | ".join(HEAD) + " |")
    print("|" + "---|" * len(HEAD))
    for label, sc in runs:
        print("| " + " | ".join(_row(label, sc)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
