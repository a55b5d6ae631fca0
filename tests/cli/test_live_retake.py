"""Fast up live by default (docs/shift-policy.md, "Fast up, slow down"): the live profile that
`flexpipe up` and `flexpipe controller` run without --shift-config, and a real `flexpipe up`
(sim engines, time scale 0.5) under it taking gpu1 back within a few ticks of the load
needing it, not after the 180 s cooldown of the down-shift that released it, with no
request failed (`python -m bench live_retake` drives it; the code defaults took 185 s)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import yaml

from bench.live_retake import run, shift_doc, wall_durations
from flexpipe.cli.common import load_shift_params
from flexpipe.examples import DEFAULT_SHIFT
from flexpipe.policies.shift import ShiftParams

# what the live profile changes from the code defaults, by name (its values are the profile's
# own, read from it): fast up, the forecast the diurnal scenario tuned
FAST_UP = {
    "triggers": {
        "fast_up_samples",
        "cooldown_blocks_up",
        "protect_priority",
        "fast_up_min_wait_fraction",
        "backlog_drain_s",
        "ahead_capacity_fraction",
    },
    "forecast": {"horizon_s", "trend_window_s", "min_trend_span_s"},
}


def test_the_live_profile_is_fast_up_over_the_code_defaults() -> None:
    """The profile sets the fast-up fields and nothing else (each differs from its code
    default, the rest keep theirs): an up-shift fires on the first urgent sample and no
    cooldown holds it; a down-shift keeps its samples and its cooldown."""
    doc = yaml.safe_load(DEFAULT_SHIFT.read_text())
    assert {k: set(v) for k, v in doc["shift"].items()} == FAST_UP
    live, code = load_shift_params(DEFAULT_SHIFT), ShiftParams()
    for section, keys in FAST_UP.items():
        mine, theirs = getattr(live, section), getattr(code, section)
        assert {k: getattr(mine, k) for k in keys} == doc["shift"][section]
        assert all(getattr(mine, k) != getattr(theirs, k) for k in keys), section
        assert dataclasses.replace(mine, **{k: getattr(theirs, k) for k in keys}) == theirs
    assert dataclasses.replace(live, triggers=code.triggers, forecast=code.forecast) == code
    assert live.triggers.fast_up_samples == 1 and not live.triggers.cooldown_blocks_up
    assert (live.triggers.num_samples, live.triggers.cooldown_s) == (
        code.triggers.num_samples,
        code.triggers.cooldown_s,
    )


def test_the_bench_scales_every_wall_clock_duration() -> None:
    """Every wall-clock duration of the triggers and the forecast (`_s`), set by the profile
    or not; nothing else."""
    assert set(wall_durations("triggers")) == {
        "window_s",
        "cooldown_s",
        "failure_window_s",
        "blacklist_s",
        "resource_settle_s",
        "reclaim_lead_s",
        "slope_lead_s",
    }
    assert set(wall_durations("forecast")) == {
        "horizon_s",
        "trend_window_s",
        "min_trend_span_s",
        "period_s",
    }
    live = load_shift_params(DEFAULT_SHIFT)
    doc = shift_doc("live", 0.25)
    triggers, forecast = doc["shift"]["triggers"], doc["shift"]["forecast"]
    # (read in modelled seconds: kept)
    assert triggers["backlog_drain_s"] == live.triggers.backlog_drain_s
    assert triggers["cooldown_s"] == live.triggers.cooldown_s * 0.25
    assert forecast["horizon_s"] == live.forecast.horizon_s * 0.25
    assert forecast["period_s"] == live.forecast.period_s * 0.25
    assert triggers["fast_up_samples"] == live.triggers.fast_up_samples  # (a count)
    code = ShiftParams()
    scaled = {
        s: {k: v * 0.5 for k, v in wall_durations(s).items()} for s in ("triggers", "forecast")
    }
    assert shift_doc("defaults", 0.5) == {"shift": scaled}
    assert scaled["triggers"]["window_s"] == code.triggers.window_s / 2


@pytest.mark.solo
@pytest.mark.timeout(480)  # ~80 s; the release may take 225 s (modelled) on a loaded machine
def test_gpu1_is_taken_back_within_a_few_ticks_of_the_load_needing_it(tmp_path: Path) -> None:
    args = argparse.Namespace(
        # (0.25 halves the test's time, but this VM's CPU hiccups then count 4x in the modelled
        # TTFT: a sample over half the SLO now and then kept the pair and never released gpu1)
        time_scale=0.5,
        tick_s=10.0,
        low_rate_per_s=1.0,
        # at most: it stops when the high load ends (the release takes 5 samples in the down
        # zone: ~40 s, ~225 s on a loaded machine; the retake a wake, ~25 s after it)
        low_s=600.0,
        high_rate_per_s=3.0,  # with the light load: 4 req/s, gpu1 needed (3.4 without it)
        high_s=60.0,
        prompt_tokens=2048,
        output_tokens=256,
        max_wall_s=300.0,
    )
    result = run("live", args, tmp_path)
    assert result["notes"] == [] and result["up_exit_code"] == 0, result
    assert result["release"].startswith("down:"), result
    assert result["retake"].startswith("up:"), result
    # within three ticks of the release, the light load's and the high load's first
    # requests being there from it on; the defaults wait for the 180 s cooldown
    assert result["release_to_decision_s"] <= 3 * args.tick_s, result
    assert result["low"]["num_failed"] == 0 and result["high"]["num_failed"] == 0, result
    assert result["high"]["num_requests"] == 180
