"""Pauses of the requests a shift moves, in the simulator (BENCHMARKS.md): per method, how
many, the pause from the source's last token to the destination's first (p50, max), the
prefix-cache hit of the continuations, and the warm-ups' outcomes (`relay.warm_up`).

    python -m bench sim_move_pauses                       # seed-short (0.5 s deadline)
    python -m bench sim_move_pauses -- --only seed-fragmented,multi-model-diurnal

seed-short: the seed's cluster at 8 req/s, gpu1 released at 100 s, a 0.5 s drain deadline
(tests/test_sim_shift.py's case: about 40 requests left to move). Figures are the
simulator's: the same scenario and seed give the same numbers.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from flexpipe.sim import report, simulate
from flexpipe.sim.controller import ControllerParams
from flexpipe.sim.scenario import load_scenario, parse_scenario, resolve

ROOT = Path(__file__).resolve().parents[1]


def _seed_short() -> Any:
    doc = {
        "name": "seed-short", "duration_s": 220, "seed": 0, "report_interval_s": 30,
        "cluster": {"file": str(ROOT / "examples" / "clusters" / "fragmented-4gpu.yaml")},
        "models": [{"name": "llama-7b", "model": "llama-2-7b",
                    "demand": {"request_rate_per_s": 8, "input_tokens": 1024,
                               "output_tokens": 256},
                    "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 60}, "dtypes": ["bf16", "fp8"]}],
        "workloads": [{"model": "llama-7b", "arrivals": {"rate_per_s": 8, "start_s": 30},
                       "prompt_tokens": {"dist": "lognormal", "mean": 1024, "cv": 0.5,
                                         "max": 3072},
                       "output_tokens": {"dist": "exponential", "mean": 256, "max": 1024}}],
        "resources": [{"at_s": 100, "release": ["gpu1"]}],
    }  # fmt: skip
    sc = parse_scenario(doc, ROOT)
    return replace(sc, controller=ControllerParams(drain_deadline_s=0.5))


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench sim_move_pauses")
    ap.add_argument("--only", default="seed-short", help="comma-separated scenario names")
    ap.add_argument("--policy", default="flexpipe")
    args = ap.parse_args(list(argv))
    for name in args.only.split(","):
        sc = _seed_short() if name == "seed-short" else load_scenario(resolve(name))
        r = simulate(sc, args.policy)
        rep = report(r)
        print(
            f"\n{name} ({args.policy}): failed {rep['num_failed']}, goodput "
            f"{rep['goodput_requests_per_s']:.3f} req/s, SLO {rep['slo_attainment']:.4f}, "
            f"moved {rep['requests_migrated_by_method']}, warm-ups {rep['move_warm_ups']}"
        )
        for method in sorted({m.method for m in r.moves}):
            mine = [m for m in r.moves if m.method == method and m.pause_s >= 0]
            if not mine:
                continue
            pauses = sorted(m.pause_s for m in mine)
            cached = sum(m.continuation.num_cached_tokens for m in mine)
            context = sum(m.continuation.num_prompt_tokens for m in mine)
            print(
                f"- {method}: {len(mine)}, pause p50 {statistics.median(pauses) * 1e3:.1f} ms, "
                f"max {pauses[-1] * 1e3:.1f} ms, prefix-cache hit {cached}/{context} tokens"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
