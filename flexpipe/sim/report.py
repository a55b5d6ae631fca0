"""The numbers of one run: goodput, SLO attainment, latency percentiles, GPU-hours reserved
and used, utilisation over time, failures. JSON (one document) and CSV (one row per request,
one per interval). Only virtual-clock quantities go in, so the same scenario and seed give
byte-identical files.

goodput: completed requests that met both their model's TTFT and TPOT SLOs (each request
against the SLO thresholds), per second of the scenario's duration (the arrivals' window).
SLO attainment: the share of all requests (failed ones included) that did.
shed: with the gateway's `admission: {shed_late: true}`, the requests refused early because
they could not meet their TTFT SLO (`num_shed`, apart from `num_failed`).

GPU time, the timeline, the phases and the occupancy map cover the whole run: the duration
and the drain after it, until the last accepted request ended (`run_end_s`), so what the
requests counted here cost is billed and the timeline's and the phases' completions add up
to `num_completed`.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flexpipe.policies.planner import Slo
from flexpipe.sim.gateway import SHED_PREFIX
from flexpipe.sim.request import SimRequest
from flexpipe.sim.simulator import SimResult
from flexpipe.sim.usage import Usage


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values: see `_latency` for the report's)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, -(-len(ordered) * q // 100) - 1))
    return ordered[int(k)]


def cell_text(value: Any, none: str = "never") -> str:
    """A report value as the terminal table (`flexpipe sim`) and the HTML page both print it:
    floats to 3 decimals with thousands separators, counts by kind as `kind xN`, None as
    `none` (a latency of no completed request, a model never served)."""
    if value is None:
        return none
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.3f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(f"{k} x{v}" for k, v in value.items()) or "-"
    return str(value)


def _r(x: float) -> float:
    return round(x, 6)


def _latency(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99; None without a value (no completed request: not a latency of 0)."""
    return {f"p{q}": _r(percentile(values, q)) if values else None for q in (50, 90, 99)}


def _pct_or_none(values: list[float], q: float) -> float | None:
    return _r(percentile(values, q)) if values else None


def why_class(why: str) -> str:
    """A failure's reason without its numbers and instance (`failed_by_why` groups by it):
    "400: ... 8192 tokens ... (a100-0)" -> "400: ... N tokens ..."."""
    why = re.sub(r" \([^()\s]*\)$", "", why)  # the instance the engine named (no space)
    code, sep, rest = why.partition(": ")  # (the status code stays)
    return code + sep + re.sub(r"\b\d+(\.\d+)?\b", "N", rest)


def _first_served(done: list[SimRequest]) -> float | None:
    """When the first token of any request was served (None: never)."""
    return _r(min(r.first_token_s for r in done)) if done else None


def _span_throughput(done: list[SimRequest]) -> float:
    """Output tokens over the span from the first arrival to the last completion: the
    capacity a saturated run measures (`throughput_tokens_per_s` divides by the duration)."""
    if not done:
        return 0.0
    span = max(r.finish_s for r in done) - min(r.arrival_s for r in done)
    return sum(r.num_generated_tokens for r in done) / span if span > 0 else 0.0


def meets_slo(r: SimRequest, slo: Slo) -> bool:
    """Completed within both the TTFT and the TPOT threshold (each request against the SLO's
    values): what goodput and SLO attainment count, in the simulator and `flexpipe replay`."""
    return r.completed and r.ttft_s <= slo.ttft_p99_s and r.tpot_s <= slo.tpot_p99_s


def num_good(reqs: Sequence[SimRequest], slos: Mapping[str, Slo]) -> int:
    """The requests that met their model's SLO."""
    return sum(1 for r in reqs if meets_slo(r, slos[r.model]))


def slo_attainment(reqs: Sequence[SimRequest], slos: Mapping[str, Slo]) -> float:
    """The share of all requests (failed ones included) that met their model's SLO."""
    return _r(num_good(reqs, slos) / len(reqs)) if reqs else 0.0


def summary(
    reqs: Sequence[SimRequest], duration_s: float, slos: Mapping[str, Slo]
) -> dict[str, Any]:
    """Counts, goodput, attainment and latency percentiles of `reqs` (each against its
    model's SLO), goodput and throughput per second of `duration_s`: a model's entry in the
    simulator's report, and `flexpipe replay`'s."""
    done = [r for r in reqs if r.completed]
    failed = Counter(
        r.failed.split(":")[0] if ":" in r.failed else r.failed for r in reqs if r.failed
    )
    return {
        "num_requests": len(reqs),
        "num_completed": len(done),
        "num_failed": len(reqs) - len(done),
        "failed_by_reason": dict(sorted(failed.items())),
        "goodput_requests_per_s": _r(num_good(done, slos) / duration_s),
        "slo_attainment": slo_attainment(reqs, slos),
        "throughput_tokens_per_s": _r(sum(r.num_generated_tokens for r in done) / duration_s),
        "span_throughput_tokens_per_s": _r(_span_throughput(done)),
        "ttft_s": _latency([r.ttft_s for r in done]),
        "tpot_s": _latency([r.tpot_s for r in done]),
        "e2e_s": _latency([r.e2e_s for r in done]),
        "first_served_s": _first_served(done),
        "num_preemptions": sum(r.num_preemptions for r in done),
        "prefix_cache_hit_tokens": sum(r.num_cached_tokens for r in done),
    }


def report(result: SimResult) -> dict[str, Any]:
    sc = result.scenario
    d = sc.duration_s
    slos = {m.name: m.slo for m in result.demands}
    models = {}
    for m in result.demands:
        mine = [r for r in result.requests if r.model == m.name]
        models[m.name] = {
            "slo": {"ttft_s": m.slo.ttft_p99_s, "tpot_s": m.slo.tpot_p99_s},
            **summary(mine, d, slos),
        }
    done = [r for r in result.requests if r.completed]
    good = num_good(done, slos)
    u = result.usage
    reserved = sum(u.reserved_gpu_s)
    busy = sum(u.busy_gpu_s)
    run_end_s = u.end_s
    failures = [
        {"request_id": r.request_id, "model": r.model, "at_s": _r(r.arrival_s), "why": r.failed}
        for r in result.requests
        if r.failed
    ]
    num_shed = sum(1 for r in result.requests if r.failed.startswith(SHED_PREFIX))
    shed = {"num_shed": num_shed} if sc.gateway.admission.shed_late else {}
    peak_gpu_hours = result.peak_gpus * run_end_s / 3600  # held as long as ours were
    migrated: Counter[str] = Counter()
    for sh in result.shifts:
        migrated.update(sh["migrated"])
    for method, n in result.failovers.items():
        migrated[f"failover_{method}"] += n
    return {
        "scenario": sc.name,
        "policy": result.policy,
        "routing": result.routing,
        "seed": sc.seed,
        "duration_s": d,
        "end_s": _r(result.end_s),
        "run_end_s": _r(run_end_s),
        "num_requests": len(result.requests),
        "num_completed": len(done),
        "num_failed": len(result.requests) - len(done) - num_shed,
        **shed,
        "goodput_requests_per_s": _r(good / d),
        "slo_attainment": slo_attainment(result.requests, slos),
        "gpu_hours_reserved": _r(reserved / 3600),
        "gpu_hours_used": _r(busy / 3600),
        "utilisation": _r(busy / reserved) if reserved else 0.0,
        **_asleep(u),
        "first_served_s": _first_served(done),
        "reservation": {
            "peak_gpus": result.peak_gpus,
            "peak_gpu_hours": _r(peak_gpu_hours),
            "share_of_peak": _r(reserved / 3600 / peak_gpu_hours) if peak_gpu_hours else 0.0,
        },
        "shifts_by_kind": dict(sorted(Counter(s["trigger"] for s in result.shifts).items())),
        "requests_migrated_by_method": dict(sorted(migrated.items())),
        "num_requests_moved": len(result.num_moves),
        "move_warm_ups": dict(result.warm_ups),  # outcome -> pre-copies of recompute moves
        "shifts": result.shifts,
        "num_decisions": result.num_decisions,
        "decisions": _distinct(result.decisions),
        "resource_timeline": [e.to_dict() for e in sc.resources],
        "resource_events": result.resource_events,
        "phases": phase_rows(result),
        "gpu_occupancy": occupancy(result),
        "num_events": result.num_events,
        "models": models,
        "instances": [
            {
                "name": rec.dep.name,
                "model": rec.dep.model,
                "gear": rec.dep.gear.key(),
                "gpus": list(rec.dep.gpu_ids),
                "launched_s": _r(rec.launched_s),
                "ready_s": _r(rec.ready_s),
                "released_s": _r(rec.released_s),
                "died": rec.died,
                "num_kv_blocks": rec.num_kv_blocks,
                "max_model_len": rec.max_model_len,
                "num_steps": rec.instance.num_steps if rec.instance else 0,
                "busy_s": _r(rec.instance.busy_s) if rec.instance else 0.0,
            }
            for rec in result.instances
        ],
        "timeline": timeline_rows(result),
        "failures": failures[:100],
        "failed_by_why": dict(
            Counter(why_class(r.failed) for r in result.requests if r.failed).most_common()
        ),
        "notes": result.notes,
    }


def _distinct(decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Decisions taken, and holds under a trigger when their reason changed (a hold repeated
    every tick is one entry with its first time and count)."""
    out: list[dict[str, Any]] = []
    for d in decisions:
        last = out[-1] if out else None
        if d["action"] == "hold" and last is not None and last["reason"] == d["reason"]:
            last["num_ticks"] += 1
            continue
        out.append({**d, "num_ticks": 1})
    return out


def phase_rows(result: SimResult) -> list[dict[str, Any]]:
    """Throughput per phase: the run cut at each resource-timeline event (before the other
    tenant leaves, after, ...). Requests count in the phase they completed in."""
    end = result.usage.end_s
    slos = {m.name: m.slo for m in result.demands}
    cuts = sorted({0.0, *(e.at_s for e in result.scenario.resources if 0 < e.at_s < end), end})
    rows = []
    for lo, hi in itertools.pairwise(cuts):
        last = hi == end  # (the run's last completion ends it)
        done = [
            r
            for r in result.requests
            if r.completed and lo <= r.finish_s and (r.finish_s < hi or last)
        ]
        what = [e.note or e.describe() for e in result.scenario.resources if e.at_s == lo]
        rows.append(
            {
                "start_s": _r(lo),
                "end_s": _r(hi),
                "after": "; ".join(what) or "start",
                "completed": len(done),
                "tokens_per_s": _r(sum(r.num_generated_tokens for r in done) / (hi - lo)),
                "goodput_requests_per_s": _r(num_good(done, slos) / (hi - lo)),
            }
        )
    return rows


def occupancy(result: SimResult) -> list[dict[str, Any]]:
    """Who holds each GPU over time: our instances (from launch to release) and the other
    tenants (from the resource timeline), as segments per GPU in the cluster's order."""
    from flexpipe.sim.timeline import apply_event

    sc = result.scenario
    end = result.usage.end_s

    def state(cluster: Any, gid: str) -> str:
        if gid not in set(cluster.gpu_ids):
            return "lost"
        gpu = cluster.gpu(gid)
        return f"tenant:{gpu.owner or 'another tenant'}" if gpu.used_bytes > 0 else ""

    cluster = sc.cluster
    times = [0.0, *(e.at_s for e in sc.resources)]
    clusters = [cluster]
    for e in sc.resources:
        cluster = apply_event(cluster, e)
        clusters.append(cluster)
    gpus = {g.id: g for c in clusters for g in c.gpus}  # every GPU the run saw, in order
    tenants: dict[str, list[dict[str, Any]]] = {g: [] for g in gpus}
    for gid in gpus:
        for i, (t, c) in enumerate(zip(times, clusters, strict=True)):
            who = state(c, gid)
            stop = times[i + 1] if i + 1 < len(times) else end
            if gid not in sc.cluster.gpu_ids and all(
                gid not in p.gpu_ids for p in clusters[: i + 1]
            ):
                who = ""  # not joined yet
            if who and stop > t:
                tenants[gid].append({"start_s": _r(t), "end_s": _r(min(stop, end)), "holder": who})
    out = []
    for gid, gpu in gpus.items():
        segs = list(tenants[gid])
        for rec in result.instances:
            if gid in rec.dep.gpu_ids:
                stop = rec.released_s if rec.released_s >= 0 else end
                segs.append(
                    {
                        "start_s": _r(rec.launched_s),
                        "end_s": _r(min(stop, end)),
                        "holder": rec.dep.name,
                        "model": rec.dep.model,
                    }
                )
        segs.sort(key=lambda s: (s["start_s"], s["holder"]))
        out.append({"gpu": gid, "node": gpu.node, "type": gpu.type, "segments": segs})
    return out


def timeline_rows(result: SimResult) -> list[dict[str, float | None]]:
    u = result.usage
    slos = {m.name: m.slo for m in result.demands}
    step = u.interval_s
    last = len(u.reserved_gpu_s) - 1
    ends: list[list[SimRequest]] = [[] for _ in u.reserved_gpu_s]  # completions per interval
    for r in result.requests:
        if r.completed:  # (one ending exactly at the run's end is in the last interval)
            ends[min(int(r.finish_s // step), last)].append(r)
    rows: list[dict[str, float | None]] = []
    for i, (res, busy) in enumerate(zip(u.reserved_gpu_s, u.busy_gpu_s, strict=True)):
        span = u.interval_s_at(i)
        ttfts = [r.ttft_s for r in ends[i]]
        tpots = [r.tpot_s for r in ends[i]]
        rows.append(
            {
                "start_s": _r(i * step),
                "gpus_reserved": _r(res / span),
                "utilisation": _r(busy / res) if res else 0.0,
                "completed": len(ends[i]),
                "tokens_per_s": _r(sum(r.num_generated_tokens for r in ends[i]) / span),
                "ttft_p50_s": _pct_or_none(ttfts, 50),
                "ttft_p99_s": _pct_or_none(ttfts, 99),
                "tpot_p50_s": _pct_or_none(tpots, 50),
                "tpot_p99_s": _pct_or_none(tpots, 99),
                "goodput_requests_per_s": _r(num_good(ends[i], slos) / span),
            }
        )
    return rows


REQUEST_FIELDS = (
    "request_id",
    "model",
    "arrival_s",
    "instance",
    "num_prompt_tokens",
    "num_output_tokens",
    "num_generated_tokens",
    "num_cached_tokens",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "failed",
)


def requests_csv(result: SimResult) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(REQUEST_FIELDS)
    for r in result.requests:
        ok = r.completed
        w.writerow(
            [
                r.request_id,
                r.model,
                f"{r.arrival_s:.6f}",
                r.instance,
                r.num_prompt_tokens,
                r.num_output_tokens,
                r.num_generated_tokens,
                r.num_cached_tokens,
                f"{r.ttft_s:.6f}" if ok else "",
                f"{r.tpot_s:.6f}" if ok else "",
                f"{r.e2e_s:.6f}" if ok else "",
                r.failed,
            ]
        )
    return out.getvalue()


def timeline_csv(result: SimResult) -> str:
    rows = timeline_rows(result)
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return out.getvalue()


SHIFT_FIELDS = (
    "at_s",
    "finished_s",
    "trigger",
    "succeeded",
    "outcome",
    "score",
    "phases",
    "migrated",
    "started",
    "stopped",
    "reason",
)


def shifts_csv(rep: dict[str, Any]) -> str:
    """One row per shift carried out (the first plan included)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(SHIFT_FIELDS)
    for s in rep["shifts"]:
        w.writerow(
            [
                f"{s['at_s']:.6f}",
                f"{s['finished_s']:.6f}",
                s["trigger"],
                s["succeeded"],
                s["outcome"],
                s["score"],
                ";".join(f"{k}={v}" for k, v in s["phases_s"].items()),
                ";".join(f"{k}={v}" for k, v in s["migrated"].items()),
                ";".join(s["started"]),
                ";".join(s["stopped"]),
                s["reason"],
            ]
        )
    return out.getvalue()


def report_json(result: SimResult) -> str:
    return json.dumps(report(result), indent=2) + "\n"


def write_reports(result: SimResult, out_dir: Path) -> list[Path]:
    """report.json, report.html, requests.csv, timeline.csv and shifts.csv in `out_dir`."""
    from flexpipe.sim.html_report import report_html

    out_dir.mkdir(parents=True, exist_ok=True)
    rep = report(result)
    files = {
        "report.json": json.dumps(rep, indent=2) + "\n",
        "report.html": report_html(rep),
        "shifts.csv": shifts_csv(rep),
        "requests.csv": requests_csv(result),
        "timeline.csv": timeline_csv(result),
    }
    paths = []
    for name, text in files.items():
        path = out_dir / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def _asleep(u: Usage) -> dict[str, Any]:
    """What sleeping engines held, apart from the GPU-hours reserved (only where an engine
    slept: a run without sleep mode reports as before)."""
    if not u.asleep_gpu_s:
        return {}
    gib_h = 3600 * 1024**3
    return {
        "asleep": {
            "gpu_hours": _r(u.asleep_gpu_s / 3600),
            "gpu_memory_gib_hours": _r(u.asleep_gpu_memory_byte_s / gib_h),
            "host_ram_gib_hours": _r(u.asleep_host_ram_byte_s / gib_h),
        }
    }
