"""Deadline-aware admission in the simulator (the gateway's `admission` block in a scenario,
gateway/core/deadline.py as live): an overloaded one-GPU run, first come first served against
least slack first with late requests shed. Shedding what cannot meet its TTFT SLO raises the
SLO attainment among served requests and does not lower goodput; the shed are counted apart
from the failures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.sim_agreement import Fixed  # runs the given deployments from t = 0
from flexpipe.gears.gear import Gear
from flexpipe.sim import report, simulate
from flexpipe.sim.deployment import Deployment
from flexpipe.sim.scenario import ScenarioError, parse_scenario

ONE_L4 = {"name": "a", "nodes": [{"name": "n0", "gpus": [{"id": "g0", "type": "L4"}]}]}
DEPS = (Deployment("l4", "m", "llama-2-7b", Gear(max_num_seqs=4), (("g0",),)),)
DURATION_S = 90.0


def _run(admission: dict[str, Any] | None) -> dict[str, Any]:
    """About 6 requests a second for an L4 that serves about one: overloaded throughout."""
    doc = {
        "name": "overload", "duration_s": DURATION_S, "seed": 0, "cluster": {"inline": ONE_L4},
        "models": [{"name": "m", "model": "llama-2-7b", "priority": 2,
                    "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 200}}],
        "workloads": [{"model": "m", "arrivals": {"process": "poisson", "rate_per_s": 6},
                       "prompt_tokens": {"dist": "fixed", "mean": 512},
                       "output_tokens": {"dist": "fixed", "mean": 64}}],
        "gateway": {"max_queue_wait_s": 60, **({"admission": admission} if admission else {})},
    }  # fmt: skip
    scenario = parse_scenario(doc, Path("."))
    if admission:  # the models' SLO and priority fill what the block does not name
        assert scenario.gateway.admission.ttft_slo_s == {"m": 2.0}
        assert scenario.gateway.admission.priority == {"m": 2.0}
    return report(simulate(scenario, Fixed(DEPS)))


def _served_attainment(rep: dict[str, Any]) -> float:
    num_good = round(rep["goodput_requests_per_s"] * DURATION_S)
    return num_good / rep["num_completed"]


def test_shedding_late_requests_raises_served_attainment_and_keeps_goodput() -> None:
    fcfs = _run(None)
    slack = _run({"order": "slack", "shed_late": True, "shed_margin_s": 0.5})
    assert "num_shed" not in fcfs  # off: the report is as it was
    assert slack["num_shed"] > 0
    for rep in (fcfs, slack):  # every request ends once: served, failed or shed
        num_ends = rep["num_completed"] + rep["num_failed"] + rep.get("num_shed", 0)
        assert num_ends == rep["num_requests"] == fcfs["num_requests"]
    assert all(why.startswith("shed: ") for why in slack["failed_by_why"] if "SLO" in why)
    before, after = _served_attainment(fcfs), _served_attainment(slack)
    print(
        f"\nfcfs:  served {fcfs['num_completed']}, attainment among served {before:.3f}, "
        f"goodput {fcfs['goodput_requests_per_s']:.3f}/s"
        f"\nslack: served {slack['num_completed']}, shed {slack['num_shed']}, attainment "
        f"among served {after:.3f}, goodput {slack['goodput_requests_per_s']:.3f}/s"
    )
    assert after > before
    assert slack["goodput_requests_per_s"] >= fcfs["goodput_requests_per_s"]


def test_a_scenario_without_the_block_leaves_admission_off() -> None:
    doc = {
        "name": "off", "duration_s": 1, "cluster": {"inline": ONE_L4},
        "models": [{"name": "m", "model": "llama-2-7b",
                    "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 200}}],
        "workloads": [{"model": "m", "arrivals": {"process": "poisson", "rate_per_s": 1}}],
    }  # fmt: skip
    adm = parse_scenario(doc, Path(".")).gateway.admission
    assert not adm.enabled and adm.ttft_slo_s == {} and adm.priority == {}
    doc["gateway"] = {"admission": {"order": "edf"}}
    with pytest.raises(ScenarioError, match=r"gateway: admission\.order: expected one of"):
        parse_scenario(doc, Path("."))
