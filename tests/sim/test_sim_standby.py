"""Standby sleepers on the virtual clock (docs/controller.md, "Standby sleepers"): the first
four minutes of bursty-serverless (seed 0), where it is on. Every model gets a standby set
asleep before its first burst, and every burst after the first plan is answered by a wake
beside the shifts within two seconds of its first request (the aside tick is 1 s, a wake
0.3-1.2 s), never by a cold start; idle models go back to sleep."""

from __future__ import annotations

import dataclasses
from collections import Counter

from flexpipe.sim import simulate
from flexpipe.sim.report import meets_slo
from flexpipe.sim.scenario import Scenario, load_scenario, resolve


def standby_as_pinned(sc: Scenario) -> Scenario:
    """bursty-serverless with the standby keys this test was written against: one standby
    a model at least, the finished requests' peak, the factor alone, guests unspread, the
    planner's capacities, no take-back, a 30 s drain (the scenario's later keys,
    docs/shift-policy.md "bursty-serverless", off)."""
    standby = dataclasses.replace(
        sc.controller.shift.standby,
        num_per_model=1,
        arrival_peaks=False,
        single_stage=False,
        outlook_horizon_s=0.0,
        max_models_per_gpu=0,
        quiet_hosts_first=False,
        slo_gears=False,
        hosts_take_back=False,
    )
    shift = dataclasses.replace(sc.controller.shift, standby=standby)
    controller = dataclasses.replace(sc.controller, shift=shift, drain_deadline_s=30.0)
    return dataclasses.replace(sc, controller=controller)


def test_bursts_are_answered_by_standby_sleepers_woken_beside_the_shifts() -> None:
    sc = standby_as_pinned(load_scenario(resolve("bursty-serverless")))
    assert sc.controller.shift.standby.enabled
    res = simulate(dataclasses.replace(sc, duration_s=240.0), "flexpipe")
    by_trigger = Counter(s["trigger"] for s in res.shifts)
    assert by_trigger["plan"] == 1 and by_trigger["standby"] >= 1
    assert by_trigger["wake-aside"] >= 5 and by_trigger["sleep-aside"] >= 3
    assert "up" not in by_trigger and "wake" not in by_trigger  # no cold start for a burst
    # each burst that starts once the first plan serves (after 70 s): its first request
    # after 20 s without one
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for r in sorted(res.requests, key=lambda r: r.arrival_s):
        if r.context_of is not None:
            continue
        gap = r.arrival_s - last.get(r.model, -1e9)
        if r.arrival_s > 70.0 and gap > 20.0 and r.model not in first:
            first[r.model] = r.arrival_s
        last[r.model] = r.arrival_s
    wakes = [s for s in res.shifts if s["trigger"] == "wake-aside"]
    for model, t0 in first.items():
        woken = [
            s["at_s"]
            for s in wakes
            if s["at_s"] >= t0 - 1.0 and any(k.startswith(f"{model}|") for k in s["started"])
        ]
        assert woken and min(woken) - t0 <= 2.0, (model, t0, woken)
    # the standby sets sleep: no instance is launched for a burst after the first plan's
    launched_after = [i for i in res.instances if i.launched_s > 70.0]
    assert all(i.asleep_spans for i in launched_after)


def test_a_first_plan_standby_serving_a_burst_is_not_put_to_sleep() -> None:
    """Seed 1: mistral-7b's first burst comes at 31 s, while the first plan (each model's
    standby set) still loads; its standbys serve it instead of falling asleep with the
    idle models' when the plan is done: all but one request of the first 70 s meet the SLO."""
    sc = load_scenario(resolve("bursty-serverless"))
    res = simulate(dataclasses.replace(sc, seed=1, duration_s=200.0), "flexpipe")
    slos = {d.name: d.slo for d in res.demands}
    early = [r for r in res.requests if r.context_of is None and r.arrival_s < 70.0]
    assert len(early) == 379 and {r.model for r in early} == {"mistral-7b"}
    # (306 of them missed it when its standbys fell asleep at 35 s: a wake, then a queue)
    assert sum(meets_slo(r, slos[r.model]) for r in early) == 378
