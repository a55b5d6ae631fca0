"""The numbers of one run: goodput, SLO attainment, latency percentiles, GPU-hours reserved
and used, utilisation over time, failures. JSON (one document) and CSV (one row per request,
one per interval). Only virtual-clock quantities go in, so the same scenario and seed give
byte-identical files.

goodput: completed requests that met both their model's TTFT and TPOT SLOs (each request
against the SLO thresholds), per second of the scenario's duration. SLO attainment: the
share of all requests (failed ones included) that did.
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flexpipe.sim.request import SimRequest
from flexpipe.sim.simulator import SimResult


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, -(-len(ordered) * q // 100) - 1))
    return ordered[int(k)]


def _r(x: float) -> float:
    return round(x, 6)


def _latency(values: list[float]) -> dict[str, float]:
    return {f"p{q}": _r(percentile(values, q)) for q in (50, 90, 99)}


def _summary(
    reqs: list[SimRequest], duration_s: float, ttft_s: float, tpot_s: float
) -> dict[str, Any]:
    done = [r for r in reqs if r.completed]
    good = [r for r in done if r.ttft_s <= ttft_s and r.tpot_s <= tpot_s]
    failed = Counter(
        r.failed.split(":")[0] if ":" in r.failed else r.failed for r in reqs if r.failed
    )
    return {
        "num_requests": len(reqs),
        "num_completed": len(done),
        "num_failed": len(reqs) - len(done),
        "failed_by_reason": dict(sorted(failed.items())),
        "goodput_requests_per_s": _r(len(good) / duration_s),
        "slo_attainment": _r(len(good) / len(reqs)) if reqs else 0.0,
        "throughput_tokens_per_s": _r(sum(r.num_generated_tokens for r in done) / duration_s),
        "ttft_s": _latency([r.ttft_s for r in done]),
        "tpot_s": _latency([r.tpot_s for r in done]),
        "e2e_s": _latency([r.e2e_s for r in done]),
        "first_served_s": _r(min((r.first_token_s for r in done), default=-1.0)),
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
            **_summary(mine, d, m.slo.ttft_p99_s, m.slo.tpot_p99_s),
        }
    done = [r for r in result.requests if r.completed]
    good = sum(
        1
        for r in done
        if r.ttft_s <= slos[r.model].ttft_p99_s and r.tpot_s <= slos[r.model].tpot_p99_s
    )
    u = result.usage
    reserved = sum(u.reserved_gpu_s)
    busy = sum(u.busy_gpu_s)
    failures = [
        {"request_id": r.request_id, "model": r.model, "at_s": _r(r.arrival_s), "why": r.failed}
        for r in result.requests
        if r.failed
    ]
    return {
        "scenario": sc.name,
        "policy": result.policy,
        "routing": result.routing,
        "seed": sc.seed,
        "duration_s": d,
        "end_s": _r(result.end_s),
        "num_requests": len(result.requests),
        "num_completed": len(done),
        "num_failed": len(result.requests) - len(done),
        "goodput_requests_per_s": _r(good / d),
        "slo_attainment": _r(good / len(result.requests)) if result.requests else 0.0,
        "gpu_hours_reserved": _r(reserved / 3600),
        "gpu_hours_used": _r(busy / 3600),
        "utilisation": _r(busy / reserved) if reserved else 0.0,
        "num_events": result.num_events,
        "models": models,
        "instances": [
            {
                "name": rec.dep.name,
                "model": rec.dep.model,
                "gear": rec.dep.gear.key(),
                "gpus": list(rec.dep.gpu_ids),
                "ready_s": _r(rec.ready_s),
                "num_kv_blocks": rec.num_kv_blocks,
                "max_model_len": rec.max_model_len,
                "num_steps": rec.instance.num_steps if rec.instance else 0,
                "busy_s": _r(rec.instance.busy_s) if rec.instance else 0.0,
            }
            for rec in result.instances
        ],
        "timeline": timeline_rows(result),
        "failures": failures[:100],
        "notes": result.notes,
    }


def timeline_rows(result: SimResult) -> list[dict[str, float]]:
    u = result.usage
    step = u.interval_s
    ends: list[list[SimRequest]] = [[] for _ in u.reserved_gpu_s]  # completions per interval
    for r in result.requests:
        i = int(r.finish_s // step)
        if r.completed and i < len(ends):
            ends[i].append(r)
    rows = []
    for i, (res, busy) in enumerate(zip(u.reserved_gpu_s, u.busy_gpu_s, strict=True)):
        lo, hi = i * step, min((i + 1) * step, u.duration_s)
        rows.append(
            {
                "start_s": _r(lo),
                "gpus_reserved": _r(res / (hi - lo)),
                "utilisation": _r(busy / res) if res else 0.0,
                "completed": len(ends[i]),
                "tokens_per_s": _r(sum(r.num_generated_tokens for r in ends[i]) / (hi - lo)),
                "ttft_p50_s": _r(percentile([r.ttft_s for r in ends[i]], 50)),
            }
        )
    return rows


REQUEST_FIELDS = (
    "request_id", "model", "arrival_s", "instance", "num_prompt_tokens", "num_output_tokens",
    "num_generated_tokens", "num_cached_tokens", "ttft_s", "tpot_s", "e2e_s", "failed",
)  # fmt: skip


def requests_csv(result: SimResult) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(REQUEST_FIELDS)
    for r in result.requests:
        ok = r.completed
        w.writerow(
            [
                r.request_id, r.model, f"{r.arrival_s:.6f}", r.instance, r.num_prompt_tokens,
                r.num_output_tokens, r.num_generated_tokens, r.num_cached_tokens,
                f"{r.ttft_s:.6f}" if ok else "", f"{r.tpot_s:.6f}" if ok else "",
                f"{r.e2e_s:.6f}" if ok else "", r.failed,
            ]
        )  # fmt: skip
    return out.getvalue()


def timeline_csv(result: SimResult) -> str:
    rows = timeline_rows(result)
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return out.getvalue()


def report_json(result: SimResult) -> str:
    return json.dumps(report(result), indent=2) + "\n"


def write_reports(result: SimResult, out_dir: Path) -> list[Path]:
    """report.json, requests.csv and timeline.csv in `out_dir` (created)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "report.json": report_json(result),
        "requests.csv": requests_csv(result),
        "timeline.csv": timeline_csv(result),
    }
    paths = []
    for name, text in files.items():
        path = out_dir / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths
