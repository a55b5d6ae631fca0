"""Per-burst evidence of a bursty scenario under flexpipe: how each burst got its capacity.

    python -m bench sim_bursts -- --seeds 0,1,2                  # bursty-serverless
    python -m bench sim_bursts -- --scenario PATH --seeds 0
    python -m bench sim_bursts -- --seeds 2 --misses             # where each miss came from

A burst is a model's run of requests with no gap over 20 s, of 5 requests or more, starting
once the first plan serves (after 70 s). For each: the first shift that started an instance of
its model during the burst — a wake of a sleeping engine only (`sleeper`) or with a cold start
(`cold`) — or none (`none`: what was awake carried it), and when that capacity was there
(the shift's end) after the burst's first request. Per kind: the bursts, their requests' SLO
attainment and the median time to the first added capacity (docs/controller.md, "Standby
sleepers"). With `--misses`, per model under 0.99 and per burst of it with a miss: its rate,
the requests that missed the TTFT SLO and those that met it but missed the TPOT SLO, and
each instance that served it (gear, GPUs, requests, misses): which gear was awake and what
it missed (docs/shift-policy.md, "bursty-serverless").
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
from flexpipe.sim.simulator import SimResult

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


def misses(res: SimResult) -> list[str]:
    """Lines: each model under 0.99, each of its bursts with a miss, its instances' share."""
    slos = {d.name: d.slo for d in res.demands}
    where = {r.dep.name: f"{r.dep.gear.key()} on {'+'.join(r.dep.gpu_ids)}" for r in res.instances}
    client = [r for r in res.requests if r.context_of is None]
    out: list[str] = []
    for model in sorted(slos):
        mine = [r for r in client if r.model == model]
        good = sum(meets_slo(r, slos[model]) for r in mine)
        if not mine or good / len(mine) >= 0.99:
            continue
        out.append(f"  {model}: attainment {good / len(mine):.3f} of {len(mine)}")
        for b in _cut([r for r in sorted(mine, key=lambda r: r.arrival_s)]):
            ttft = [r for r in b if not r.completed or r.ttft_s > slos[model].ttft_p99_s]
            tpot = [r for r in b if not meets_slo(r, slos[model]) and r not in ttft]
            if not ttft and not tpot:
                continue
            span_s = max(1.0, b[-1].arrival_s - b[0].arrival_s)
            out.append(
                f"    burst {b[0].arrival_s:.0f}-{b[-1].arrival_s:.0f} s, {len(b)} requests "
                f"({len(b) / span_s:.1f}/s): {len(ttft)} TTFT misses, {len(tpot)} TPOT misses"
            )
            for inst in sorted({r.instance for r in b}):
                served = [r for r in b if r.instance == inst]
                bad = sum(not meets_slo(r, slos[model]) for r in served)
                out.append(
                    f"      {inst or '(none)'} {where.get(inst, '')}: {len(served)}, {bad} missed"
                )
    return out


def _cut(reqs: list[SimRequest]) -> list[list[SimRequest]]:
    """`reqs` (one model's, in arrival order) cut at gaps over `GAP_S`."""
    out: list[list[SimRequest]] = []
    for r in reqs:
        if not out or r.arrival_s - out[-1][-1].arrival_s > GAP_S:
            out.append([])
        out[-1].append(r)
    return out


def evidence(scenario: str, seed: int, show_misses: bool = False) -> str:
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
    return "\n".join(["; ".join(parts), *(misses(res) if show_misses else [])])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench sim_bursts")
    p.add_argument("--scenario", default="bursty-serverless")
    p.add_argument("--seeds", default="0", help="comma-separated")
    p.add_argument("--misses", action="store_true", help="where each model's misses came from")
    args = p.parse_args(argv)
    for seed in (int(s) for s in args.seeds.split(",")):
        print(evidence(args.scenario, seed, args.misses), flush=True)
    return 0
