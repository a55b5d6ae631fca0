"""Fast up in the simulator (docs/shift-policy.md, "Fast up, slow down"): a burst is answered
within two controller ticks with the knobs on; with the defaults, five samples in a row come
first."""

from __future__ import annotations

from typing import Any

from test_sim_shift import ROOT, SEED_CLUSTER, fixed_workload, seven_b

from flexpipe.sim import simulate
from flexpipe.sim.scenario import parse_scenario

BURST_S = 150.0
TICK_S = 10.0
FAST = {"fast_up_samples": 1, "cooldown_blocks_up": False}


def _burst(triggers: dict[str, Any]) -> Any:
    """chat and code at 1 req/s from 30 s; chat's load rises by 30 req/s at `BURST_S`."""
    model, workload = seven_b, fixed_workload
    doc = {
        "name": "burst", "duration_s": BURST_S + 120, "seed": 0, "report_interval_s": 10,
        "cluster": {"file": str(SEED_CLUSTER)}, "models": [model("chat"), model("code")],
        "workloads": [workload("chat", 1, 30), workload("code", 1, 30),
                      {**workload("chat", 30, BURST_S), "arrivals": {"rate_per_s": 30,
                                                                     "start_s": BURST_S}}],
        "controller": {"tick_s": TICK_S, "shift": {"triggers": triggers}},
    }  # fmt: skip
    return parse_scenario(doc, ROOT)


def _first_up(triggers: dict[str, Any]) -> dict[str, Any]:
    r = simulate(_burst(triggers), "flexpipe")
    return next(d for d in r.decisions if d["trigger"] == "up" and d["at_s"] >= BURST_S)


def test_a_burst_is_answered_within_two_ticks_with_fast_up() -> None:
    up = _first_up(FAST)
    assert up["action"] == "shift", up["reason"]
    assert up["at_s"] - BURST_S <= 2 * TICK_S
    assert round(up["at_s"], 1) == 156.7  # the first tick after the burst began
    assert up["reason"].startswith("chat urgent 1 sample(s) in a row (fast up)")


def test_without_the_knobs_the_up_shift_waits_for_five_samples() -> None:
    up = _first_up({})
    assert up["at_s"] - BURST_S > 4 * TICK_S
    assert round(up["at_s"], 1) == 196.7  # the fifth tick in the up zone
    assert "in the up zone 5 samples in a row" in up["reason"]
