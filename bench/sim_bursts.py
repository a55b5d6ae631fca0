"""Per-burst evidence of a bursty scenario under flexpipe: how each burst got its capacity.

    python -m bench sim_bursts -- --seeds 0,1,2                  # bursty-serverless
    python -m bench sim_bursts -- --scenario PATH --seeds 0

A burst is a model's run of requests with no gap over 20 s, of 5 requests or more, starting
once the first plan serves (after 70 s). For each: the first shift that started an instance of
its model during the burst — a wake of a sleeping engine only (`sleeper`) or with a cold start
(`cold`) — or none (`none`: what was awake carried it), and when that capacity was there
(the shift's end) after the burst's first request. Per kind: the bursts, their requests' SLO
attainment and the median time to the first added capacity (docs/controller.md, "Standby
sleepers").
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from flexpipe.sim import simulate
from flexpipe.sim.report import meets_slo
from flexpipe.sim.request import SimRequest
from flexpipe.sim.scenario import load_scenario, resolve

GAP_S = 20.0  # no request of the model for this long: the next one starts a burst
MIN_REQUESTS = 5
AFTER_S = 70.0  # the first plan's cold start is over


def bursts(requests: Sequence[SimRequest]) -> list[list[SimRequest]]:
    """Each model's client requests cut at gaps over `GAP_S`, in arrival order."""
    by_model: dict[str, list[SimRequest]] = {}
    for r in sorted(requests, key=lambda r: r.arrival_s):
        if r.context_of is None:
            by_model.setdefault(r.model, []).append(r)
    out: list[list[SimRequest]] = []
    for reqs in by_model.values():
        cur = [reqs[0]]
        for r in reqs[1:]:
            if r.arrival_s - cur[-1].arrival_s > GAP_S:
                out.append(cur)
                cur = []
            cur.append(r)
        out.append(cur)
    return [b for b in out if b[0].arrival_s > AFTER_S and len(b) >= MIN_REQUESTS]


def classify(burst: list[SimRequest], shifts: Sequence[dict[str, Any]]) -> tuple[str, float]:
    """(sleeper | cold | none, seconds from its first request to the first added capacity)."""
    model, t0, t1 = burst[0].model, burst[0].arrival_s, burst[-1].arrival_s
    for s in shifts:
        if t0 - 1.0 <= s["at_s"] <= t1 and any(k.startswith(f"{model}|") for k in s["started"]):
            phases = s["phases_s"]
            cold = any(k.startswith("warm") for k in phases)
            kind = "sleeper" if "wake" in phases and not cold else "cold"
            return kind, s["finished_s"] - t0
    return "none", float("nan")


def evidence(scenario: str, seed: int) -> str:
    sc = dataclasses.replace(load_scenario(resolve(scenario)), seed=seed)
    res = simulate(sc, "flexpipe")
    slos = {d.name: d.slo for d in res.demands}
    shifts = sorted(res.shifts, key=lambda s: s["at_s"])
    rows: dict[str, list[tuple[float, int, int]]] = {}  # kind -> (first add, n, good)
    all_bursts = bursts(res.requests)
    for b in all_bursts:
        kind, first_s = classify(b, shifts)
        good = sum(meets_slo(r, slos[r.model]) for r in b)
        rows.setdefault(kind, []).append((first_s, len(b), good))
    parts = [f"seed {seed}: {len(all_bursts)} bursts"]
    for kind in ("sleeper", "cold", "none"):
        if kind not in rows:
            continue
        got = rows[kind]
        n, good = sum(r[1] for r in got), sum(r[2] for r in got)
        firsts = [r[0] for r in got if r[0] == r[0]]
        median = f"{statistics.median(firsts):.1f} s" if firsts else "-"
        parts.append(
            f"{kind} {len(got)} (attainment {good / n:.3f}, first added capacity median {median})"
        )
    return "; ".join(parts)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench sim_bursts")
    p.add_argument("--scenario", default="bursty-serverless")
    p.add_argument("--seeds", default="0", help="comma-separated")
    args = p.parse_args(argv)
    for seed in (int(s) for s in args.seeds.split(",")):
        print(evidence(args.scenario, seed), flush=True)
    return 0
