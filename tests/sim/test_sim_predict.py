"""Ahead of the curve in the simulator (docs/shift-policy.md, "Fast up, slow down"): a model
whose load climbs steadily gets its next instance from the forecast, before its queue forms;
a burst is still answered within two ticks with the queue-rise filter on."""

from __future__ import annotations

from typing import Any

from test_sim_fast_up import BURST_S, FAST, TICK_S, _first_up
from test_sim_shift import ROOT, SEED_CLUSTER, fixed_workload, seven_b

from flexpipe.sim import simulate
from flexpipe.sim.scenario import parse_scenario

AHEAD = {**FAST, "fast_up_min_wait_fraction": 0.25, "ahead_capacity_fraction": 1.0}
FORECAST = {"horizon_s": 120, "trend_window_s": 300, "min_trend_span_s": 150}


def _ramp(triggers: dict[str, Any]) -> Any:
    """chat's load climbs from 0.1 to 10.9 req/s over 600 s (a diurnal half-day from its
    trough), code stays at 1 req/s: chat outgrows its first plan's capacity mid-way."""
    model, workload = seven_b, fixed_workload
    doc = {
        "name": "ramp", "duration_s": 720, "seed": 0, "report_interval_s": 10,
        "cluster": {"file": str(SEED_CLUSTER)}, "models": [model("chat"), model("code")],
        "workloads": [{**workload("chat", 5.5, 0),
                       "diurnal": {"period_s": 1200, "amplitude": 0.98, "peak_s": 600}},
                      workload("code", 1, 0)],
        "controller": {"tick_s": TICK_S, "shift": {"triggers": triggers, "forecast": FORECAST}},
    }  # fmt: skip
    return parse_scenario(doc, ROOT)


def _ups(triggers: dict[str, Any]) -> list[dict[str, Any]]:
    r = simulate(_ramp(triggers), "flexpipe")
    return [d for d in r.decisions if d["trigger"] == "up" and d["action"] == "shift"]


def test_the_forecast_starts_an_instance_before_the_queue_does() -> None:
    ahead = _ups(AHEAD)
    assert ahead, "no up-shift on the ramp"
    assert "ahead of the curve" in ahead[0]["reason"], ahead[0]["reason"]
    queue_only = _ups({**AHEAD, "ahead_capacity_fraction": 0.0})
    assert queue_only, "no up-shift on the ramp without the forecast"
    assert "ahead of the curve" not in queue_only[0]["reason"]
    # two minutes earlier: the forecast's horizon
    assert (round(ahead[0]["at_s"], 1), round(queue_only[0]["at_s"], 1)) == (446.7, 566.7)


def test_a_burst_is_still_answered_within_two_ticks_with_the_rise_filter() -> None:
    up = _first_up({**FAST, "fast_up_min_wait_fraction": 0.25})
    assert up["action"] == "shift", up["reason"]
    assert up["at_s"] - BURST_S <= 2 * TICK_S
    assert round(up["at_s"], 1) == 156.7  # the first tick after the burst began, as without
    assert up["reason"].startswith("chat urgent 1 sample(s) in a row (fast up)")
