"""The policy's view of one model, as the live controller and the simulator both build it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from flexpipe.control.core.observe import model_state, model_states
from flexpipe.policies.planner import parse_models

ROOT = Path(__file__).resolve().parents[2]
(DEMAND,) = parse_models(yaml.safe_load((ROOT / "examples/models/llama-7b.yaml").read_text()), "m")


def test_an_idle_model_keeps_a_rate_only_while_its_minimum_is_above_zero() -> None:
    kept = model_state(replace(DEMAND, min_instances=0), 0.0, [], min_instances_floor=1)
    assert (kept.demand.request_rate_per_s, kept.min_instances) == (1e-3, 1)
    to_zero = model_state(replace(DEMAND, min_instances=0), 0.0, [], min_instances_floor=0)
    assert (to_zero.demand.request_rate_per_s, to_zero.min_instances) == (0.0, 0)
    # no reading yet: the configured demand
    first = model_state(DEMAND, None, [], min_instances_floor=1)
    assert first.demand.request_rate_per_s == DEMAND.request_rate_per_s


def test_model_states_take_each_models_rate_and_samples() -> None:
    other = replace(DEMAND, name="other")
    states = model_states([DEMAND, other], {"other": 2.5}, {}, min_instances_floor=1)
    assert [s.demand.request_rate_per_s for s in states] == [DEMAND.request_rate_per_s, 2.5]
    assert [s.samples for s in states] == [(), ()]
