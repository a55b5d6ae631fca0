"""The rehearsal of a new instance: one probe through its engine, timed against the gear
table's prediction (the executor's step 2; a miss beyond tolerance rolls the shift back)."""

from __future__ import annotations

import time
from typing import Any

import orjson

from flexpipe.control.core.shift_plan import probe_tokens, rehearsal_check
from flexpipe.http.client import ClientPool, Timeouts, UpstreamError
from flexpipe.policies.planner import PlannedInstance
from flexpipe.policies.shift.snapshot import instance_key

__all__ = ["rehearse"]


async def rehearse(
    pool: ClientPool,
    planned: PlannedInstance,
    url: str,
    time_scale: float,
    probe_overhead_s: float,
    tolerance: float,
) -> dict[str, Any]:
    """One probe through the engine at `url`, its time against the gear table's prediction
    for the probe (TTFT + TPOT per further token, at the gear's full batch: an upper bound
    for a lone probe), with `probe_overhead_s` of wall time allowed for HTTP."""
    key = instance_key(planned)
    est = planned.estimate
    num_probe_tokens = probe_tokens(est.ttft_s, est.tpot_s, time_scale, probe_overhead_s)
    body = orjson.dumps(
        {
            "model": planned.model,
            "prompt": "rehearsal " * 32,
            "max_tokens": num_probe_tokens,
            "ignore_eos": True,
        }
    )
    headers = {"content-type": "application/json"}
    t0 = time.monotonic()
    try:
        resp = await pool.request(
            url, "POST", "/v1/completions", body, headers, Timeouts(3.0, 120.0, 60.0)
        )
        data = await resp.read()
        resp.release()
    except UpstreamError as exc:
        return {"instance": key, "passed": False, "why": f"{key}: probe {exc}"}
    wall_s = time.monotonic() - t0
    if resp.status != 200:
        return {"instance": key, "passed": False, "why": f"{key}: probe answered {resp.status}"}
    usage = orjson.loads(data).get("usage") or {}
    num_tokens = max(1, int(usage.get("completion_tokens", 16)))
    predicted_s = est.ttft_s + est.tpot_s * (num_tokens - 1)
    if time_scale <= 0:  # no modelled time passes: nothing to compare
        return {"instance": key, "passed": True, "why": "", "skipped": "time scale 0"}
    measured_s = max(0.0, wall_s - probe_overhead_s) / time_scale
    return rehearsal_check(key, measured_s, predicted_s, tolerance)
