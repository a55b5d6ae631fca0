"""Time-sharing a GPU between models on the virtual clock (docs/controller.md, "Standby
sleepers", "Time-sharing"): bursty-serverless (seed 0), where `shift.standby.time_share`
is on, its first 260 s. A standby of chat-8b sleeps on pcie-h100-001/gpu0 beside qwen-14b's
engine; when chat-8b's burst comes, qwen-14b (idle) is put to sleep and chat-8b's sleeper
woken there right after — a swap, both steps priced by the performance model — and the
burst is served."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[0]))
from test_sim_standby import standby_as_pinned

from flexpipe.sim import simulate
from flexpipe.sim.report import meets_slo
from flexpipe.sim.scenario import load_scenario, resolve


def test_a_burst_is_served_by_a_swap_on_a_gpu_another_model_held() -> None:
    sc = standby_as_pinned(load_scenario(resolve("bursty-serverless")))
    assert sc.controller.shift.standby.time_share
    res = simulate(dataclasses.replace(sc, duration_s=260.0), "flexpipe")
    swaps = [s for s in res.shifts if s["trigger"] in ("swap-sleep", "swap-wake")]
    # the holder sleeps first, the sleeper wakes when it is asleep: no cold start
    pairs = list(zip(swaps[::2], swaps[1::2], strict=True))
    assert [(a["trigger"], b["trigger"]) for a, b in pairs] == [("swap-sleep", "swap-wake")]
    for asleep, woken in pairs:
        assert woken["at_s"] == asleep["finished_s"]
        assert set(asleep["phases_s"]) == {"drain", "migrate", "sleep"}
        assert set(woken["phases_s"]) == {"wake"} and woken["phases_s"]["wake"] < 1.0
    sleep_at, wake = pairs[0]
    assert sleep_at["at_s"] == 237.0
    assert wake["started"] == ["chat-8b|tp1-pp1-bf16-kvauto-s192|pcie-h100-001/gpu0"]
    # the holder: qwen-14b's engine on that GPU, asleep at level 1 from then on
    slept = [
        (i.planned.model, i.planned.gpu_ids, span[2])
        for i in res.instances
        for span in i.asleep_spans
        if i.planned is not None and span[0] == sleep_at["at_s"]
    ]
    assert slept == [("qwen-14b", ("pcie-h100-001/gpu0",), 1.0)]
    # the burst it answered: every request served, 99 % within the SLO
    slos = {d.name: d.slo for d in res.demands}
    burst = [
        r
        for r in res.requests
        if r.model == "chat-8b" and r.context_of is None and r.arrival_s >= 215.0
    ]
    assert len(burst) == 676 and all(r.completed for r in burst)
    assert sum(meets_slo(r, slos[r.model]) for r in burst) == 665
