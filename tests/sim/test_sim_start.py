"""How a run's deployment starts (`start:`, flexpipe.sim.start; docs/simulator.md, "The
start"): cold by default; warm, every policy's first plan loaded by t = 0; the controller's
first plan sized for the rate at the start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flexpipe.policies.planner import ModelDemand, Slo
from flexpipe.sim import simulate
from flexpipe.sim.engine_factory import engine_config
from flexpipe.sim.request import SimRequest
from flexpipe.sim.scenario import ScenarioError, parse_scenario
from flexpipe.sim.start import StartParams, start_demands

FOUR_A100 = {"name": "four", "nodes": [{"name": "n0", "gpus": [
    {"id": f"g{i}", "type": "A100-80G-SXM"} for i in range(4)]}]}  # fmt: skip
MODEL = {"name": "m", "model": "llama-2-7b", "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 60}}


def _doc(**extra: Any) -> dict[str, Any]:
    return {
        "name": "start", "duration_s": 120, "seed": 0, "report_interval_s": 30,
        "cluster": {"inline": FOUR_A100}, "models": [MODEL],
        "workloads": [{"model": "m", "arrivals": {"process": "poisson", "rate_per_s": 4},
                       "prompt_tokens": {"dist": "fixed", "mean": 512},
                       "output_tokens": {"dist": "fixed", "mean": 64}}],
        **extra,
    }  # fmt: skip


def test_start_is_parsed_and_checked() -> None:
    assert parse_scenario(_doc(), Path(".")).start == StartParams(False, 0.0)
    sc = parse_scenario(_doc(start={"warm": True, "expected_window_s": 60}), Path("."))
    assert sc.start == StartParams(True, 60.0)
    bad = [
        ({"warm": 1}, "start.warm: expected true or false, got 1"),
        ({"expected_window_s": -1}, "start.expected_window_s: must be >= 0 (got -1)"),
        ({"cold": True}, "start: unknown key(s) cold; known: warm, expected_window_s"),
    ]
    for start, message in bad:
        with pytest.raises(ScenarioError) as err:
            parse_scenario(_doc(start=start), Path("."))
        assert str(err.value) == f"<scenario>: {message}"


@pytest.mark.parametrize("policy", ["flexpipe", "static", "peak"])
def test_warm_start_loads_every_policys_first_plan_by_t0(policy: str) -> None:
    """Cold, the first plan's engines load for the performance model's load time while the
    first requests wait (flexpipe holds them) or fail (the baselines); warm, the same plan
    is ready at t = 0 and the first request is served at once."""
    cold = simulate(parse_scenario(_doc(), Path(".")), policy)
    warm = simulate(parse_scenario(_doc(start={"warm": True}), Path(".")), policy)
    assert [r.dep for r in warm.instances] == [r.dep for r in cold.instances]
    for rec in cold.instances:
        load_s = engine_config(rec.dep, cold.scenario.cluster, 4096).load_time_s
        assert rec.launched_s == 0.0 and rec.ready_s == pytest.approx(load_s) and load_s > 20
    assert all(r.launched_s == r.ready_s == 0.0 for r in warm.instances)
    first_cold, first_warm = cold.requests[0], warm.requests[0]
    assert first_cold.first_token_s > min(r.ready_s for r in cold.instances) or first_cold.failed
    assert first_warm.first_token_s - first_warm.arrival_s < 0.5
    assert not any(r.failed for r in warm.requests)


def test_start_demands_take_the_first_windows_rate_where_higher() -> None:
    slo = Slo(2.0, 0.06)
    demands = (
        ModelDemand("a", "llama-2-7b", 0.3, 512, 64, slo),
        ModelDemand("b", "llama-2-7b", 5.0, 512, 64, slo),
    )
    times = [("a", 1.0), ("b", 2.0), ("a", 3.0), ("a", 9.9), ("a", 10.0), ("b", 11.0)]
    reqs = [SimRequest(i, t, m, 512, 64) for i, (m, t) in enumerate(times)]
    # over [0, 10 s): a 3 (0.3/s: not higher), b 1 (under its 5/s): kept
    assert start_demands(demands, reqs, 10.0) == demands
    # over [0, 2 s): a 1 in 2 s (0.5/s), raised; b none, kept
    assert [d.request_rate_per_s for d in start_demands(demands, reqs, 2.0)] == [0.5, 5.0]
    # over [0, 12 s): a 4 (1/3 /s); arrivals at or after the window's end do not count
    raised = start_demands(demands, reqs, 12.0)
    assert [d.request_rate_per_s for d in raised] == [4 / 12, 5.0]
    assert start_demands(demands, reqs, 0.0) == demands


def test_the_first_plan_is_sized_for_the_rate_at_the_start() -> None:
    """A diurnal day that starts at its peak (1.9x its mean): the controller's first plan for
    the mean has fewer instances than the one for the first minute's rate."""
    wl = {"model": "m", "arrivals": {"process": "poisson", "rate_per_s": 3},
          "diurnal": {"period_s": 600, "amplitude": 0.9, "peak_s": 0},
          "prompt_tokens": {"dist": "fixed", "mean": 1024},
          "output_tokens": {"dist": "fixed", "mean": 256}}  # fmt: skip
    runs = {}
    for window_s in (0, 60):
        doc = _doc(workloads=[wl], duration_s=600,
                   start={"warm": True, "expected_window_s": window_s})  # fmt: skip
        runs[window_s] = simulate(parse_scenario(doc, Path(".")), "flexpipe")
    first = {w: r.decisions[0]["target"] for w, r in runs.items()}
    assert first == {0: ["m-0"], 60: ["m-0", "m-1"]}
