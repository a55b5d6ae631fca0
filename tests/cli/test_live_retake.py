"""Fast up live by default (docs/shift-policy.md, "Fast up, slow down"): the live profile that
`flexpipe up` and `flexpipe controller` run without --shift-config, and a real `flexpipe up`
(sim engines, time scale 0.25) under it taking gpu1 back within a few ticks of the load
needing it, not after the 180 s cooldown of the down-shift that released it, with no
request failed (`python -m bench live_retake` drives it; the code defaults took 185 s)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from bench.live_retake import run, shift_doc
from flexpipe.cli.common import load_shift_params
from flexpipe.examples import DEFAULT_SHIFT
from flexpipe.policies.shift import ShiftParams


def test_the_live_profile_is_fast_up_over_the_code_defaults() -> None:
    live, code = load_shift_params(DEFAULT_SHIFT), ShiftParams()
    assert live.triggers == dataclasses.replace(
        code.triggers,
        fast_up_samples=1,
        cooldown_blocks_up=False,
        protect_priority=True,
        fast_up_min_wait_fraction=0.25,
        backlog_drain_s=60,
        ahead_capacity_fraction=1.0,
    )
    assert live.forecast == dataclasses.replace(
        code.forecast, horizon_s=120, trend_window_s=300, min_trend_span_s=150
    )
    assert dataclasses.replace(live, triggers=code.triggers, forecast=code.forecast) == code


def test_the_bench_scales_the_wall_clock_durations_only() -> None:
    doc = shift_doc("live", 0.25)
    triggers = doc["shift"]["triggers"]
    assert (triggers["window_s"], triggers["cooldown_s"], triggers["resource_settle_s"]) == (
        15.0,
        45.0,
        7.5,
    )
    assert triggers["fast_up_samples"] == 1 and triggers["backlog_drain_s"] == 60
    assert shift_doc("defaults", 0.5) == {
        "shift": {"triggers": {"window_s": 30.0, "cooldown_s": 90.0, "resource_settle_s": 15.0}}
    }


def test_gpu1_is_taken_back_within_a_few_ticks_of_the_load_needing_it(tmp_path: Path) -> None:
    args = argparse.Namespace(
        time_scale=0.25,
        tick_s=10.0,
        low_rate_per_s=1.0,
        # past the release (5 samples in the down zone: ~40 s, ~225 s on a loaded machine) and
        # the retake (a wake, ~25 s after it), to about when the high load ends at the latest
        low_s=290.0,
        high_rate_per_s=3.0,  # with the light load: 4 req/s, gpu1 needed (3.4 without it)
        high_s=60.0,
        prompt_tokens=2048,
        output_tokens=256,
        max_wall_s=300.0,
    )
    result = run("live", args, tmp_path)
    assert result["notes"] == [] and result["up_exit_code"] == 0, result.get("up_tail")
    assert result["release"].startswith("down:"), result
    assert result["retake"].startswith("up:"), result
    # within three ticks of the release, the light load's and the high load's first
    # requests being there from it on; the defaults wait for the 180 s cooldown
    assert result["release_to_decision_s"] <= 3 * args.tick_s, result
    assert result["low"]["num_failed"] == 0 and result["high"]["num_failed"] == 0, result
    assert result["high"]["num_requests"] == 180
