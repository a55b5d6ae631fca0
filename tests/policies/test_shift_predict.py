"""Fast up on the rise, ahead of the curve, and the outlook a standby keeper reads
(docs/shift-policy.md, "Fast up, slow down" and "The outlook"): hand-made samples and rate
histories on a fake clock, exact values.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from test_shift_fast_up import FAST, fast_policy, model, q
from test_shift_policy import CLUSTER, demand, running_for

from flexpipe.policies.shift import (
    ModelState,
    Sample,
    ShiftParams,
    ShiftSnapshot,
    TriggerParams,
    Zone,
)
from flexpipe.policies.shift.forecast import Burst, ForecastParams, bursts, outlook
from flexpipe.policies.shift.triggers import ahead_of_capacity, model_signal, rising, urgent_run


def u(t: float, utilization: float, depth: int = 0) -> Sample:
    """A sample with utilisation `utilization` and `depth` requests waiting."""
    return Sample(t, depth, 100, 0.5, 0.025, utilization)


# -- the queue's rise, filtered by the wait it means ------------------------------------------


def test_a_rise_of_the_queue_is_urgent_only_once_it_means_a_wait() -> None:
    # capacity 10 req/s, TTFT SLO 2 s: 1 -> 2 waiting is a 0.2 s wait, 1 -> 5 a 0.5 s one
    assert urgent_run([q(10, 1), q(20, 2)], 2.0, 1.0, 10.0) == 1  # any rise (the default)
    assert urgent_run([q(10, 1), q(20, 2)], 2.0, 1.0, 10.0, min_wait_fraction=0.25) == 0
    assert urgent_run([q(10, 1), q(20, 5)], 2.0, 1.0, 10.0, min_wait_fraction=0.25) == 1
    assert urgent_run([q(10, 1), q(20, 4)], 2.0, 1.0, 10.0, min_wait_fraction=0.25) == 0
    # a wait past the SLO stays urgent whatever the rise
    assert urgent_run([q(10, 30), q(20, 25)], 2.0, 1.0, 10.0, min_wait_fraction=0.25) == 2


# -- utilisation's slope ------------------------------------------------------------------


def test_rising_reads_the_line_through_the_utilisations() -> None:
    climb = [u(10, 0.3), u(20, 0.4), u(30, 0.5)]  # +0.01 per s: 0.81 at 31 s ahead
    assert rising(climb, 31.0, 0.8)
    assert not rising(climb, 29.0, 0.8)
    assert not rising(list(reversed([u(10, 0.5), u(20, 0.4), u(30, 0.3)])), 100.0, 0.8)
    assert not rising([u(10, 0.5), u(20, 0.4), u(30, 0.3)], 100.0, 0.8)  # falling
    assert not rising([u(10, 0.95), u(20, 0.9), u(30, 0.85)], 10.0, 0.8)  # falling, still over
    assert not rising([u(10, 0.9), u(20, 0.9), u(30, 0.9)], 10.0, 0.8)  # flat
    assert not rising(climb[1:], 100.0, 0.8)  # two samples: no line yet
    assert not rising([u(10, 0.3), u(10, 0.4), u(10, 0.5)], 100.0, 0.8)  # no time between


def test_rising_utilisation_is_urgent_before_any_queue_forms() -> None:
    climb = [u(10, 0.3), u(20, 0.4), u(30, 0.5)]
    assert urgent_run(climb, 2.0, 1.0, 10.0) == 0  # nothing waits: the queue rules say no
    assert urgent_run(climb, 2.0, 1.0, 10.0, slope_lead_s=31.0) == 1  # only the newest
    assert urgent_run(climb, 2.0, 1.0, 10.0, slope_lead_s=29.0) == 0
    p = replace(FAST, slope_lead_s=31.0)
    s = model_signal(model(climb), 30, None, p, 10.0)
    assert (s.urgent_run, s.fired, s.fast, s.ahead) == (1, Zone.UP, True, False)
    off = model_signal(model(climb), 30, None, FAST, 10.0)
    assert (off.urgent_run, off.fired) == (0, Zone.HOLD)


# -- ahead of the curve -------------------------------------------------------------------


def ahead_model(expected: float | None, samples: tuple[Sample, ...] = ()) -> ModelState:
    return ModelState(demand(2.0), samples, expected_request_rate_per_s=expected)


def test_ahead_fires_when_the_forecast_passes_the_running_capacity() -> None:
    p = TriggerParams(ahead_capacity_fraction=1.0)
    assert ahead_of_capacity(ahead_model(5.0), 4.5, p)
    assert not ahead_of_capacity(ahead_model(4.5), 4.5, p)  # at it: not over
    assert ahead_of_capacity(ahead_model(4.0), 4.5, replace(p, ahead_capacity_fraction=0.8))
    assert not ahead_of_capacity(ahead_model(5.0), 4.5, TriggerParams())  # off by default
    assert not ahead_of_capacity(ahead_model(None), 4.5, p)  # no forecast
    assert not ahead_of_capacity(ahead_model(5.0), 0.0, p)  # nothing runs: the wake's
    s = model_signal(ahead_model(5.0, (q(10, 0),)), 10, None, p, 4.5)
    assert (s.fired, s.fast, s.ahead, s.urgent_run) == (Zone.UP, False, True, 0)
    assert p.fast_up and not TriggerParams().fast_up


def test_the_forecast_adds_an_instance_before_the_load_arrives() -> None:
    running = running_for(CLUSTER, demand(1.5))
    calm = tuple(q(t, 0) for t in (10, 20, 30))
    snap = ShiftSnapshot.of(
        CLUSTER, running, [ModelState(demand(1.5), calm, expected_request_rate_per_s=12.0)]
    )
    ahead = fast_policy(TriggerParams(ahead_capacity_fraction=1.0))
    d = ahead.decide(snap, 30, random.Random(7))
    assert (d.action, d.trigger) == ("shift", "up")
    assert d.reason.startswith(
        "llama-7b forecast over 100% of the running capacity (ahead of the curve); add llama-7b:"
    )
    assert d.target is not None and set(running) < set(d.target)  # nothing running moved
    held = fast_policy(TriggerParams()).decide(snap, 30, random.Random(7))
    assert (held.action, held.trigger) == ("hold", "none")


# -- what fast up plans for ----------------------------------------------------------------


def test_fast_up_drains_the_backlog_over_backlog_drain_s() -> None:
    m = ModelState(demand(2.0), (q(10, 60),))  # 60 waiting, 2 req/s, TTFT SLO 2 s
    snap = ShiftSnapshot.of(CLUSTER, running_for(CLUSTER, demand(1.5)), [m])
    # within the SLO: 2 + 60 / 2 = 32 req/s; over 60 s: 2 + 1 = 3, the (1 + up_step) x 2
    assert fast_policy()._loads(snap, {"llama-7b"}, [])["llama-7b"] == (32.0, 32.0)
    slow_drain = fast_policy(replace(FAST, backlog_drain_s=60.0))
    assert slow_drain._loads(snap, {"llama-7b"}, [])["llama-7b"] == (3.0, 3.0)
    assert slow_drain._loads(snap, set(), [])["llama-7b"] == (2.0, 2.0)  # not up: as measured


def test_a_growing_queue_adds_to_the_arrivals_the_finished_rate_misses() -> None:
    # the queue grew 20 -> 60 over the window's 30 s (the sample at -30 s is older than its
    # 60 s): 2 req/s finished + 4/3 req/s that waited + 60 drained over 60 s
    samples = (q(-30, 0), q(10, 20), q(40, 60))
    snap = ShiftSnapshot.of(
        CLUSTER, running_for(CLUSTER, demand(1.5)), [ModelState(demand(2.0), samples)]
    )
    slow_drain = fast_policy(replace(FAST, backlog_drain_s=60.0))
    now, expected = slow_drain._loads(snap, {"llama-7b"}, [])["llama-7b"]
    assert now == expected == pytest.approx(2.0 + 40 / 30 + 1.0, abs=1e-12)
    # a draining queue adds nothing; within the SLO (the default) the growth is not read
    draining = ShiftSnapshot.of(
        CLUSTER, snap.running, [ModelState(demand(2.0), (q(10, 90), q(40, 60)))]
    )
    assert slow_drain._loads(draining, {"llama-7b"}, [])["llama-7b"] == (3.0, 3.0)
    assert fast_policy()._loads(snap, {"llama-7b"}, [])["llama-7b"] == (32.0, 32.0)
    # sim engines at time scale 0.25 (a modelled second is 0.25 s of the controller's clock):
    # the queue grew 40 in 30 s of that clock, 120 modelled seconds (rates are per modelled s)
    scaled = replace(snap, time_scale=0.25)
    now, _ = slow_drain._loads(scaled, {"llama-7b"}, [])["llama-7b"]
    assert now == pytest.approx(2.0 + 40 / 30 * 0.25 + 1.0, abs=1e-12)


def test_the_new_trigger_numbers_read_from_yaml_and_are_checked() -> None:
    doc = {
        "triggers": {
            "fast_up_min_wait_fraction": 0.25,
            "slope_lead_s": 30,
            "slope_up_utilization": 0.9,
            "ahead_capacity_fraction": 1.0,
            "backlog_drain_s": 60,
        }
    }
    t = ShiftParams.from_mapping(doc).triggers
    assert (
        t.fast_up_min_wait_fraction,
        t.slope_lead_s,
        t.slope_up_utilization,
        t.ahead_capacity_fraction,
        t.backlog_drain_s,
    ) == (0.25, 30, 0.9, 1.0, 60)
    d = TriggerParams()  # every one off by default: the policy decides as before
    assert (d.fast_up_min_wait_fraction, d.slope_lead_s, d.ahead_capacity_fraction) == (0, 0, 0)
    assert d.backlog_drain_s == 0
    with pytest.raises(ValueError, match="slope_up_utilization must be in"):
        TriggerParams(slope_up_utilization=1.5)
    with pytest.raises(ValueError, match="backlog_drain_s must be >= 0"):
        TriggerParams(backlog_drain_s=-1)


# -- the outlook ---------------------------------------------------------------------------

# 10 s samples: 0.5 req/s, with a burst of 10 req/s in the first 20 s of every 100 s
SERIES = [(float(t), 10.0 if t % 100 < 20 else 0.5) for t in range(0, 600, 10)]


def test_bursts_are_the_runs_over_the_level() -> None:
    assert bursts(SERIES, 1.0) == [Burst(float(s), 10.0, 10.0) for s in range(0, 600, 100)]
    assert bursts([(0.0, 0.5), (10.0, 3.0), (20.0, 5.0)], 1.0) == [Burst(10.0, 10.0, 5.0)]
    assert bursts(SERIES, 20.0) == []


def test_the_outlook_reads_the_burst_pattern() -> None:
    o = outlook(SERIES, 595, ForecastParams(), horizon_s=60)
    assert (o.burst_peak_per_s, o.mean_interval_s, o.in_burst, len(o.bursts)) == (
        10.0,
        100.0,
        False,
        6,
    )
    assert o.burst_likelihood == pytest.approx(1 - math.exp(-0.6), abs=1e-12)
    assert o.demand_per_s == pytest.approx(10 * (1 - math.exp(-0.6)), abs=1e-12)
    # in a burst now: certain, whatever the interval
    now = outlook(SERIES, 505, ForecastParams(), horizon_s=60)
    assert (now.in_burst, now.burst_likelihood) == (True, 1.0)
    # no horizon: no burst can start within it
    assert outlook(SERIES, 595, ForecastParams(), horizon_s=0).burst_likelihood == 0.0


def test_the_outlook_of_a_steady_or_empty_history() -> None:
    steady = [(float(t), 2.0) for t in range(0, 400, 10)]
    o = outlook(steady, 390, ForecastParams(), horizon_s=120)
    assert (o.expected_per_s, o.burst_likelihood, o.burst_peak_per_s, o.bursts) == (
        pytest.approx(2.0, abs=1e-9),
        0.0,
        None,
        (),
    )
    empty = outlook([], 100, ForecastParams())
    assert (empty.horizon_s, empty.expected_per_s, empty.burst_likelihood) == (600.0, 0.0, 0.0)
    young = outlook([(0.0, 0.0), (10.0, 0.0), (20.0, 6.0)], 20, ForecastParams(), horizon_s=30)
    # one burst seen: the history's 20 s span stands in for the interval; in it now
    assert (young.expected_per_s, young.in_burst, young.burst_likelihood) == (6.0, True, 1.0)
    with pytest.raises(ValueError, match="burst_factor > 0"):
        outlook(steady, 390, ForecastParams(), burst_factor=0)


def test_the_outlook_reads_yesterday_over_its_own_horizon() -> None:
    params = ForecastParams(horizon_s=600, period_s=1000)
    day = [(float(t), 8.0 if 1100 <= t <= 1150 else 1.0) for t in range(0, 2100, 50)]
    ahead = outlook(day, 2050, params, horizon_s=100)  # yesterday's 1050..1150: the 8
    assert ahead.expected_per_s == 8.0
    before = outlook(day, 1990, params, horizon_s=100)  # 990..1090: not yet
    assert before.expected_per_s == pytest.approx(1.0, abs=1e-9)
