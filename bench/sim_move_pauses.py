"""Pauses of the requests a shift moves, in the simulator (BENCHMARKS.md): per method, how
many, the pause from the source's last token to the destination's first (p50, p99, max),
the same over one prefill of the request's context on the instance it left (the shift's
budget, as `bench shift` prices it live), the prefix-cache hit of the continuations, and the
warm-ups' outcomes (`relay.warm_up`).

    python -m bench sim_move_pauses                       # seed-short (0.5 s deadline)
    python -m bench sim_move_pauses -- --only seed-fragmented,multi-model-diurnal

seed-short: the seed's cluster at 8 req/s, gpu1 released at 100 s, a 0.5 s drain deadline
(tests/sim/test_sim_shift.py's case: about 40 requests left to move). Figures are the
simulator's: the same scenario and seed give the same numbers.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flexpipe.policies.shift.migration import perf_model_of
from flexpipe.sim import report, simulate
from flexpipe.sim.moves import MoveRecord
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
        # the seed's re-plan onto gpu1 gives a GPU back at 100 % of the plan's capacity: the
        # default down-shift headroom would refuse it, and this bench measures its moves
        "controller": {"drain_deadline_s": 0.5, "shift": {"pricing": {"down_headroom": 0}}},
    }  # fmt: skip
    return parse_scenario(doc, ROOT)


def one_prefill_s(sc: Any, r: Any, move: MoveRecord) -> float:
    """One prefill of the moved request's context (prompt and tokens so far) on the instance
    it left, by the performance model: the pause budget of a move."""
    left = next(i for i in r.instances if i.dep.name == move.source)
    return float(
        perf_model_of(sc.cluster, left.planned).prefill_s(move.continuation.num_prompt_tokens)
    )


def _p99(values: Sequence[float]) -> float:
    """The 99th percentile, nearest rank (values sorted)."""
    return values[max(0, math.ceil(0.99 * len(values)) - 1)]


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
            ratios = sorted(m.pause_s / one_prefill_s(sc, r, m) for m in mine)
            cached = sum(m.continuation.num_cached_tokens for m in mine)
            context = sum(m.continuation.num_prompt_tokens for m in mine)
            print(
                f"- {method}: {len(mine)}, pause p50 {statistics.median(pauses) * 1e3:.1f} ms, "
                f"p99 {_p99(pauses) * 1e3:.1f} ms, max {pauses[-1] * 1e3:.1f} ms; over one "
                f"prefill p50 {statistics.median(ratios):.2f}, p99 {_p99(ratios):.2f}; "
                f"prefix-cache hit {cached}/{context} tokens"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
