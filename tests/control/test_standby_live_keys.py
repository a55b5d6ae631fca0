"""The live standby shell (control/standby_live.py, `StandbySleepers`) reads the
`shift.standby` keys the simulator's (sim/standby_run.py) reads, through the same pure
functions (control/core/standby_aside.py, `rates_observed`, `standby_planner`): with
`arrival_peaks` a peak rate counts the requests in flight and waiting, with
`outlook_horizon_s` the standby rate is the outlook's (`outlook_rates`), with `slo_gears`
the standbys come from a planner at `sizing: slo`. A fake controller (plain data) as in
test_standby_swap.py; exact values."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from flexpipe.cluster import load_cluster
from flexpipe.control.core.planner import ControllerPlanner
from flexpipe.control.core.tick import Readings
from flexpipe.control.standby_live import StandbySleepers
from flexpipe.perf.gear_lookup import GearLookup
from flexpipe.policies.planner import ModelDemand, PlannerConfig, Slo
from flexpipe.policies.shift.forecast import ForecastParams
from flexpipe.policies.shift.standby_outlook import outlook_rates
from flexpipe.policies.shift.standby_sleepers import StandbyParams

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = load_cluster(ROOT / "examples/clusters/fragmented-4gpu.yaml").with_used("gpu1", 0.0)
# a tight SLO: a 7B engine on one GPU serves 1.28 req/s by throughput, 0.82 within it
A = ModelDemand("a", "llama-2-7b", 1.0, 2048, 256, Slo(1.0, 0.03), ("bf16",))
ON = StandbyParams(enabled=True, num_per_model=1, max_per_model=4)


def shell(params: StandbyParams, time_scale: float = 1.0) -> StandbySleepers:
    ctl: Any = SimpleNamespace(
        cfg=SimpleNamespace(
            shift=SimpleNamespace(standby=params, forecast=ForecastParams()),
            demands=[A],
            time_scale=time_scale,
        ),
        running={},
        executor=SimpleNamespace(sleepers={}),
        cluster=CLUSTER,
        planner=ControllerPlanner(GearLookup(), config=PlannerConfig()),
        clock=lambda: 0.0,
    )
    return StandbySleepers(ctl)


def reading(done: float, in_flight: float = 0.0, queued: int = 0) -> Readings:
    """The gateway's readings: `done` requests of a finished so far, `in_flight` on its one
    engine, `queued` waiting."""
    pool = [{"url": "http://e", "model": "a", "state": "active", "num_in_flight": in_flight}]
    return Readings(pool, {}, queued, {"a": queued}, {"a": done})


def test_arrival_peaks_count_what_is_in_flight_and_waiting() -> None:
    """10 s apart: 10 requests finished (1 req/s, what the engine managed), 20 in flight
    and 30 waiting besides: 60 arrived, 6 req/s."""
    for params, peak in ((ON, 1.0), (replace(ON, arrival_peaks=True), 6.0)):
        beside = shell(params)
        beside.observe(0.0, reading(0.0))
        beside.observe(10.0, reading(10.0, in_flight=20.0, queued=30))
        assert beside.rates.peak_rates == {"a": peak}


BURST = [10.0, 10.0, 10.0, 100.0, 100.0, 10.0, 10.0, 10.0, 10.0]  # finished each 10 s


def watch(params: StandbyParams, time_scale: float = 1.0) -> StandbySleepers:
    """`BURST` read every 10 s: 1 req/s, a 10 req/s burst, 1 req/s again."""
    beside = shell(params, time_scale)
    done = 0.0
    beside.observe(0.0, reading(done))
    for i, n in enumerate(BURST, start=1):
        done += n
        beside.observe(10.0 * i, reading(done))
    return beside


def test_the_outlook_sizes_the_standbys_from_the_rate_history() -> None:
    """Without the outlook the peak seen, 10 req/s (over the last two readings); with it
    the history of each reading's rate, and `outlook_rates` of it: the burst's mean peak
    times `burst_margin` 1.5."""
    assert watch(ON).rates.peak_rates == {"a": 10.0}
    params = replace(ON, outlook_horizon_s=300.0, burst_margin=1.5)
    rates = watch(params).rates
    assert rates.history == {
        "a": ((10.0, 1.0), (20.0, 1.0), (30.0, 1.0), (40.0, 5.5), (50.0, 10.0),
              (60.0, 5.5), (70.0, 1.0), (80.0, 1.0), (90.0, 1.0))
    }  # fmt: skip
    assert rates.peak_rates == outlook_rates(rates.history, 90.0, ForecastParams(), params)
    assert rates.peak_rates == {"a": 15.0}
    # sim engines at a time scale: rates per modelled second (2 wall s each)
    scaled = watch(params, time_scale=2.0).rates
    assert scaled.history["a"][4] == (50.0, 20.0) and scaled.peak_rates == {"a": 30.0}


def test_slo_gears_plan_the_standbys_at_the_slo() -> None:
    """a at 1 req/s: one engine on gpu1 covers it by throughput (1.28 req/s); within the
    SLO it serves 0.82, so the SLO-sized planner asks for a second, on gpu2."""
    plain = shell(ON)
    assert [i.gpu_ids for i in plain.standbys({})] == [("gpu1",)]
    slo = shell(replace(ON, slo_gears=True))
    assert [i.gpu_ids for i in slo.standbys({})] == [("gpu1",), ("gpu2",)]
    planner = slo.planner()
    assert isinstance(planner, ControllerPlanner) and planner.config is not None
    assert planner.config.sizing == "slo" and planner is slo.planner()
    assert planner.performance is slo.ctl.planner.performance
